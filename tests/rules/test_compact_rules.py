"""Compact states (state_dtype=torch.bfloat16 / torch.uint8) for the optimizers
on torch's update path (TorchUpdateRule): SGD momentum, RMSprop, Adagrad,
Adadelta, Adamax, NAdam, RAdam, ASGD.

Each batch decodes its compact states into scratch in the dtype torch keeps
them in, runs torch's own update and encodes them back. Checked here: the
stored forms (per state, from its StateSpec), bitwise agreement with a
reference written from torch's optimizer and the codec ops on whole params
(so every map, rounding and rounding key is the one docs/usage.md lists),
bitwise agreement across swap_times and cuts and with overlap_forward, the
never-0 and round-up rules, the bytes moved, the scratch in the budget's
estimate, state dicts (stored form, dequantized, plain torch ones loaded),
16-bit params, and what is refused. The 1,000-step parity runs are in
tests/rules/test_compact_rules_parity.py (slow tier).
"""

import copy
import warnings

import pytest
import torch
from torch.testing import assert_close

import swap_optimizer as so
from conftest import DEVICES
from swap_optimizer.codec import (STATE_CODE_FORMS, decode_blockwise_8bit, encode_bf16_stochastic,
                                  encode_blockwise_8bit)
from swap_optimizer.compact import FORMAT_KEY, ROUNDING_STEP, dequantize_state_dict

OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "SGD-nesterov-foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=True),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "RMSprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, weight_decay=0.01),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=2e-3),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=2e-3, weight_decay=0.01),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=2e-3),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=0.01, t0=1),
}
# The compact kind of each element state (StateSpec.code), as docs/usage.md lists them.
KINDS = {
    "SGD": {"momentum_buffer": "signed"},
    "RMSprop": {"square_avg": "raw_denominator", "momentum_buffer": "signed"},
    # centered: sqrt(square_avg - grad_avg**2) would go negative with rounded states; both stay exact
    "RMSprop-centered": {"momentum_buffer": "signed"},
    "Adagrad": {"sum": "accumulator"},
    "Adadelta": {"square_avg": "denominator", "acc_delta": "denominator"},
    "Adamax": {"exp_avg": "signed", "exp_inf": "decaying_max"},
    "NAdam": {"exp_avg": "signed", "exp_avg_sq": "denominator"},
    "RAdam": {"exp_avg": "signed", "exp_avg_sq": "denominator"},
    "ASGD": {"ax": "signed"},
}
KINDS["SGD-nesterov-foreach"] = KINDS["SGD"]
for _name in ("SGD", "RMSprop", "NAdam", "Adagrad"):
    KINDS[_name + "-16"] = KINDS[_name]
# Kinds stored in bf16 under 8-bit too (a maximum that decays: 8-bit codes would freeze it).
BF16_UNDER_8BIT = {"decaying_max", "raw_denominator"}
# Kinds kept exact under bf16 (an accumulator: stochastic rounding would make it a random walk).
EXACT_UNDER_BF16 = {"accumulator"}
# Optimizers whose states all stay exact under compact states.
EXACT = {"Rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-3)}
# For 16-bit params: an eps fp16 holds (torch's 1e-8 is 0 there, and a state
# that underflows then divides by 0, compact or not).
SIXTEEN_BIT = {
    "SGD-16": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "RMSprop-16": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, eps=1e-3),
    "NAdam-16": lambda ps: torch.optim.NAdam(ps, lr=2e-3, eps=1e-3),
    "Adagrad-16": lambda ps: torch.optim.Adagrad(ps, lr=0.05, eps=1e-3),
}
# The big one is cut at swap_times=8; 9900 ends in a partial block; 50 is below MIN_QUANTIZED_NUMEL.
SHAPES = [(512, 400), (70, 80), (50,), (300, 33)]
STATE_DTYPES = {"bf16": torch.bfloat16, "8bit": torch.uint8}
ALL = {**OPTIMIZERS, **EXACT, **SIXTEEN_BIT}
SEED = 7


def make_params(device, dtype=torch.float32, shapes=SHAPES):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(device, dtype).requires_grad_() for shape in shapes]


def grads_for(step, params):
    generator = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(p.shape, generator=generator) * (1 + step % 3)).to(p.device, p.dtype) for p in params]


