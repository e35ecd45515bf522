"""Kahan summation (kahan_summation=True) for 16-bit params with the
elementwise optimizers on torch's update path (TorchUpdateRule): SGD, RMSprop,
Adagrad, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop.

A 16-bit param keeps a compensation (what rounding it lost) as an element
state in its dtype; torch's update runs on a float32 stand-in, param +
compensation, with a float32 grad and float32 states, and the result is
rounded back into the param, the remainder kept as the new compensation.
Checked here: bitwise a hand-written reference of exactly that, bitwise
across swap_times, num_arenas, cuts and overlap_forward, the accuracy it is
for, the bytes moved, state dicts, a param written outside step(), and what
is refused. Bitwise comparisons are assert_close with rtol=atol=0.
"""

import warnings

import pytest
import torch
from torch.testing import assert_close

import swap_optimizer as so
from swap_optimizer.compact import dequantize_state_dict
from swap_training import round_trip

BITWISE = dict(rtol=0, atol=0)
OPTIMIZERS = {
    "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "SGD-plain": lambda ps: torch.optim.SGD(ps, lr=0.01),
    "SGD-fused": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, nesterov=True, fused=True),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, weight_decay=0.01),
    "Adagrad-foreach": lambda ps: torch.optim.Adagrad(ps, lr=0.05, foreach=True),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=2e-3),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=2e-3, weight_decay=0.01),
    "NAdam-foreach": lambda ps: torch.optim.NAdam(ps, lr=2e-3, foreach=True),
    # (for a plain fp16 run: torch's eps 1e-8 is 0 in fp16, and its fp16 states underflow to nan)
    "NAdam-eps": lambda ps: torch.optim.NAdam(ps, lr=2e-3, eps=1e-3),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=2e-3),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=0.01, t0=1),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-3),
}
# The large one is cut at swap_times 4 (at least 64 KiB of state a piece); one fp32 param keeps no compensation.
SHAPES = [(128, 256), (40, 30), (7,)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def make_params(dtypes=DTYPES, shapes=SHAPES):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype).requires_grad_()
            for shape, dtype in zip(shapes, dtypes)]


def grads_for(step, params):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator).to(p.dtype) for p in params]


def reference(name, steps, zero_compensation_at=None):
    """Kahan by hand: each step upcasts param + compensation of the 16-bit
    params, runs the plain torch optimizer on float32 params (so float32
    states), rounds to nearest and keeps the remainder. Returns the params,
    their compensations (None: fp32) and the optimizer on the float32 ones."""
    params = make_params()
    sixteen = [p.dtype != torch.float32 for p in params]
    upcast = [torch.nn.Parameter(p.detach().float()) if s else p for p, s in zip(params, sixteen)]
    compensation = [torch.zeros_like(p) if s else None for p, s in zip(params, sixteen)]
    optimizer = OPTIMIZERS[name](upcast)
    for step in range(steps):
        if step == zero_compensation_at:
            for c in compensation:
                if c is not None:
                    c.zero_()
        with torch.no_grad():
            for p, u, c, grad in zip(params, upcast, compensation, grads_for(step, params)):
                if c is None:
                    p.grad = grad
                    continue
                u.copy_(p.float() + c.float())
                u.grad = grad.float()
        optimizer.step()
        with torch.no_grad():
            for p, u, c in zip(params, upcast, compensation):
                if c is not None:
                    rounded = u.to(p.dtype)
                    c.copy_((u - rounded.float()).to(c.dtype))
                    p.copy_(rounded)
    return params, compensation, optimizer, upcast


def wrap(name, params, **fields):
    fields.setdefault("min_numel", 0)
    return so.SwapOptimizer(OPTIMIZERS[name](params), kahan_summation=True, **fields)


def run(name, steps=3, params=None, **fields):
    params = make_params() if params is None else params
    fields.setdefault("swap_times", 1)
    optimizer = wrap(name, params, **fields)
    for step in range(steps):
        for p, grad in zip(params, grads_for(step, params)):
            p.grad = grad
        optimizer.step()
    return params, optimizer


