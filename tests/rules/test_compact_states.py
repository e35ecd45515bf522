"""Compact states: bf16 moments with stochastic rounding, blockwise 8-bit
moments, Kahan-compensated 16-bit params.

Each mode is bitwise identical across swap_times, num_arenas and split points;
the CPU kernel matches references written here from torch ops (decode, torch's
own AdamW update in fp32, encode); quantization round trips within the code
map's bound; state dicts round trip exactly and convert between modes; bad
combinations are refused. Tolerances: fp32 values of one update within
rtol 1e-6 / atol 1e-9 of the reference (the same operations, so usually the
same bits); an 8-bit code may differ by one where the fp32 value sits within an
ulp of a midpoint (at most 0.1% of them).
"""

import copy

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import swap_optimizer as so
from swap_optimizer.rules import fused_kernel
from conftest import DEVICES, requires_cuda
from test_split_params import adamw, build, snapshot, train

# One update computed by the kernel and by torch.optim differs by a few ulps
# (torch applies the step size after the division, the kernel before).
STEP_TOL = dict(rtol=1e-5, atol=1e-7)
M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


# ----------------------------------------------------------------- references
def reference_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic map, built here in float64 from its definition."""
    values = [0.0, 1.0]
    for i in range(7):
        fractions = 2 ** i if signed else 2 ** (i + 1)
        bounds = torch.linspace(0.1, 1.0, fractions + 1, dtype=torch.float64)
        means = (bounds[:-1] + bounds[1:]) / 2 * 10.0 ** (i - 6)
        values += means.tolist() + ((-means).tolist() if signed else [])
    return torch.tensor(sorted(values), dtype=torch.float64).float()


def maps():
    signed, unsigned = so._C.code_maps()
    return {"exp_avg": signed, "exp_avg_sq": unsigned, "max_exp_avg_sq": unsigned}


def ref_quantize(values: torch.Tensor, moment: str):
    """Blockwise absmax quantization from torch ops: nearest code by the
    midpoints (ties down), a positive exp_avg_sq never code 0, max_exp_avg_sq
    rounded up."""
    table = maps()[moment]
    flat = values.reshape(-1).float()
    blocks = -(-flat.numel() // 256)
    padded = torch.cat([flat, flat.new_zeros(blocks * 256 - flat.numel())]).view(blocks, 256)
    absmax = padded.abs().amax(1)
    norm = torch.where(absmax[:, None] > 0, padded / absmax[:, None], 0.0)
    if moment == "max_exp_avg_sq":
        codes = torch.searchsorted(table, norm.contiguous())
        codes = codes + ((table[codes.clamp(max=255)] * absmax[:, None] < padded) & (codes < 255)).long()
    else:
        codes = torch.bucketize(norm, (table[:-1] + table[1:]) / 2)
        if moment == "exp_avg_sq":
            codes[(codes == 0) & (padded > 0)] = 1
    return codes.reshape(-1)[:flat.numel()].to(torch.uint8).view(values.shape), absmax


def ref_dequantize(codes, absmax, moment):
    flat = maps()[moment][codes.reshape(-1).long()] * absmax.repeat_interleave(256)[:codes.numel()]
    return flat.view(codes.shape)


def mix64(x):
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def mix32(x):
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))


def ref_stochastic_bf16(values: torch.Tensor, seed: int, param_index: int, moment: int, step: int,
                        first_index: int = 0) -> torch.Tensor:
    """Stochastic rounding to bf16 keyed by (seed, param, moment, global element index, step)."""
    with np.errstate(over="ignore"):
        key = mix64(mix64(np.uint64(seed) + np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(param_index * 4 + moment))
        key32 = np.uint32((key ^ (key >> np.uint64(32))) & np.uint64(0xFFFFFFFF))
        index = np.arange(values.numel(), dtype=np.uint64) + np.uint64(first_index)
        low, high = (index & np.uint64(0xFFFFFFFF)).astype(np.uint32), (index >> np.uint64(32)).astype(np.uint32)
        element = mix32(low ^ mix32(high ^ mix32(np.uint32(step))))
        random = mix32(key32 ^ element).astype(np.uint64)
    bits = values.reshape(-1).float().numpy().view(np.uint32).astype(np.uint64)
    rounded = ((bits + (random & np.uint64(0xFFFF))) >> np.uint64(16)).astype(np.uint16)
    return torch.from_numpy(rounded.view(np.int16).copy()).view(torch.bfloat16).view(values.shape)


def torch_adamw_step(param32, grad32, moments: dict, step: int, lr=1e-2, amsgrad=False):
    """torch.optim.AdamW (single-tensor path) on fp32 copies; returns (param, moments)."""
    p = param32.clone().requires_grad_()
    opt = torch.optim.AdamW([p], lr=lr, betas=(0.9, 0.99), weight_decay=0.1, amsgrad=amsgrad, foreach=False)
    opt.state[p] = {"step": torch.tensor(float(step)), **{k: v.clone().float() for k, v in moments.items()}}
    p.grad = grad32.clone()
    opt.step()
    return p.detach(), {k: opt.state[p][k] for k in moments}


def random_moments(shape, amsgrad, generator):
    m = torch.randn(shape, generator=generator) * 1e-2
    v = torch.rand(shape, generator=generator) * 1e-4
    v[..., :300] *= 1e-6  # blocks whose scale spans decades
    moments = {"exp_avg": m, "exp_avg_sq": v}
    if amsgrad:
        moments["max_exp_avg_sq"] = v * (1 + torch.rand(shape, generator=generator))
    return moments


def one_step_swap(param, grad, saved_state, lr=1e-2, amsgrad=False, **fields):
    opt = so.SwapOptimizer(torch.optim.AdamW([param], lr=lr, betas=(0.9, 0.99), weight_decay=0.1, amsgrad=amsgrad),
                           swap_times=1, min_numel=0, **fields)
    sd = opt.state_dict()
    sd["state"] = {0: saved_state}
    opt.load_state_dict(sd)
    param.grad = grad
    opt.step()
    return opt


# --------------------------------------------------------------- code maps
def test_code_maps_are_the_dynamic_maps():
    for signed, table in zip((True, False), so._C.code_maps()):
        assert table.dtype == torch.float32 and table.shape == (256,)
        assert torch.all(table[1:] > table[:-1]), "ascending, 256 distinct codes"
        assert table[-1] == 1.0 and (table == 0).sum() == 1
        assert_close(table, reference_map(signed), rtol=1e-6, atol=0)
        assert (table[0] < -0.99) if signed else (table[0] == 0)


@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"])
def test_quantize_round_trip_within_map_bound(moment):
    g = torch.Generator().manual_seed(1)
    n = 256 * 7 + 100  # a partial last block
    values = torch.randn(n, generator=g) * torch.logspace(-6, 0, n)[torch.randperm(n, generator=g)]
    if moment != "exp_avg":
        values = values.abs()
    values[256:512] = 0.0  # a block whose absmax is 0
    codes, absmax = so.compact.quantize(values, moment)
    ref_codes, ref_absmax = ref_quantize(values, moment)
    assert torch.equal(codes, ref_codes) and torch.equal(absmax, ref_absmax)
    decoded = so.compact.dequantize(codes, absmax, moment)
    assert torch.equal(decoded[256:512], torch.zeros(256))
    table = maps()[moment]
    scale = absmax.repeat_interleave(256)[:n]
    # The distance from a value to the code it gets is at most the gap to the
    # next code (rounded up) or half of it (nearest), times the scale.
    gaps = torch.cat([table[1:] - table[:-1], table.new_zeros(1)])
    gap_at = gaps[codes.long()].maximum(gaps[(codes.long() - 1).clamp(min=0)])
    bound = (gap_at if moment == "max_exp_avg_sq" else gap_at / 2) * scale
    if moment == "exp_avg":  # the signed map ends at table[0] > -1: -absmax is that far from its code
        bound = torch.where(codes == 0, bound.maximum((1 + table[0]) * scale), bound)
    if moment == "exp_avg_sq":  # a positive value never codes 0: up to table[1] from code 1
        bound = torch.where(codes == 1, bound.maximum(table[1] * scale), bound)
        assert torch.all((codes == 0) == (values == 0))
    bound = bound * (1 + 1e-5) + 1e-30  # the products above round
    assert torch.all((decoded - values).abs() <= bound)
    if moment == "max_exp_avg_sq":
        assert torch.all(decoded >= values), "rounded up: still a maximum"


# ------------------------------------------------------- kernel references
@pytest.mark.parametrize("amsgrad", [False, True])
def test_8bit_update_matches_torch_reference(amsgrad):
    g = torch.Generator().manual_seed(2)
    shape = (37, 256)  # 9472 elements: quantized, last block full; see partial below
    param = torch.randn(shape, generator=g)
    grad = torch.randn(shape, generator=g) * 1e-2
    saved = {"step": torch.tensor(4.0)}
    moments = random_moments(shape, amsgrad, g)
    for key, value in moments.items():
        saved[f"{key}_codes"], saved[f"{key}_absmax"] = ref_quantize(value, key)
    decoded = {k: ref_dequantize(saved[f"{k}_codes"], saved[f"{k}_absmax"], k) for k in moments}
    expected_param, expected = torch_adamw_step(param, grad, decoded, step=4, amsgrad=amsgrad)

    p = param.clone().requires_grad_()
    opt = one_step_swap(p, grad.clone(), saved, amsgrad=amsgrad, state_dtype=torch.uint8)
    assert_close(p.detach(), expected_param, **STEP_TOL)
    state = opt.state[p]
    assert state["step"].item() == 5 and "exp_avg" not in state
    for key, value in expected.items():
        codes, absmax = ref_quantize(value, key)
        assert_close(state[f"{key}_absmax"], absmax, **STEP_TOL)
        differ = state[f"{key}_codes"].long() - codes.long()
        assert differ.abs().max() <= 1 and (differ != 0).float().mean() <= 1e-3, key


@pytest.mark.parametrize("device", DEVICES)
def test_8bit_kernel_encoding_equals_reference_bitwise(device):
    """With betas (0, 0) the updated moments are exactly grad and grad**2, so the
    kernel's codes and scales must be the reference's bit for bit: every block
    scale, nearest and round-up code, a zero block and a partial last block.
    The grads are synthetic, so the CUDA kernel must give these bits too."""
    g = torch.Generator().manual_seed(6)
    n = 256 * 40 + 77
    grad = torch.randn(n, generator=g) * torch.logspace(-8, 0, n)[torch.randperm(n, generator=g)]
    grad[512:768] = 0.0
    p = torch.randn(n, generator=g).to(device).requires_grad_()
    opt = so.SwapOptimizer(torch.optim.AdamW([p], lr=0.0, betas=(0.0, 0.0), weight_decay=0.0, amsgrad=True),
                           swap_times=1, min_numel=0, state_dtype=torch.uint8)
    p.grad = grad.to(device)
    opt.step()
    state = opt.state[p]
    for key, value in (("exp_avg", grad), ("exp_avg_sq", grad * grad), ("max_exp_avg_sq", grad * grad)):
        codes, absmax = ref_quantize(value, key)
        assert torch.equal(state[f"{key}_absmax"], absmax), key
        assert torch.equal(state[f"{key}_codes"], codes), key


@pytest.mark.parametrize("device", DEVICES)
def test_nan_moments_encode_alike_in_kernel_and_python(device):
    """A NaN moment (a diverged run) is stored as code 0 and left out of its
    block's absmax, by the kernel (CPU and CUDA) and by the encoder used when
    loading."""
    grad = torch.randn(5000, generator=torch.Generator().manual_seed(7))
    grad[[3, 700]] = float("nan")
    p = torch.zeros(5000, device=device).requires_grad_()
    opt = so.SwapOptimizer(torch.optim.AdamW([p], lr=0.0, betas=(0.0, 0.0), weight_decay=0.0, amsgrad=True),
                           swap_times=1, min_numel=0, state_dtype=torch.uint8)
    p.grad = grad.to(device)
    opt.step()
    for key, value in (("exp_avg", grad), ("exp_avg_sq", grad * grad), ("max_exp_avg_sq", grad * grad)):
        codes, absmax = so.compact.quantize(value, key)
        assert torch.isfinite(absmax).all() and codes[3] == 0 and codes[700] == 0
        assert torch.equal(opt.state[p][f"{key}_codes"], codes) and torch.equal(opt.state[p][f"{key}_absmax"], absmax)


def test_8bit_rarely_used_elements_take_bounded_steps():
    """Blocks mixing busy elements with rarely used ones (embedding rows of rare
    tokens): the rare ones' exp_avg_sq is far below the block's absmax. When
    their grad is then 0, their step stays bounded, as in plain AdamW, instead
    of lr * m / eps (which a second moment coded 0 would give). The busy ones,
    whose grad stays 1, step by lr as in AdamW (m / sqrt(v) is 1 for a constant
    grad; rtol 1e-3: the difference of two params of order 1 is exact to their
    ulp, 2.4e-4 of lr)."""
    p = torch.randn(4096, generator=torch.Generator().manual_seed(8)).requires_grad_()
    lr = 1e-3
    opt = so.SwapOptimizer(torch.optim.AdamW([p], lr=lr, weight_decay=0.0), swap_times=1, min_numel=0,
                           state_dtype=torch.uint8)
    busy = torch.arange(4096) % 2 == 1  # every block has both kinds
    grad = torch.ones(4096)
    grad[~busy] = 1e-4
    p.grad = grad
    opt.step()
    for _ in range(5):
        before = p.detach().clone()
        grad = torch.ones(4096)
        grad[~busy] = 0.0
        p.grad = grad
        opt.step()
        moved = p.detach() - before
        assert moved[~busy].abs().max() <= 2 * lr
        assert_close(moved[busy], torch.full_like(moved[busy], -lr), rtol=1e-3, atol=0)


def test_stochastic_bf16_rounding_is_unbiased():
    """Every element holds the same fp32 moment after the update, 0.2 to 0.8
    of a bf16 ulp above a bf16 value: rounded stochastically (each element
    draws its own number), their mean is that value, to 4 standard errors
    (about 0.03 ulp here); rounding to nearest would be off by 0.2 ulp or more."""
    g = torch.Generator().manual_seed(18)
    n = 6144
    param = torch.randn(n, generator=g)
    grad = torch.full((n,), torch.randn(1, generator=g).item() * 1e-2)
    saved = {"step": torch.tensor(6.0), "exp_avg": torch.full((n,), 3e-3).bfloat16(),
             "exp_avg_sq": torch.full((n,), 2e-5).bfloat16()}
    opt_param = param.clone().requires_grad_()
    opt = one_step_swap(opt_param, grad.clone(), saved, state_dtype=torch.bfloat16, rounding_seed=99)
    _, expected = torch_adamw_step(param, grad, {k: v for k, v in saved.items() if k != "step"}, step=6)
    for key in ("exp_avg", "exp_avg_sq"):
        value = expected[key][:1]
        assert torch.all(expected[key] == value)
        toward_zero = value.view(torch.int32) & -0x10000  # the value's two bf16 neighbours, as fp32
        low, high = toward_zero.view(torch.float32), (toward_zero + 0x10000).view(torch.float32)
        fraction = ((value - low) / (high - low)).item()
        assert 0.2 <= fraction <= 0.8, (key, fraction)
        ours = opt.state[opt_param][key].float()
        assert set(ours.unique().tolist()) == {low.item(), high.item()}
        standard_error = (high - low).abs().item() * (fraction * (1 - fraction) / n) ** 0.5
        assert abs(ours.mean().item() - value.item()) < 4 * standard_error, (key, fraction)


def test_8bit_small_params_keep_plain_states_and_partial_blocks_work():
    g = torch.Generator().manual_seed(3)
    small, odd = torch.randn(4095, generator=g), torch.randn(5000, generator=g)  # 5000 = 19 blocks + 136
    params = [small.clone().requires_grad_(), odd.clone().requires_grad_()]
    opt = so.SwapOptimizer(torch.optim.AdamW(params, lr=1e-2), swap_times=1, min_numel=0, state_dtype=torch.uint8)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    assert set(opt.state[params[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[params[0]]["exp_avg"].dtype == torch.float32
    assert opt.state[params[1]]["exp_avg_absmax"].shape == (20,)
    ref = torch.optim.AdamW([q := odd.clone().requires_grad_()], lr=1e-2, foreach=False)
    q.grad = params[1].grad.clone()
    ref.step()
    codes, absmax = ref_quantize(ref.state[q]["exp_avg"], "exp_avg")
    assert_close(opt.state[params[1]]["exp_avg_absmax"], absmax, **STEP_TOL)
    assert (opt.state[params[1]]["exp_avg_codes"].long() - codes.long()).abs().max() <= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("param_dtype, first_index", [(torch.float32, 0), (torch.bfloat16, 0), (torch.float16, 0),
                                                      # a shard whose elements cross 2^32 in the whole param, in
                                                      # the middle of a vector iteration (2^32 - 2500 = 12 mod 16)
                                                      (torch.float32, 2 ** 32 - 2500)])
def test_stochastic_bf16_moments_match_reference(param_dtype, first_index, device, monkeypatch):
    g = torch.Generator().manual_seed(4)
    shape = (64, 96)
    param = torch.randn(shape, generator=g).to(param_dtype)
    grad = (torch.randn(shape, generator=g) * 1e-2).to(param_dtype)
    moments = {k: v.bfloat16() for k, v in random_moments(shape, False, g).items()}
    saved = {"step": torch.tensor(6.0), **moments}
    opt_param = param.clone().to(device).requires_grad_()
    if first_index:  # as FSDP2's shard offsets (distributed._global_offset) give it
        monkeypatch.setattr(fused_kernel, "_global_offset", lambda p, i: first_index)
    opt = one_step_swap(opt_param, grad.to(device), saved, state_dtype=torch.bfloat16, rounding_seed=1234)
    expected_param, expected = torch_adamw_step(param.float(), grad.float(), moments, step=6)
    assert_close(opt_param.detach().cpu().float(), expected_param.to(param_dtype).float(), **STEP_TOL)
    for moment_index, key in enumerate(("exp_avg", "exp_avg_sq")):
        ours = opt.state[opt_param][key].cpu()
        assert ours.dtype == torch.bfloat16
        reference = ref_stochastic_bf16(expected[key], 1234, 0, moment_index, 7, first_index=first_index)
        assert (ours.view(torch.int16) != reference.view(torch.int16)).float().mean() <= 1e-3
        if first_index:  # the vector iterations around 2^32, whose lanes straddle it, exactly
            crossing = 2 ** 32 - first_index
            window = slice(crossing - 32, crossing + 32)
            assert torch.equal(ours.view(-1)[window].view(torch.int16), reference.view(-1)[window].view(torch.int16))
        nearest = expected[key].bfloat16()
        assert (ours != nearest).any(), "stochastic rounding rounds some values away from the nearest"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
def test_kahan_update_matches_reference(param_dtype, device):
    g = torch.Generator().manual_seed(5)
    shape = (48, 128)
    param = torch.randn(shape, generator=g).to(param_dtype)
    compensation = ((torch.rand(shape, generator=g) - 0.5) * param.float().abs() * 2 ** -9).to(param_dtype)
    grad = (torch.randn(shape, generator=g) * 1e-2).to(param_dtype)
    moments = {k: v.float() for k, v in random_moments(shape, False, g).items()}
    saved = {"step": torch.tensor(2.0), **moments, "compensation": compensation}
    opt_param = param.clone().to(device).requires_grad_()
    opt = one_step_swap(opt_param, grad.to(device), saved, lr=1e-4, kahan_summation=True, state_dtype=torch.float32)
    start = param.float() + compensation.float()
    value, _ = torch_adamw_step(start, grad.float(), moments, step=2, lr=1e-4)
    updated = opt_param.detach().cpu()
    assert_close(updated, value.to(param_dtype), rtol=0, atol=0)
    # What the param lost is kept: param + compensation is the fp32 value, to the
    # update's own few ulps, where the param alone is off by up to half its ulp.
    kept = updated.float() + opt.state[opt_param]["compensation"].cpu().float()
    assert_close(kept, value, **STEP_TOL)
    assert (kept - value).abs().sum() < 0.05 * (updated.float() - value).abs().sum()


def test_kahan_buffer_resets_when_the_param_is_written_outside_step():
    model = build("cpu", torch.bfloat16)
    opt = so.SwapOptimizer(adamw(model.parameters()), swap_times=2, kahan_summation=True)
    train(model, opt, 2, "cpu")
    weight = model.mid.weight
    assert opt.state[weight]["compensation"].abs().sum() > 0
    with torch.no_grad():
        weight.mul_(0.5)  # bumps its version: the old compensation means nothing now
    train(model, opt, 1, "cpu", first_step=2)
    twin = build("cpu", torch.bfloat16)
    twin_opt = so.SwapOptimizer(adamw(twin.parameters()), swap_times=2, kahan_summation=True)
    train(twin, twin_opt, 2, "cpu")
    with torch.no_grad():
        twin.mid.weight.mul_(0.5)
        twin_opt.state[twin.mid.weight]["compensation"].zero_()  # written by hand: what the reset must do
    train(twin, twin_opt, 1, "cpu", first_step=2)
    assert torch.equal(weight, twin.mid.weight)


# ------------------------------------------- bitwise across batching and splits
MODES = {
    "fp32 params, bf16 moments": dict(fields=dict(state_dtype=torch.bfloat16, rounding_seed=7)),
    "fp32 params, 8-bit moments": dict(fields=dict(state_dtype=torch.uint8)),
    "8-bit moments, amsgrad": dict(fields=dict(state_dtype=torch.uint8), flags=dict(amsgrad=True)),
    "bf16 params, Kahan, 8-bit moments": dict(dtype=torch.bfloat16,
                                              fields=dict(state_dtype=torch.uint8, kahan_summation=True)),
    "bf16 params, Kahan, bf16 moments": dict(dtype=torch.bfloat16,
                                             fields=dict(state_dtype=torch.bfloat16, kahan_summation=True)),
    "fp16 params, Kahan, fp32 moments": dict(dtype=torch.float16,
                                             fields=dict(state_dtype=torch.float32, kahan_summation=True)),
}


def run_mode(device, spec, swap_times, num_arenas, steps=4):
    model = build(device, spec.get("dtype", torch.float32))
    optimizer = so.SwapOptimizer(adamw(model.parameters(), **spec.get("flags", {})), swap_times=swap_times,
                                 num_arenas=num_arenas, **spec["fields"])
    train(model, optimizer, steps, device)
    return model, optimizer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
def test_modes_bitwise_across_swap_times_arenas_and_splits(device, mode):
    results = []
    for swap_times, num_arenas in ((1, 2), (8, 3), (5, 2), (16, 2)):
        model, optimizer = run_mode(device, MODES[mode], swap_times, num_arenas)
        assert optimizer.memory_stats()["split_params"] == (swap_times > 1)
        results.append(snapshot(optimizer, model))
    for params, states in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0]))
        assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                   for a, b in zip(states, results[0][1]))


def run_mode_on_grads(device, spec, steps=4):
    """run_mode's model and optimizer stepped with synthetic grads: fresh
    random ones drawn on the CPU, so every device gets the same bits (a
    forward and backward on two devices differ in low bits, GEMMs and
    reductions in their order of summation). A few whole blocks of zeros, and
    a grad far larger than the rest, give 8-bit blocks of every scale."""
    model = build(device, spec.get("dtype", torch.float32))
    optimizer = so.SwapOptimizer(adamw(model.parameters(), **spec.get("flags", {})), swap_times=4, num_arenas=2,
                                 **spec["fields"])
    generator = torch.Generator().manual_seed(12)
    for _ in range(steps):
        for p in model.parameters():
            grad = torch.randn(p.shape, generator=generator) * 1e-2
            grad.view(-1)[:512] = 0.0
            grad.view(-1)[-1] = 3.0
            p.grad = grad.to(p.dtype).to(device)
        optimizer.step()
    return model, optimizer


@requires_cuda
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_kernel_equals_cpu_kernel(mode):
    cpu_model, cpu_optimizer = run_mode_on_grads("cpu", MODES[mode])
    cuda_model, cuda_optimizer = run_mode_on_grads("cuda", MODES[mode])
    if MODES[mode]["fields"].get("state_dtype") == torch.uint8:
        assert any("exp_avg_codes" in cuda_optimizer.state[p] for p in cuda_model.parameters()), "8-bit rows ran"
    cpu, cuda = snapshot(cpu_optimizer, cpu_model), snapshot(cuda_optimizer, cuda_model)
    for a, b in zip(cpu[0], cuda[0]):
        assert torch.equal(a, b.cpu())
    for a, b in zip(cpu[1], cuda[1]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k].cpu()) for k in a)


@pytest.mark.parametrize("mode", list(MODES))
def test_synthetic_grad_runs_repeat_bitwise_and_move_every_param(mode):
    """The CUDA comparison above is only as good as its runs, which this
    machine may not have a GPU for: on the CPU the same run repeats bit for
    bit, moves every param and, in 8-bit modes, keeps 8-bit moments."""
    spec = MODES[mode]
    (model, optimizer), (again, _) = run_mode_on_grads("cpu", spec), run_mode_on_grads("cpu", spec)
    start = build("cpu", spec.get("dtype", torch.float32))
    for a, b, before in zip(model.parameters(), again.parameters(), start.parameters()):
        assert torch.equal(a, b) and not torch.equal(a, before)
    if spec["fields"].get("state_dtype") == torch.uint8:
        assert any("exp_avg_codes" in optimizer.state[p] for p in model.parameters())


def test_training_with_compact_states_tracks_fp32():
    """60 steps: each compact mode's held-out loss ends as close to torch's
    fp32 AdamW's as 5% of the way that run came down from the untrained loss
    (measured: under 0.4%; a step that did nothing would be 100%). The long
    parity run is tests/rules/test_train_parity.py."""
    from test_split_params import loss_of

    def held_out_loss(model):
        return sum(loss_of(model, 1000 + k, "cpu").item() for k in range(4))

    def trained_loss(make_optimizer):
        model = build("cpu")
        train(model, make_optimizer(model.parameters()), 60, "cpu")
        return held_out_loss(model)

    untrained = held_out_loss(build("cpu"))
    reference = trained_loss(lambda params: adamw(params, foreach=False))
    progress = untrained - reference
    assert progress > 0.02 * untrained
    for fields in (dict(state_dtype=torch.bfloat16), dict(state_dtype=torch.uint8)):
        loss = trained_loss(lambda params: so.SwapOptimizer(adamw(params), swap_times=4, **fields))
        assert abs(loss - reference) < 0.05 * progress, (fields, loss, reference, untrained)


# ---------------------------------------------------------------- state dicts
@pytest.mark.parametrize("mode", ["fp32 params, bf16 moments", "bf16 params, Kahan, 8-bit moments",
                                  "8-bit moments, amsgrad"])
def test_state_dict_round_trip_resumes_bitwise(mode):
    spec = MODES[mode]
    straight_model, straight = run_mode("cpu", spec, 4, 2, steps=5)

    model, optimizer = run_mode("cpu", spec, 4, 2, steps=3)
    saved = copy.deepcopy(optimizer.state_dict())
    form = saved["param_groups"][0][so.compact.FORMAT_KEY]
    for entry in saved["state"].values():
        assert all(not (k in so.compact.MOMENTS and v.dtype == torch.uint8) for k, v in entry.items())
    resumed_model = build("cpu", spec.get("dtype", torch.float32))
    resumed_model.load_state_dict(model.state_dict())
    fields = dict(spec["fields"])
    fields.pop("rounding_seed", None)  # the seed comes from the state dict
    resumed = so.SwapOptimizer(adamw(resumed_model.parameters(), **spec.get("flags", {})), swap_times=3,
                               **fields)
    resumed.load_state_dict(saved)
    if "rounding_seed" in spec["fields"]:
        assert form["rounding_seed"] == spec["fields"]["rounding_seed"]
    again = resumed.state_dict()
    for key, entry in saved["state"].items():
        assert all(torch.equal(entry[k], again["state"][key][k]) for k in entry)
    train(resumed_model, resumed, 2, "cpu", first_step=3)
    assert all(torch.equal(a, b) for a, b in zip(resumed_model.parameters(), straight_model.parameters()))


def test_state_dicts_convert_between_modes():
    model, plain = run_mode("cpu", dict(fields={}), 2, 2, steps=3)
    plain_sd = plain.state_dict()
    weight_id = [id(p) for p in model.parameters()].index(id(model.embed.weight))
    # A plain torch state dict loaded into an 8-bit optimizer is quantized.
    eight = so.SwapOptimizer(adamw(model.parameters()), swap_times=2, state_dtype=torch.uint8)
    eight.load_state_dict(plain_sd)
    state = eight.state[model.embed.weight]
    codes, absmax = ref_quantize(plain_sd["state"][weight_id]["exp_avg"], "exp_avg")
    assert torch.equal(state["exp_avg_codes"], codes) and torch.equal(state["exp_avg_absmax"], absmax)
    # An 8-bit state dict loaded into an fp32 optimizer is decoded.
    eight_sd = eight.state_dict()
    back = so.SwapOptimizer(adamw(model.parameters()), swap_times=2)
    back.load_state_dict(eight_sd)
    decoded = ref_dequantize(codes, absmax, "exp_avg")
    assert torch.equal(back.state[model.embed.weight]["exp_avg"], decoded)
    # The documented conversion: torch.optim.AdamW loads it.
    plain_again = so.dequantize_state_dict(eight_sd)
    torch_opt = adamw(model.parameters())
    torch_opt.load_state_dict(plain_again)
    assert torch.equal(torch_opt.state[model.embed.weight]["exp_avg"], decoded)
    assert so.compact.FORMAT_KEY not in torch_opt.param_groups[0]
    assert_close(torch_opt.state[model.embed.weight]["exp_avg_sq"], plain_sd["state"][weight_id]["exp_avg_sq"],
                 rtol=0.1, atol=1e-9)


def test_torch_save_of_8bit_state_dict_round_trips(tmp_path):
    model, optimizer = run_mode("cpu", MODES["fp32 params, 8-bit moments"], 4, 2, steps=2)
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    fresh = so.SwapOptimizer(adamw(model.parameters()), swap_times=2, state_dtype=torch.uint8)
    fresh.load_state_dict(loaded)
    for p in model.parameters():
        assert all(torch.equal(optimizer.state[p][k], fresh.state[p][k]) for k in optimizer.state[p])


# ----------------------------------------------------------- bad combinations
@pytest.mark.parametrize("fields, match", [
    (dict(kahan_summation=True, master_weights=True), "kahan_summation.*master_weights"),
    (dict(state_dtype=torch.float16), "state_dtype must be"),
    (dict(state_dtype=torch.int8), "state_dtype must be"),
    (dict(rounding_seed=3), "rounding_seed .*state_dtype=torch.bfloat16"),
    (dict(state_dtype=torch.bfloat16, rounding_seed=-1), "rounding_seed must be"),
    (dict(state_dtype=torch.uint8, rounding_seed=3), "AdamW's states under state_dtype=torch.uint8 keep none in bf16"),
    (dict(kahan_summation=1), "kahan_summation must be True or False"),
])
def test_bad_combinations_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        so.SwapOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.randn(8))]), **fields)


def test_kahan_without_16bit_params_warns():
    with pytest.warns(UserWarning, match="kahan_summation=True applies to 16-bit params"):
        so.SwapOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.randn(8))]), kahan_summation=True)


def test_bad_8bit_state_is_refused_and_changes_nothing():
    model, optimizer = run_mode("cpu", MODES["fp32 params, 8-bit moments"], 4, 2, steps=2)
    before = snapshot(optimizer, model)
    sd = optimizer.state_dict()
    index = [id(p) for p in model.parameters()].index(id(model.embed.weight))
    bad = copy.deepcopy(sd)
    bad["state"][index]["exp_avg_absmax"] = bad["state"][index]["exp_avg_absmax"][:-1]
    with pytest.raises(ValueError, match="exp_avg_absmax' must be a float32 tensor of 563 scales"):
        optimizer.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["state"][index]["exp_avg"] = torch.zeros_like(model.embed.weight)
    with pytest.raises(ValueError, match="saved both as values and as codes"):
        optimizer.load_state_dict(bad)
    after = snapshot(optimizer, model)
    assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(before[1], after[1]))


# --------------------------------------------------------------- bytes moved
def test_bytes_moved_per_param_meet_targets():
    """Averaged over the swapped params, scales and step table included, on a
    model whose params are all large enough to quantize."""
    def per_param(dtype, **fields):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)).to(dtype)
        opt = so.SwapOptimizer(torch.optim.AdamW(model.parameters()), swap_times=4, **fields)
        return opt.memory_stats()["bytes_per_param_each_way"]
    assert per_param(torch.float32) == pytest.approx(8.0, rel=1e-3)
    assert per_param(torch.float32, state_dtype=torch.bfloat16) <= 4.2
    assert per_param(torch.float32, state_dtype=torch.uint8) <= 2.2
    assert per_param(torch.bfloat16, state_dtype=torch.uint8, kahan_summation=True) <= 4.3
    assert per_param(torch.bfloat16, master_weights=True, state_dtype=torch.float32) == pytest.approx(12.0, rel=1e-3)
