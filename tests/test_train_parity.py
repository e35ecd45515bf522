"""benchmarks/state_modes_parity.py end to end at its default steps: a byte-level
transformer trained on stdlib source with every state mode. Low-precision
moments (bf16, 8-bit) must end within 2% of fp32 AdamW's final loss, and Kahan
summation (with fp32 or 8-bit moments) within 2% of an fp32 master copy.
Takes a few minutes on two CPU cores: the slow tier (pytest tests -m slow)."""

import json
import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

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
