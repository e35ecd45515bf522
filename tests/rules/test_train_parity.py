"""Training parity of the compact state modes.

benchmarks/state_modes_parity.py end to end at its default steps (the slow
tier: a few minutes on two CPU cores): a byte-level transformer trained on
stdlib source with every state mode. Low-precision moments (bf16, 8-bit) must
end within 2% of fp32 AdamW's final loss, and Kahan summation (with fp32 or
8-bit moments) within 2% of an fp32 master copy. That the compensation is what
keeps bf16 params on track is checked where it decides everything: updates
below half a bf16 ulp, which round-to-nearest bf16 never applies.
"""

import json
import math
import os
import sys

import pytest
import torch
from torch.testing import assert_close

import swap_optimizer as so
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import state_modes_parity  # noqa: E402

TOLERANCE = 0.02
COMPARED = {
    "fp32 params, bf16 moments": "fp32 AdamW",
    "fp32 params, 8-bit moments": "fp32 AdamW",
    "bf16 params + Kahan": "bf16 params + fp32 master",
    "bf16 params + Kahan + 8-bit moments": "bf16 params + fp32 master",
}


@pytest.mark.slow
def test_state_modes_train_within_two_percent_of_their_reference(tmp_path, capsys):
    report_path = tmp_path / "parity.json"
    assert state_modes_parity.main(["--out-json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["settings"]["steps"] == 1000
    rows = {row["mode"]: row for row in report["table"]}
    assert list(rows) == [name for name, *_ in state_modes_parity.MODES]
    final = {name: row["final_loss"] for name, row in rows.items()}
    assert all(math.isfinite(loss) for loss in final.values()), final
    # It learned: from ln(256) = 5.55 nats at init to well under 3.
    assert final["fp32 AdamW"] < 3.0 and final["bf16 params + fp32 master"] < 3.0, final
    for mode, reference in COMPARED.items():
        ratio = final[mode] / final[reference]
        assert abs(ratio - 1) <= TOLERANCE, f"{mode}: {final[mode]:.4f} vs {reference} {final[reference]:.4f}"
        assert rows[mode]["within_tolerance"] is True and math.isclose(rows[mode]["ratio"], ratio)
    # bf16 params without compensation fall behind (docs/usage.md); the sharp check is the one below.
    for mode in ("bf16 params + Kahan", "bf16 params + Kahan + 8-bit moments"):
        assert final["bf16 params, no compensation"] > final[mode], final
    # The SwapOptimizer modes moved what their state formats say (params of
    # >= 4096 elements hold nearly all of them): fp32 moments 8 bytes, bf16 4,
    # 8-bit about 2 (+ absmax scales); an fp32 master adds 4, a bf16 Kahan buffer 2.
    each_way = {name: row["bytes_per_param_each_way"] for name, row in rows.items()}
    assert each_way["fp32 AdamW"] is None and each_way["bf16 params, no compensation"] is None
    for mode, expected in [("fp32 params, bf16 moments", 4), ("fp32 params, 8-bit moments", 2),
                           ("bf16 params + fp32 master", 12), ("bf16 params + Kahan", 10),
                           ("bf16 params + Kahan + 8-bit moments", 4)]:
        assert expected <= each_way[mode] <= expected + 0.1, (mode, each_way[mode])
    curves = report["curves"]
    assert set(curves) == set(rows) and all(len(c["steps"]) == 100 == len(c["loss"]) for c in curves.values())
    out = capsys.readouterr().out
    assert "| fp32 params, 8-bit moments |" in out


@pytest.mark.parametrize("state_dtype, kept_tolerance", [(torch.float32, 2e-4), (torch.uint8, 2e-3)],
                         ids=["fp32 moments", "8-bit moments"])
def test_kahan_applies_updates_below_half_a_bf16_ulp(state_dtype, kept_tolerance):
    """bf16 params in [1, 2) (one ulp 2**-7) stepped 20 times by lr 1e-3 (Adam's
    update of a constant grad is about lr): round-to-nearest bf16 AdamW never
    moves them, and neither would a Kahan step that lost its compensation.
    With Kahan summation each param follows an fp32 AdamW run on the same
    start (2.6 ulps away by the end): param + compensation within
    kept_tolerance of it (fp32 moments: the bf16 buffer's own rounding, at
    most 2**-17 a step; 8-bit moments add their quantization error, measured
    8e-4), and the param within its rounding (half an ulp, rtol 2**-8) of that."""
    generator = torch.Generator().manual_seed(9)
    n = 8192  # at least 4096 elements: 8-bit moments
    start = (1 + torch.rand(n, generator=generator)).bfloat16()
    grad = (0.5 + torch.rand(n, generator=generator)) * torch.randn(n, generator=generator).sign()

    def run(dtype, make_optimizer):
        param = start.to(dtype, copy=True).requires_grad_()
        optimizer = make_optimizer([param])
        for _ in range(20):
            param.grad = grad.to(dtype)
            optimizer.step()
        return param.detach(), optimizer

    def adamw(params, **flags):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, **flags)

    fp32, _ = run(torch.float32, lambda params: adamw(params, foreach=False))
    plain_bf16, _ = run(torch.bfloat16, lambda params: adamw(params, foreach=False))
    assert torch.equal(plain_bf16, start), "every update is below half an ulp: round-to-nearest stalls"
    kahan, optimizer = run(torch.bfloat16, lambda params: so.SwapOptimizer(
        adamw(params), swap_times=1, min_numel=0, kahan_summation=True, state_dtype=state_dtype))
    kept = kahan.float() + next(iter(optimizer.state.values()))["compensation"].float()
    assert_close(kept, fp32, rtol=0, atol=kept_tolerance)
    assert_close(kahan.float(), fp32, rtol=2 ** -8, atol=kept_tolerance)