def wrap(name, params, state_dtype, **fields):
    if state_dtype is not None:  # (under 8-bit for the states kept in bf16: BF16_UNDER_8BIT)
        fields.setdefault("rounding_seed", SEED)
    return so.SwapOptimizer(ALL[name](params), min_numel=0, state_dtype=state_dtype, **fields)


def run(name, state_dtype, steps=4, device="cpu", dtype=torch.float32, shapes=SHAPES, **fields):
    params = make_params(device, dtype, shapes)
    fields.setdefault("swap_times", 1)
    optimizer = wrap(name, params, state_dtype, **fields)
    for step in range(steps):
        for p, grad in zip(params, grads_for(step, params)):
            p.grad = grad
        optimizer.step()
    optimizer.wait()
    return params, optimizer


def states_of(optimizer, params):
    return [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in optimizer.state[p].items()} for p in params]


def assert_same(first, second):
    (params_a, states_a), (params_b, states_b) = first, second
    for i, (a, b) in enumerate(zip(params_a, params_b)):
        assert torch.equal(a.detach(), b.detach()), f"param {i} differs"
    for i, (a, b) in enumerate(zip(states_a, states_b)):
        assert a.keys() == b.keys(), (i, sorted(a), sorted(b))
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), f"param {i} state {key} differs"