def assert_states_equal(state_a, state_b):
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert_close(torch.as_tensor(state_a[key]), torch.as_tensor(state_b[key]), **BITWISE, msg=key)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bitwise_the_hand_written_reference(name):
    params, compensation, ref_optimizer, upcast = reference(name, steps=3)
    ours, optimizer = run(name, steps=3, swap_times=2)
    for i, (p, q, c, u) in enumerate(zip(ours, params, compensation, upcast)):
        assert_close(p.detach(), q.detach(), **BITWISE, msg=f"param {i}")
        state = dict(optimizer.state[p])
        if c is None:  # an fp32 param: torch's own update, no compensation
            assert "compensation" not in state
        else:
            assert_close(state.pop("compensation"), c, **BITWISE, msg=f"compensation {i}")
            for key, value in state.items():  # the element states in float32, as torch keeps a float32 param's
                if torch.is_tensor(value) and value.dim():
                    assert value.dtype == torch.float32, (i, key)
        assert_states_equal(state, ref_optimizer.state[u])
    if name != "SGD-plain":
        assert any(c is not None and c.abs().sum() > 0 for c in compensation)  # the remainders are not all 0


def states_of(optimizer, params):
    return [{k: torch.as_tensor(v).clone() for k, v in optimizer.state[p].items()} for p in params]


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.uint8], ids=["exact", "bf16", "8bit"])
@pytest.mark.parametrize("name", ["SGD-momentum", "RMSprop", "NAdam-foreach"])
def test_bitwise_across_swap_times_arenas_and_cuts(name, state_dtype):
    """The update runs in float32, which the CPU cuts exactly: a 16-bit param
    with Kahan is cut (unlike one without), and every batching agrees."""
    fields = dict(state_dtype=state_dtype) if state_dtype is not None else {}
    if state_dtype == torch.bfloat16:
        fields["rounding_seed"] = 3
    first, first_optimizer = run(name, steps=3, **fields)
    expected = ([p.detach().clone() for p in first], states_of(first_optimizer, first))
    cut = False
    for swap_times in (2, 4):
        for num_arenas in (2, 3):
            params, optimizer = run(name, steps=3, swap_times=swap_times, num_arenas=num_arenas, **fields)
            cut |= optimizer.memory_stats()["split_params"] > 0
            for i, (p, q) in enumerate(zip(params, expected[0])):
                assert_close(p.detach(), q, **BITWISE, msg=f"param {i} at {swap_times}/{num_arenas}")
            for a, b in zip(states_of(optimizer, params), expected[1]):
                assert_states_equal(a, b)
    # (8-bit SGD moves 3 bytes an element: too few for two pieces of 64 KiB)
    assert cut or (state_dtype == torch.uint8 and name == "SGD-momentum")


def test_overlap_forward_is_bitwise_the_plain_run():
    from test_overlap import assert_bitwise, build, snapshot, train

    device = torch.device("cpu")
    runs = []
    for overlap in (False, True):
        model = build(device).to(torch.bfloat16)
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        optimizer = so.SwapOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     kahan_summation=True, min_numel=0, swap_times=6, num_arenas=3, **extra)
        if overlap:
            optimizer._set_test_hooks(copy_delay_us=300, compute_delay_us=300, seed=5)
        logged = train(model, optimizer, 5, device, "plain")
        if overlap:
            assert optimizer._overlap.schedule is not None and optimizer._overlap._last_step_deferred
        assert all("compensation" in entry for entry in optimizer.state.values())
        runs.append((logged, snapshot(model, optimizer)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert_bitwise(runs[0][1], runs[1][1])


def test_small_updates_are_kept():
    """The point of Kahan: updates below half a bf16 ulp. SGD with lr 1e-4 on
    weights near 1 (half an ulp there is 2**-8 ~ 0.0039) and grads of about 1:
    each step's update is ~1e-4, so plain bf16 params never move, while with
    Kahan param + compensation follows the float32 run to well under an
    ulp. Tolerances: the Kahan param is within one bf16 ulp (relative 2**-7)
    of the float32 run's; param + compensation within 2**-11 absolute (an
    eighth of an ulp at 1, against the plain run's 0.02): the compensation is
    bf16 itself, so each step may lose half an ulp of it (at most 2**-17
    here), 200 steps at most 1.5e-3, in practice about 1.3e-4."""
    generator = torch.Generator().manual_seed(5)
    # (values bf16 holds, so every run starts from and adds the same numbers)
    start = (1 + 0.01 * torch.rand(4096, generator=generator)).bfloat16().float()
    grads = [(1 + 0.1 * torch.randn(4096, generator=generator)).bfloat16().float() for _ in range(200)]
    runs = {}
    for mode in ("fp32", "bf16", "kahan"):
        p = torch.nn.Parameter(start.clone() if mode == "fp32" else start.bfloat16())
        optimizer = torch.optim.SGD([p], lr=1e-4)
        if mode != "fp32":
            optimizer = so.SwapOptimizer(optimizer, kahan_summation=mode == "kahan", min_numel=0)
        for grad in grads:
            p.grad = grad.to(p.dtype)
            optimizer.step()
        runs[mode] = (p.detach().float(), optimizer)
    fp32 = runs["fp32"][0]
    assert (start - fp32).mean() > 0.019  # the float32 run moved about 200 * 1e-4
    assert_close(runs["bf16"][0], start.bfloat16().float(), **BITWISE)  # plain bf16 lost every update
    kahan, optimizer = runs["kahan"]
    assert_close(kahan, fp32, rtol=2 ** -7, atol=0)
    summed = kahan + optimizer.state[optimizer.param_groups[0]["params"][0]]["compensation"].float()
    assert_close(summed, fp32, rtol=0, atol=2 ** -11)


def test_bytes_moved_include_the_compensation():
    """2 bytes an element of compensation for each 16-bit param; the states of
    those params in float32 (4 bytes); an fp32 param keeps no compensation."""
    for dtypes, state_dtype, expected in (([torch.bfloat16], None, 4 + 2), ([torch.float16], torch.bfloat16, 2 + 2),
                                          ([torch.float32], None, 4)):
        params = make_params(dtypes, shapes=[(256, 64)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (fp32: kahan_summation does nothing here)
            _, optimizer = run("SGD-momentum", steps=1, params=params, state_dtype=state_dtype)
        stats = optimizer.memory_stats()
        assert stats["bytes_per_param_each_way"] == expected, (dtypes, state_dtype)
        assert ("compensation" in stats["swapped_state_keys"]) == (dtypes[0] != torch.float32)
    # state_keys may name it: the compensation stays on the device
    _, optimizer = run("SGD-momentum", steps=1, params=make_params([torch.bfloat16], shapes=[(256, 64)]),
                       state_keys=("momentum_buffer",))
    assert optimizer.memory_stats()["bytes_per_param_each_way"] == 4
    assert optimizer.memory_stats()["resident_state_bytes"] >= 256 * 64 * 2


def test_update_temporaries_count_the_stand_in():
    """The float32 stand-in param and grad are in the budget's estimate."""
    params = make_params([torch.bfloat16], shapes=[(256, 64)])
    plain = so.SwapOptimizer(torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True), min_numel=0)
    kahan = wrap("SGD-fused", make_params([torch.bfloat16], shapes=[(256, 64)]))
    # (torch's fused SGD keeps no temporaries; both count the momentum a first step creates)
    assert kahan.memory_stats()["update_temporary_bytes"] >= plain.memory_stats()["update_temporary_bytes"] + \
        256 * 64 * 8


def test_kahan_state_dict_loads_into_plain_optimizers():
    """Kahan -> plain: dequantize_state_dict drops the compensation, and the
    plain optimizer (torch's, or a SwapOptimizer without Kahan) loads it, its
    float32 states cast to the param's dtype by torch's load."""
    params, optimizer = run("RMSprop", steps=2)
    saved = round_trip(optimizer.state_dict())
    assert "compensation" in saved["state"][0] and saved["state"][0]["square_avg"].dtype == torch.float32
    plain_dict = dequantize_state_dict(saved)
    assert all("compensation" not in entry for entry in plain_dict["state"].values())
    copies = [p.detach().clone().requires_grad_() for p in params]
    torch_plain = OPTIMIZERS["RMSprop"](copies)
    torch_plain.load_state_dict(plain_dict)
    swapped_copies = [p.detach().clone().requires_grad_() for p in params]
    swapped_plain = so.SwapOptimizer(OPTIMIZERS["RMSprop"](swapped_copies), min_numel=0, swap_times=2)
    swapped_plain.load_state_dict(saved)  # the Kahan dict itself
    for i, (p, q) in enumerate(zip(copies, swapped_copies)):
        assert "compensation" not in swapped_plain.state[q]
        assert_states_equal(dict(swapped_plain.state[q]), dict(torch_plain.state[p]))
        assert swapped_plain.state[q]["square_avg"].dtype == p.dtype
    for step in range(2, 4):
        for a, b, grad in zip(copies, swapped_copies, grads_for(step, copies)):
            a.grad, b.grad = grad, grad.clone()
        torch_plain.step()
        swapped_plain.step()
    for p, q in zip(copies, swapped_copies):
        assert_close(q.detach(), p.detach(), **BITWISE)


def test_plain_state_dict_loads_into_kahan_with_zero_compensation():
    params = make_params()
    plain = OPTIMIZERS["NAdam-eps"](params)
    for step in range(2):
        for p, grad in zip(params, grads_for(step, params)):
            p.grad = grad
        plain.step()
    saved = round_trip(plain.state_dict())
    optimizer = wrap("NAdam-eps", params, swap_times=2)
    optimizer.load_state_dict(saved)
    for i, p in enumerate(params):
        state = optimizer.state[p]
        if p.dtype == torch.float32:
            assert "compensation" not in state
            continue
        assert_close(state["compensation"], torch.zeros_like(p), **BITWISE)
        assert state["exp_avg"].dtype == torch.float32
        assert_close(state["exp_avg"], saved["state"][i]["exp_avg"].float(), **BITWISE)  # exact upcast
    for p, grad in zip(params, grads_for(2, params)):
        p.grad = grad
    optimizer.step()
    assert all(optimizer.state[p]["compensation"].abs().sum() > 0 for p in params if p.dtype != torch.float32)


@pytest.mark.parametrize("state_dtype", [None, torch.uint8], ids=["exact", "8bit"])
def test_kahan_state_dict_resumes_bitwise(state_dtype):
    """Kahan -> Kahan: the float32 states, scalars and compensation come back
    as saved (torch's load would cast them to the param's dtype), so a resume
    at another swap_times is bitwise the run that went on."""
    fields = dict(state_dtype=state_dtype) if state_dtype is not None else {}
    params, optimizer = run("NAdam", steps=2, swap_times=1, **fields)
    saved_params = [p.detach().clone() for p in params]
    saved = round_trip(optimizer.state_dict())
    for step in range(2, 4):
        for p, grad in zip(params, grads_for(step, params)):
            p.grad = grad
        optimizer.step()
    resumed = [p.clone().requires_grad_() for p in saved_params]
    other = wrap("NAdam", resumed, swap_times=4, **fields)
    other.load_state_dict(saved)
    for step in range(2, 4):
        for p, grad in zip(resumed, grads_for(step, resumed)):
            p.grad = grad
        other.step()
    for p, q in zip(params, resumed):
        assert_close(q.detach(), p.detach(), **BITWISE)
        assert_states_equal(dict(other.state[q]), dict(optimizer.state[p]))


def test_param_written_outside_step_zeroes_its_compensation():
    """An in-place write (it bumps the param's version) between steps 2 and
    3: the compensation of the old value is dropped before step 3, as the
    reference does; writes through .data are not seen (as the packed kernel's)."""
    params, compensation, _, _ = reference("SGD-momentum", steps=4, zero_compensation_at=2)
    ours = make_params()
    optimizer = wrap("SGD-momentum", ours, swap_times=2)
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                for p in ours:
                    p.mul_(1.0)  # the same values, a new version
        for p, grad in zip(ours, grads_for(step, ours)):
            p.grad = grad
        optimizer.step()
    for p, q, c in zip(ours, params, compensation):
        assert_close(p.detach(), q.detach(), **BITWISE)
        if c is not None:
            assert_close(optimizer.state[p]["compensation"], c, **BITWISE)


@pytest.mark.parametrize("make,settings,message", [
    (lambda ps: torch.optim.Adafactor(ps), {}, "kahan_summation=True works with elementwise optimizers"),
    (lambda ps: torch.optim.Muon(ps), {}, "kahan_summation=True works with elementwise optimizers"),
    ("Lion", dict(trust_per_param_step=True),
     "kahan_summation=True with an optimizer wrapped on your word \\(Lion\\) needs trust_elementwise_step"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), dict(master_weights=True, kahan_summation=False),
     "master_weights work\\(s\\) with Adam/AdamW only for now, not with SGD.*kahan_summation=True keeps"),
], ids=["Adafactor", "Muon", "vouched-for-not-elementwise", "master_weights"])
def test_what_is_refused(make, settings, message):
    params = make_params([torch.bfloat16], shapes=[(64, 64)])
    if make == "Lion":
        from test_trusted_optimizers import Lion
        make = Lion
    settings = dict(dict(kahan_summation=True), **settings)
    with pytest.raises(ValueError, match=message):
        so.SwapOptimizer(make(params), **settings)


def test_fp32_params_only_warn():
    with pytest.warns(UserWarning, match="kahan_summation=True applies to 16-bit params"):
        optimizer = wrap("SGD-momentum", make_params([torch.float32]))
    assert optimizer.memory_stats()["swapped_state_keys"] == ["momentum_buffer"]