def reference(name, state_dtype, steps=4, device="cpu", dtype=torch.float32):
    """torch's own optimizer on whole params, its states kept compact by hand:
    each step decodes them into the param's dtype, steps, and encodes them
    (8-bit: the state's map and rounding; bf16: rounded stochastically keyed
    by (seed, param, state's place among the param's compact states, element,
    step))."""
    params = make_params(device, dtype)
    optimizer = ALL[name](params)
    kinds = {key: kind for key, kind in KINDS[name].items()
             if not (state_dtype == torch.bfloat16 and kind in EXACT_UNDER_BF16)}
    stored = [dict() for _ in params]  # per param: state -> its stored form
    counts = [0] * len(params)

    def compact(p):
        if state_dtype == torch.uint8:
            return p.numel() >= so.compact.MIN_QUANTIZED_NUMEL
        return p.dtype != torch.bfloat16

    def in_8bit(key):
        return state_dtype == torch.uint8 and kinds[key] not in BF16_UNDER_8BIT

    for step in range(steps):
        for i, (p, grad) in enumerate(zip(params, grads_for(step, params))):
            p.grad = grad
            for key, form in stored[i].items():
                if in_8bit(key):
                    out = torch.empty(p.shape, dtype=p.dtype, device=device)
                    decode_blockwise_8bit([form[0].view(-1)], [form[1]], [out.view(-1)],
                                          [STATE_CODE_FORMS[kinds[key]][0]])
                else:
                    out = form.to(p.dtype)
                if p.dtype == torch.float16 and kinds[key] != "signed":  # fp16 underflow: never 0
                    stored_form = form[0] if in_8bit(key) else form
                    out[(out == 0) & (stored_form != 0)] = 2.0 ** -24
                optimizer.state[p][key] = out
        optimizer.step()
        for i, p in enumerate(params):
            counts[i] += 1
            if not compact(p):
                continue
            state = optimizer.state[p]
            order = [key for key in kinds if key in state]
            for place, key in enumerate(order):
                value = state[key].detach().reshape(-1).contiguous()
                if in_8bit(key):
                    codes = torch.empty(p.shape, dtype=torch.uint8, device=device)
                    absmax = torch.empty(-(-p.numel() // 256), device=device)
                    encode_blockwise_8bit([value], [codes.view(-1)], [absmax], [STATE_CODE_FORMS[kinds[key]][0]],
                                          [STATE_CODE_FORMS[kinds[key]][1]])
                    stored[i][key] = (codes, absmax)
                else:
                    out = torch.empty(p.shape, dtype=torch.bfloat16, device=device)
                    step_count = int(state["step"]) if "step" in state else counts[i]
                    encode_bf16_stochastic([value.float()], [out.view(-1)], seed=SEED, param_index=[i],
                                           state_index=[place], global_offset=[0], step=[step_count])
                    stored[i][key] = out
                del state[key]
            for key, form in stored[i].items():  # what the store shows
                if in_8bit(key):
                    state[key + "_codes"], state[key + "_absmax"] = form
                else:
                    state[key] = form
    return params, [dict(optimizer.state[p]) for p in params]


@pytest.mark.parametrize("state_dtype", sorted(STATE_DTYPES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_states_are_stored_in_their_compact_form(name, state_dtype):
    params, optimizer = run(name, STATE_DTYPES[state_dtype], steps=2)
    for p in params:
        state = optimizer.state[p]
        for key, kind in KINDS[name].items():
            quantized = p.numel() >= so.compact.MIN_QUANTIZED_NUMEL
            if state_dtype == "8bit" and quantized and kind not in BF16_UNDER_8BIT:
                assert key not in state
                assert state[key + "_codes"].dtype == torch.uint8 and state[key + "_codes"].shape == p.shape
                assert state[key + "_absmax"].dtype == torch.float32
                assert state[key + "_absmax"].shape == (-(-p.numel() // 256),)
            elif (state_dtype == "8bit" and not quantized) or (state_dtype == "bf16" and kind in EXACT_UNDER_BF16):
                # a small param keeps exact states under 8-bit, as Adam's; an accumulator stays exact under bf16
                assert state[key].dtype == torch.float32 and state[key].shape == p.shape
            else:
                assert state[key].dtype == torch.bfloat16 and state[key].shape == p.shape
        assert (ROUNDING_STEP in state) == (state_dtype == "bf16" and name.startswith("SGD"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", sorted(STATE_DTYPES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_step_is_torchs_update_between_decode_and_encode(name, state_dtype, device):
    """Bitwise the hand-written reference (whole params, one torch optimizer)."""
    device = torch.device(device)
    params, optimizer = run(name, STATE_DTYPES[state_dtype], device=device)
    ref_params, ref_states = reference(name, STATE_DTYPES[state_dtype], device=device)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert torch.isfinite(p).all(), f"param {i} has a NaN or inf"
        assert torch.equal(p.detach(), q.detach()), f"param {i} differs from the reference"
        state = optimizer.state[p]
        for key, value in ref_states[i].items():
            assert torch.equal(torch.as_tensor(state[key]).cpu(), torch.as_tensor(value).cpu()), (i, key)


@pytest.mark.parametrize("state_dtype", sorted(STATE_DTYPES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bitwise_across_swap_times_and_cuts(name, state_dtype):
    runs = []
    for swap_times, num_arenas in ((1, 2), (3, 2), (8, 3)):
        params, optimizer = run(name, STATE_DTYPES[state_dtype], swap_times=swap_times, num_arenas=num_arenas)
        if swap_times == 8:
            assert optimizer.memory_stats()["split_params"] >= 1, "the large param is cut"
        runs.append((params, states_of(optimizer, params)))
    for other in runs[1:]:
        assert_same(runs[0], other)


@pytest.mark.parametrize("state_dtype", sorted(STATE_DTYPES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_close_to_the_exact_run(name, state_dtype):
    """A few steps from the same start stay near torch's exact update (the
    states' rounding, not a wrong state, is all that differs)."""
    params, _ = run(name, STATE_DTYPES[state_dtype], steps=5)
    exact, _ = run(name, None, steps=5)
    start = make_params("cpu")
    for p, q, s in zip(params, exact, start):
        moved = (q.detach() - s).norm()
        assert (p.detach() - q.detach()).norm() <= 0.05 * moved + 1e-6, name


def test_denominator_states_never_decode_to_zero():
    """Adagrad's sum in 8-bit: a block with one huge and many tiny squared
    grads keeps every tiny one positive (unsigned map, never-0 rounding); a
    0 would turn its update into grad / eps."""
    params = [torch.zeros(8192, requires_grad=True)]
    optimizer = so.SwapOptimizer(torch.optim.Adagrad(params, lr=0.1), min_numel=0, swap_times=1,
                                 state_dtype=torch.uint8)
    grad = torch.full((8192,), 1e-4)
    grad[::256] = 10.0
    params[0].grad = grad
    optimizer.step()
    assert "sum_codes" in optimizer.state[params[0]]
    decoded = dequantize_state_dict(optimizer.state_dict())["state"][0]["sum"]  # by the saved map
    assert (decoded > 0).all()
    assert params[0].detach().abs().max() <= 0.1 + 1e-6  # no grad / eps step


def test_a_decaying_maximum_keeps_decaying_under_8_bit():
    """Adamax's exp_inf, max(beta2 * exp_inf, |grad| + eps), is kept in bf16
    under 8-bit: after one large grad and 60 tiny ones it has decayed by
    beta2**60 = 0.55, on average within 1% (stochastic rounding is unbiased;
    8-bit codes rounded up, as a running maximum's are, would have kept every
    element at its first value, and to nearest would too: a 1% decay is less
    than half a code's spacing)."""
    n = 8192
    params = [torch.randn(n, generator=torch.Generator().manual_seed(2)).requires_grad_()]
    optimizer = so.SwapOptimizer(torch.optim.Adamax(params, lr=1e-3, betas=(0.9, 0.99)), min_numel=0, swap_times=1,
                                 state_dtype=torch.uint8, rounding_seed=SEED)
    first = torch.randn(n, generator=torch.Generator().manual_seed(3))
    generator = torch.Generator().manual_seed(4)
    for step in range(61):
        params[0].grad = first if step == 0 else torch.randn(n, generator=generator) * 1e-6
        optimizer.step()
    state = optimizer.state[params[0]]
    assert "exp_inf_codes" not in state and state["exp_inf"].dtype == torch.bfloat16
    assert "exp_avg_codes" in state  # the momentum is 8-bit
    decayed = state["exp_inf"].float() / (first.abs() * 0.99 ** 60)
    assert_close(decayed.mean().item(), 1.0, rtol=0, atol=0.01)


@pytest.mark.parametrize("state_dtype", sorted(STATE_DTYPES))
@pytest.mark.parametrize("name", ["SGD", "RMSprop", "Adadelta", "NAdam", "Adamax"])
def test_bytes_moved_per_param(name, state_dtype):
    """Each way: 2 bytes per element per compact state in bf16 (under 8-bit
    too for the kinds kept in bf16: RMSprop's square_avg, Adamax's exp_inf),
    1 + 4/256 in 8-bit codes and scales, against 4 per state exact."""
    shapes = [(512, 400)]
    _, optimizer = run(name, STATE_DTYPES[state_dtype], steps=1, shapes=shapes)
    stats = optimizer.memory_stats()
    numel = 512 * 400
    compact = len(KINDS[name])
    expected = sum(2.0 if state_dtype == "bf16" or kind in BF16_UNDER_8BIT else 1 + 4 / 256
                   for kind in KINDS[name].values())
    assert expected <= stats["h2d_bytes"] / numel <= expected + 0.01, stats["h2d_bytes"]
    assert stats["d2h_bytes"] == stats["h2d_bytes"]
    _, exact = run(name, None, steps=1, shapes=shapes)
    assert exact.memory_stats()["h2d_bytes"] / numel >= 4 * compact


def test_the_update_estimate_counts_the_scratch():
    """SGD's 8-bit momentum of one fp32 param of n elements: torch's for-loop
    temporaries (3 x 4n), the scratch (4n) and the codes and scales (n + n/64)."""
    shapes = [(512, 400)]
    n = 512 * 400
    _, optimizer = run("SGD", torch.uint8, steps=1, shapes=shapes)
    assert optimizer.memory_stats()["update_temporary_bytes"] >= 3 * 4 * n + 4 * n + n


@pytest.mark.parametrize("state_dtype", sorted(STATE_DTYPES))
@pytest.mark.parametrize("name", ["SGD", "RMSprop", "Adamax", "NAdam", "ASGD"])
def test_state_dict_round_trip_resumes_bitwise(name, state_dtype):
    """Saved in the stored form (with FORMAT_KEY), loaded into a new
    SwapOptimizer (at another swap_times), the run goes on bitwise."""
    dtype = STATE_DTYPES[state_dtype]
    params, optimizer = run(name, dtype, steps=5, swap_times=2)
    first, first_optimizer = run(name, dtype, steps=3, swap_times=2)
    saved = copy.deepcopy(first_optimizer.state_dict())
    form = saved["param_groups"][0][FORMAT_KEY]
    assert set(form["states"]) == set(KINDS[name]) and form["moments"] == str(dtype).replace("torch.", "")
    resumed = [p.detach().clone().requires_grad_() for p in first]
    other = wrap(name, resumed, dtype, swap_times=8, rounding_seed=SEED + 1 if dtype == torch.bfloat16 else None)
    other.load_state_dict(saved)  # (the saved seed wins)
    for step in range(3, 5):
        for p, grad in zip(resumed, grads_for(step, resumed)):
            p.grad = grad
        other.step()
    assert_same((params, states_of(optimizer, params)), (resumed, states_of(other, resumed)))


@pytest.mark.parametrize("state_dtype", sorted(STATE_DTYPES))
@pytest.mark.parametrize("name", ["SGD", "RMSprop", "Adadelta", "Adamax", "RAdam"])
def test_state_dicts_convert_to_and_from_torchs_format(name, state_dtype):
    """dequantize_state_dict gives the wrapped optimizer's own format (the
    decoded states); a plain torch state dict loads into a compact
    SwapOptimizer (encoded), and a compact one into an exact SwapOptimizer
    (decoded)."""
    dtype = STATE_DTYPES[state_dtype]
    params, optimizer = run(name, dtype, steps=3)
    plain = dequantize_state_dict(optimizer.state_dict())
    assert all(FORMAT_KEY not in g for g in plain["param_groups"])
    torch_optimizer = OPTIMIZERS[name]([p.detach().clone() for p in params])
    torch_optimizer.load_state_dict(plain)
    for i, p in enumerate(params):
        compact, loaded = optimizer.state[p], torch_optimizer.state[torch_optimizer.param_groups[0]["params"][i]]
        assert ROUNDING_STEP not in loaded
        for key, kind in KINDS[name].items():
            value = loaded[key]
            assert value.dtype == torch.float32
            if key + "_codes" in compact:
                decoded = torch.empty(p.numel())
                decode_blockwise_8bit([compact[key + "_codes"].view(-1)], [compact[key + "_absmax"]], [decoded],
                                      [STATE_CODE_FORMS[kind][0]])
                assert torch.equal(value.view(-1), decoded)
            else:
                assert torch.equal(value, compact[key].float())
    # torch's format into a compact SwapOptimizer, and the compact form into an exact one
    exact_params, exact = run(name, None, steps=3)
    into_compact = wrap(name, [p.detach().clone().requires_grad_() for p in exact_params], dtype)
    into_compact.load_state_dict(exact.state_dict())
    back = wrap(name, [p.detach().clone().requires_grad_() for p in params], None)
    back.load_state_dict(optimizer.state_dict())
    for i, (p, q) in enumerate(zip(into_compact.param_groups[0]["params"], back.param_groups[0]["params"])):
        for key in KINDS[name]:
            exact_value = exact.state[exact_params[i]][key]
            if key + "_codes" in into_compact.state[p]:
                decoded = torch.empty(p.numel())
                decode_blockwise_8bit([into_compact.state[p][key + "_codes"].view(-1)],
                                      [into_compact.state[p][key + "_absmax"]], [decoded],
                                      [STATE_CODE_FORMS[KINDS[name][key]][0]])
            else:
                decoded = into_compact.state[p][key].float().view(-1)
            assert torch.allclose(decoded, exact_value.view(-1), rtol=0.1, atol=1e-3 * exact_value.abs().max())
            assert back.state[q][key].dtype == torch.float32
            assert torch.equal(back.state[q][key], torch_optimizer.state[torch_optimizer.param_groups[0]["params"][i]][key])


@pytest.mark.parametrize("param_dtype, state_dtype", [(torch.bfloat16, torch.uint8), (torch.float16, torch.uint8),
                                                      (torch.float16, torch.bfloat16)],
                         ids=["bf16 params, 8-bit", "fp16 params, 8-bit", "fp16 params, bf16"])
@pytest.mark.parametrize("name", sorted(SIXTEEN_BIT))
def test_16_bit_params_decode_into_their_dtype(name, param_dtype, state_dtype):
    """torch keeps a 16-bit param's states in its dtype: the scratch is that
    dtype (bitwise the reference), whatever swap_times."""
    params, optimizer = run(name, state_dtype, dtype=param_dtype)
    ref_params, ref_states = reference(name, state_dtype, dtype=param_dtype)
    for i, (p, q) in enumerate(zip(params, ref_params)):
        assert torch.isfinite(p).all(), i
        assert torch.equal(p.detach(), q.detach()), i
        for key, value in ref_states[i].items():
            assert torch.equal(torch.as_tensor(optimizer.state[p][key]), torch.as_tensor(value)), (i, key)
    other, other_optimizer = run(name, state_dtype, dtype=param_dtype, swap_times=8, num_arenas=3)
    assert_same((params, states_of(optimizer, params)), (other, states_of(other_optimizer, other)))


def test_bf16_params_keep_torchs_bf16_states():
    """Under state_dtype=torch.bfloat16 a bf16 param's states are torch's own
    (bf16 already): bitwise the exact run."""
    params, optimizer = run("RMSprop-16", torch.bfloat16, dtype=torch.bfloat16)
    exact, exact_optimizer = run("RMSprop-16", None, dtype=torch.bfloat16)
    assert_same((params, states_of(optimizer, params)), (exact, states_of(exact_optimizer, exact)))


@pytest.mark.parametrize("state_dtype", sorted(STATE_DTYPES))
@pytest.mark.parametrize("name", ["SGD", "RMSprop"])
def test_overlap_forward_is_bitwise_the_plain_run(name, state_dtype, monkeypatch):
    from test_overlap import assert_bitwise, build, snapshot, train

    monkeypatch.setattr(so.rules.compact_states, "MIN_QUANTIZED_NUMEL", 512)  # the small model's matrices
    device = torch.device("cpu")
    runs = []
    for overlap in (False, True):
        model = build(device)
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        optimizer = wrap(name, list(model.parameters()), STATE_DTYPES[state_dtype], swap_times=6, num_arenas=3,
                         **extra)
        if overlap:
            optimizer._set_test_hooks(copy_delay_us=300, compute_delay_us=300, seed=5)
        logged = train(model, optimizer, 5, device, "plain")
        if overlap:
            assert optimizer._overlap.schedule is not None and optimizer._overlap._last_step_deferred
        assert any(k.endswith("_codes") if state_dtype == "8bit" else v.dtype == torch.bfloat16
                   for entry in optimizer.state.values() for k, v in entry.items() if torch.is_tensor(v))
        runs.append((logged, snapshot(model, optimizer)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert_bitwise(runs[0][1], runs[1][1])


def test_what_is_refused():
    params = make_params("cpu", shapes=[(64, 64)])
    with pytest.raises(ValueError, match="works with elementwise optimizers"):
        so.SwapOptimizer(torch.optim.Adafactor(params), state_dtype=torch.uint8)
    with pytest.raises(ValueError, match="works with elementwise optimizers"):
        so.SwapOptimizer(torch.optim.Muon(params), state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Adam/AdamW only"):
        so.SwapOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), state_dtype=torch.float32)


def test_rprop_keeps_its_states_exact():
    """Rprop's prev and step sizes are not worth quantizing: a warning, and the exact run."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params, optimizer = run("Rprop", torch.uint8)
    assert any("stay exact" in str(w.message) for w in caught)
    exact, exact_optimizer = run("Rprop", None)
    assert_same((params, states_of(optimizer, params)), (exact, states_of(exact_optimizer, exact)))



@pytest.mark.parametrize("saved_with, loaded_into", [
    (dict(state_dtype=torch.uint8), dict(state_dtype=torch.uint8)),
    (dict(state_dtype=torch.bfloat16), dict()),
])
def test_bf16_states_of_fp16_params_with_kahan_load_as_saved(saved_with, loaded_into):
    """With Kahan, an fp16 param's update runs in float32, so RMSprop's
    square_avg, kept in bf16 (under 8-bit too), holds values below fp16's
    smallest (2**-24) after small grads: a load keeps them, in bf16 or, into
    a Kahan store of exact states, in float32 (torch's own load would cast
    them to the param's fp16, to 0, and a 0 denominator divides by eps
    alone)."""
    def make(fields):
        params = [torch.randn(64, 128, generator=torch.Generator().manual_seed(0)).half().requires_grad_()]
        seed = dict(rounding_seed=SEED) if "state_dtype" in fields else {}
        optimizer = so.SwapOptimizer(torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, eps=1e-3), min_numel=0,
                                     swap_times=2, kahan_summation=True, **seed, **fields)
        return params, optimizer

    params, optimizer = make(saved_with)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        params[0].grad = (torch.randn(64, 128, generator=generator) * 1e-3).half()
        optimizer.step()
    saved = optimizer.state_dict()
    square_avg = saved["state"][0]["square_avg"]
    assert square_avg.dtype == torch.bfloat16 and (square_avg != 0).all()
    assert (square_avg.float() < 2.0 ** -24).any(), "the test needs values fp16 cannot hold"
    loaded_params, loaded = make(loaded_into)
    with torch.no_grad():
        loaded_params[0].copy_(params[0])
    loaded.load_state_dict(saved)
    assert_close(loaded.state[loaded_params[0]]["square_avg"].float(), square_avg.float(), rtol=0, atol=0)


def test_state_keys_name_states_whose_codes_and_scales_follow():
    """state_keys names a state; under 8-bit its codes and scales go with it
    (both to host memory), and a store key is not a state's name."""
    params = make_params("cpu", shapes=[(128, 64), (10, 10)])  # 8-bit codes for the first, exact for the second
    optimizer = so.SwapOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), min_numel=0, swap_times=1,
                                 state_dtype=torch.uint8, state_keys=("momentum_buffer",))
    for p, grad in zip(params, grads_for(0, params)):
        p.grad = grad
    optimizer.step()
    stats = optimizer.memory_stats()
    assert sorted(stats["swapped_state_keys"]) == ["momentum_buffer", "momentum_buffer_absmax",
                                                   "momentum_buffer_codes"]
    assert stats["host_state_bytes"] >= 128 * 64 + 4 * 32 + 4 * 100
    with pytest.raises(ValueError, match="\\['momentum_buffer_codes'\\] are not states of SGD here; its states are "
                                         "\\['momentum_buffer'\\]"):
        so.SwapOptimizer(torch.optim.SGD(make_params("cpu", shapes=[(128, 64)]), lr=0.1, momentum=0.9), min_numel=0,
                         state_dtype=torch.uint8, state_keys=("momentum_buffer_codes",))


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.uint8])
def test_cpu_batches_decode_into_one_kept_scratch_with_the_same_bits(state_dtype, monkeypatch):
    """On the CPU a step's batches decode their states into one ScratchPool
    buffer: the first batch's scratches are fresh and the buffer grows to
    what it took, the later batches' come from the buffer, and the last batch
    frees it (between steps the pool holds nothing, as the arenas), unless
    keep_arenas keeps it, the same buffer, from step to step. A step gives
    the bits of one whose batches allocate their own (the pool found lent),
    also under another default device. A lent pool is not lent twice."""
    from swap_optimizer.rules.compact_states import ScratchPool

    taken = []  # per scratch: whether it is a view of the pool's buffer
    take = ScratchPool.take

    def recording_take(self, shape, dtype):
        scratch = take(self, shape, dtype)
        buffer = self._buffers.get(dtype)
        taken.append(buffer is not None and
                     scratch.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr())
        return scratch

    def run(keep_arenas: bool, default_device: str = "cpu"):
        torch.manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(4096)) for _ in range(6)]
        opt = so.SwapOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True), swap_times=3,
                               min_numel=0, state_dtype=state_dtype, rounding_seed=5, keep_arenas=keep_arenas)
        buffers = []
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            with torch.device(default_device):
                opt.step()
            pool = opt._rule._batch_rule.scratch_pool
            buffers.append(dict(pool._buffers))
        return [p.detach().clone() for p in params], buffers

    monkeypatch.setattr(ScratchPool, "take", recording_take)
    pooled, buffers = run(keep_arenas=False)
    # steps 2 and 3 (step 1 decodes nothing), 3 batches of 2 params each
    assert taken == [False, False, True, True, True, True] * 2
    assert buffers == [{}, {}, {}]
    taken.clear()
    kept, buffers = run(keep_arenas=True, default_device="meta")
    assert taken == [False, False] + [True] * 10
    scratch_dtype = torch.float32
    assert buffers[1][scratch_dtype] is buffers[2][scratch_dtype]
    assert buffers[2][scratch_dtype].numel() == 2 * 4096 and buffers[2][scratch_dtype].device.type == "cpu"
    monkeypatch.setattr(ScratchPool, "lend", lambda self: False)
    taken.clear()
    own, _ = run(keep_arenas=False)
    assert not taken
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(pooled, own, kept))
    monkeypatch.undo()
    pool = ScratchPool()
    assert pool.lend() and not pool.lend()
    pool.give_back(free=False)
    assert pool.lend()
