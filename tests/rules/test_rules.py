"""torch's own update, run batch by batch on the staged states, is bitwise the
plain optimizer's (params and every state), whatever the batching, for every
optimizer it runs (Adam/AdamW with default states included); what cannot be
run exactly is refused."""

import copy
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import swap_optimizer as so
from conftest import DEVICES, TESTS, requires_cuda
from optimizer_cases import BY_NAME
from optimizer_cases import CASES as OPTIMIZER_CASES
from pairs import assert_same_state, bits, give_grads, run_pair, same_bits

# The case table's optimizers with a declaration (torch's own update), and
# per name its first variant's hyper-parameters, the ones a test of one
# optimizer runs; each keeps per-param state.
TORCH_CASES = [case for case in OPTIMIZER_CASES if not case.vouched_for]
FUSED = {case.name for case in TORCH_CASES if case.fused}  # torch has fused kernels for these
WHOLE = {case.name for case in TORCH_CASES if not case.split}  # never cut


def first_variant(name):
    """A copy of the hyper-parameters of `name`'s first variant in the case table."""
    return dict(next(iter(BY_NAME[name].variants.values())))


SHAPES = [(256, 700), (70000,), (64, 300), (5,)]  # the first two are large enough to be cut into pieces
STEPS = 20


def make_params(name, dtype=torch.float32, device="cpu"):
    generator = torch.Generator().manual_seed(1)
    shapes = [s for s in SHAPES if len(s) == 2] if name == "Muon" else SHAPES
    return [nn.Parameter(torch.randn(*s, generator=generator).to(device, dtype)) for s in shapes]


def implementations(name):
    """The implementation flags of every path torch has for `name` (none where the class takes none: Muon)."""
    case = BY_NAME[name]
    if not case.flags:
        return [dict()]
    flags = [dict(foreach=False)]
    if case.foreach:
        flags.append(dict(foreach=True))
    if case.fused:
        flags.append(dict(fused=True))
    return flags


def torch_optimizer(name, kwargs):
    return lambda params: getattr(torch.optim, name)(params, **kwargs)


def run_rule_pair(name, kwargs, steps=STEPS, dtype=torch.float32, device="cpu", **settings):
    """The plain optimizer and the wrapped one over make_params(name): bitwise."""
    return run_pair(torch_optimizer(name, kwargs), lambda: make_params(name, dtype, device), steps, exact=True,
                    **settings)


def bitwise_rows():
    """(name, kwargs, device) per variant of each case and device, ids
    "<name>-<variant>-<device>". On the CPU a case's later variants, and
    Adam/AdamW, go to the slow tier: in the default one the capability table
    (test_optimizer_capabilities.py) runs every variant's parity for every
    implementation and dtype, split, overlap, budget and faults."""
    rows = []
    for case in TORCH_CASES:
        for number, (variant, kwargs) in enumerate(case.variants.items()):
            for device in DEVICES:
                (value,) = device.values
                slow = value == "cpu" and (number > 0 or case.name in ("Adam", "AdamW"))
                rows.append(pytest.param(case.name, kwargs, value, id=f"{case.name}-{variant}-{device.id}",
                                         marks=[*device.marks] + ([pytest.mark.slow] if slow else [])))
    return rows


@pytest.mark.parametrize("name,kwargs,device", bitwise_rows())
def test_bitwise_equal_to_the_plain_optimizer(name, kwargs, device):
    """20 steps for every implementation torch offers, at swap_times 1, 2, 4
    and 16, with 3 arenas at 4 (at 1 and 2 there are no more batches than 2
    arenas): params and states bitwise equal (no tolerance), with the large
    param cut into pieces where the rule allows. (Each is bitwise one plain
    run, so all are bitwise equal to each other.)"""
    for implementation in implementations(name):
        for swap_times, num_arenas in ((1, 2), (2, 2), (4, 3), (16, 2)):
            settings = dict(swap_times=swap_times, num_arenas=num_arenas)
            if name == "Muon":  # its bf16 Newton-Schulz takes the CPU most of a second a step on SHAPES'
                # matrices; never cut, it runs on the case table's small ones
                swapped = run_pair(torch_optimizer(name, dict(kwargs, **implementation)),
                                   BY_NAME[name].params(device=device), STEPS, exact=True, **settings).swapped
            else:
                swapped = run_rule_pair(name, dict(kwargs, **implementation), device=device, **settings).swapped
            stats = swapped.memory_stats()
            if num_arenas == 3:
                assert stats["num_arenas"] == 3, "three batches or more rotate through the three arenas"
            if name in WHOLE or swap_times == 1:
                assert stats["split_params"] == 0
            else:
                assert stats["split_params"] >= 1, "the large param is cut at this swap_times"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["SGD", "Adagrad", "RMSprop", "NAdam", "ASGD", "Adafactor"])
def test_16_bit_params(name, device):
    kwargs = first_variant(name)
    for dtype in (torch.bfloat16, torch.float16):
        swapped = run_rule_pair(name, kwargs, steps=8, dtype=dtype, swap_times=4, device=device).swapped
        if device == "cpu":
            # torch's own CPU result for 16-bit params may depend on how its
            # threads share a tensor: these rules never cut them on the CPU.
            assert swapped.memory_stats()["split_params"] == 0
        elif name != "Adafactor":
            assert swapped.memory_stats()["split_params"] >= 1


# (class name, hyper-parameters, whether the for-loop and foreach paths cut a
# 16-bit param on the CPU); fused cuts in every row. Adam's L2 weight decay
# (`grad.add(param, alpha=weight_decay)`) rounds a few elements differently in
# torch's vector body and scalar tail, so it is not cut.
CUT_16_BIT_ROWS = [
    ("Adam", dict(lr=0.01, amsgrad=True, maximize=True), True),
    ("Adam", dict(lr=0.01, weight_decay=0.05), False),
    ("AdamW", dict(lr=0.01, weight_decay=0.1), True),
]


def cut_16_bit_surprises():
    """For each row of CUT_16_BIT_ROWS, implementation, dtype and thread count,
    run at swap_times=8: {run: (expected, seen)} where the run differs from
    the plain one bitwise (run_pair asserts it) or was cut where it should not
    be, or the reverse. Empty when every declaration holds."""
    surprises = {}
    threads = torch.get_num_threads()
    try:
        for name, kwargs, cut_unfused in CUT_16_BIT_ROWS:
            for implementation in implementations(name):
                expected = "cut" if cut_unfused or implementation.get("fused") else "not cut"
                for dtype in (torch.bfloat16, torch.float16):
                    for count in (1, 2):
                        torch.set_num_threads(count)
                        try:
                            swapped = run_rule_pair(name, dict(kwargs, **implementation), steps=6, dtype=dtype,
                                                    swap_times=8).swapped
                            seen = "cut" if swapped.memory_stats()["split_params"] >= 1 else "not cut"
                        except AssertionError:
                            seen = "differs"
                        if seen != expected:
                            surprises[f"{name}-{kwargs}-{implementation}-{dtype}-{count} threads"] = (expected, seen)
    finally:
        torch.set_num_threads(threads)
    return surprises


def test_cut_16_bit_params_on_cpu_where_declared():
    """Declaration.cuts_16_bit_on_cpu holds only where a cut is proven exact:
    Adam/AdamW's bf16 and fp16 params cut into pieces on the CPU are bitwise
    the plain optimizer's, for-loop, foreach and fused, on 1 and 2 threads,
    and Adam's L2 weight decay keeps them whole but for fused (the
    instruction sets: the test below)."""
    declared = [cls.__name__ for d in so.rules.DECLARATIONS if d.cuts_16_bit_on_cpu is not None for cls in d.classes]
    assert declared == ["Adam", "AdamW"]
    assert cut_16_bit_surprises() == {}


def test_turning_on_l2_weight_decay_keeps_16_bit_params_whole_from_then_on():
    """A scheduler that turns Adam's L2 weight decay on mid-training: the
    bf16 params cut until then are laid out whole again before the next step,
    which stays bitwise the plain optimizer's (2 threads: where a cut shows)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        pair = run_rule_pair("Adam", dict(lr=0.01), steps=1, dtype=torch.bfloat16, swap_times=8)
        assert pair.swapped.memory_stats()["split_params"] >= 1
        for optimizer in (pair.plain, pair.swapped):
            optimizer.param_groups[0]["weight_decay"] = 0.05
        for step in range(1, 7):
            give_grads(step, pair.plain_params, pair.swapped_params)
            pair.plain.step()
            pair.swapped.step()
        assert pair.swapped.memory_stats()["split_params"] == 0
        assert all(same_bits(p, q) for p, q in zip(pair.plain_params, pair.swapped_params))
        assert_same_state(pair.plain, pair.swapped)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_cut_16_bit_params_on_every_cpu_instruction_set():
    """The same on the baseline, AVX2 and AVX-512 builds of torch's CPU kernels."""
    folders = [TESTS, os.path.dirname(os.path.abspath(__file__))]
    code = (f"import sys; sys.path[:0] = {folders!r}; import torch, test_rules; "
            "print(torch.backends.cpu.get_cpu_capability(), test_rules.cut_16_bit_surprises())")
    seen = {}
    for capability in ["default", "avx2", "avx512"]:
        env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
        out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        used, verdict = out.stdout.strip().split(" ", 1)
        seen[used] = verdict
    assert len(seen) >= 2 and "DEFAULT" in seen, f"fewer than two instruction sets ran: {seen}"
    assert set(seen.values()) == {"{}"}, seen


def test_param_groups_scheduler_and_closure():
    """Two groups with their own hyper-parameters, a scheduler that changes
    lr every step, and a closure evaluated once per step."""
    a, b = make_params("SGD"), make_params("SGD")
    groups = lambda ps: [dict(params=ps[:2], lr=0.1, momentum=0.9), dict(params=ps[2:], lr=0.01, momentum=0.5,
                                                                           nesterov=True)]
    plain = torch.optim.SGD(groups(a), lr=0.1)
    swapped = so.SwapOptimizer(torch.optim.SGD(groups(b), lr=0.1), swap_times=4, min_numel=0)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9) for o in (plain, swapped)]
    calls = []

    def closure_for(params, step):
        def closure():
            calls.append(1)
            give_grads(step, params)
            return torch.tensor(float(step))
        return closure

    for step in range(10):
        assert plain.step(closure_for(a, step)) == swapped.step(closure_for(b, step))
        for scheduler in schedulers:
            scheduler.step()
    assert len(calls) == 20
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "RAdam"])
def test_add_param_group_mid_run(name):
    kwargs = first_variant(name)
    cls = getattr(torch.optim, name)
    a, b = make_params(name), make_params(name)
    plain = cls(a[:2], **kwargs)
    swapped = so.SwapOptimizer(cls(b[:2], **kwargs), swap_times=4, min_numel=0)
    for step in range(12):
        if step == 5:
            plain.add_param_group(dict(params=a[2:], lr=0.05))
            swapped.add_param_group(dict(params=b[2:], lr=0.05))
        count = 2 if step < 5 else 4
        give_grads(step, a[:count], b[:count])
        plain.step()
        swapped.step()
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)


def test_grad_scaler_unscales_through_its_own_path():
    """GradScaler without a device-side unscale (unscale_ then step, skipping
    steps with infs) gives the plain optimizer's results."""
    a, b = make_params("SGD"), make_params("SGD")
    plain = torch.optim.SGD(a, lr=0.1, momentum=0.9)
    swapped = so.SwapOptimizer(torch.optim.SGD(b, lr=0.1, momentum=0.9), swap_times=4, min_numel=0)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) for _ in range(2)]
    for step in range(8):
        give_grads(step, a, b)
        if step == 3:  # an overflow: the step is skipped and the scale drops
            a[0].grad[0, 0] = b[0].grad[0, 0] = float("inf")
        for scaler, optimizer, params in zip(scalers, (plain, swapped), (a, b)):
            scaler.scale(torch.ones(()))  # as scaler.scale(loss) before backward
            for p in params:  # the grads a scaled loss would give
                p.grad.mul_(scaler.get_scale())
            scaler.step(optimizer)
            scaler.update()
    assert scalers[1].get_scale() == scalers[0].get_scale() < 2.0 ** 8
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["SGD", "Adagrad"])
def test_fused_takes_the_scale_and_inf_flag_in_step(name, device):
    """fused=True SGD and Adagrad: GradScaler hands step() its scale and inf
    flag (unscale_in_step follows fused, as for the plain optimizer), and
    torch's fused kernel unscales and skips on the device, batch by batch:
    bitwise the plain optimizer, an overflow step included."""
    kwargs = dict(first_variant(name), fused=True)
    cls = getattr(torch.optim, name)
    a, b = make_params(name, device=device), make_params(name, device=device)
    plain = cls(a, **kwargs)
    swapped = so.SwapOptimizer(cls(b, **kwargs), swap_times=4, min_numel=0)
    assert swapped._step_supports_amp_scaling and plain._step_supports_amp_scaling
    scalers = [torch.amp.GradScaler(device, init_scale=2.0 ** 8) for _ in range(2)]
    for step in range(8):
        give_grads(step, a, b)
        if step == 3:  # an overflow: the kernel skips the update, the scale drops
            a[0].grad[0, 0] = b[0].grad[0, 0] = float("inf")
        for scaler, optimizer, params in zip(scalers, (plain, swapped), (a, b)):
            scaler.scale(torch.ones((), device=device))
            for p in params:
                p.grad.mul_(scaler.get_scale())
            scaler.step(optimizer)
            scaler.update()
    assert scalers[1].get_scale() == scalers[0].get_scale() < 2.0 ** 8
    assert swapped.memory_stats()["split_params"] >= 1
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)


def test_unscale_in_step_needs_torchs_fused_path():
    with pytest.raises(ValueError, match="takes GradScaler's scale and inf flag only in torch's fused Adam, AdamW, SGD, Adagrad"):
        so.SwapOptimizer(torch.optim.SGD(make_params("SGD"), lr=0.1, momentum=0.9), unscale_in_step=True)
    with pytest.raises(ValueError, match="takes GradScaler's scale and inf flag only in torch's fused Adam, AdamW, SGD, Adagrad"):
        so.SwapOptimizer(torch.optim.RMSprop(make_params("RMSprop"), lr=0.1), unscale_in_step=True)


def test_memory_stats_estimate_torchs_temporaries():
    """update_temporary_bytes, for the largest call: foreach up to three
    batches of param bytes, the for-loop three of the largest row, fused none,
    Muon's Newton-Schulz 6mn + 4m^2 plus one param (m <= n); each plus the
    states a first step makes on the device (here one fp32 momentum per
    element)."""
    def temporaries(name, **kwargs):
        swapped = so.SwapOptimizer(getattr(torch.optim, name)(make_params(name), lr=0.01, **kwargs), swap_times=4,
                                   min_numel=0)
        stats = swapped.memory_stats()
        rows = [[count * 4 for _, _, count in batch["pieces"]] for batch in swapped._batch_layout()]
        return stats["update_temporary_bytes"], rows

    foreach, rows = temporaries("SGD", momentum=0.9, foreach=True)
    assert foreach == max(3 * sum(r) + sum(r) for r in rows)
    for_loop, rows = temporaries("SGD", momentum=0.9, foreach=False)
    assert for_loop == max(3 * max(r) + sum(r) for r in rows) <= foreach
    assert temporaries("SGD", momentum=0.9, fused=True)[0] == max(sum(r) for r in rows)
    muon, _ = temporaries("Muon")
    assert muon == 6 * 256 * 700 + 4 * 256 ** 2 + 256 * 700 * 4 + 256 * 700 * 4


@pytest.mark.parametrize("foreach", [False, True])
def test_adafactor_temporaries_count_every_param_of_a_foreach_call(foreach):
    """Adafactor's foreach path makes its param-sized temporaries as lists over
    the call (the variance estimates, row_var @ col_var): three per param of
    the largest call; its for-loop three of the largest param. Each plus the
    states a first step makes (2-D: a row and a column variance; 1-D: a
    variance per element)."""
    params = make_params("Adafactor")
    swapped = so.SwapOptimizer(torch.optim.Adafactor(params, lr=0.01, foreach=foreach), swap_times=1, min_numel=0)
    new_states = {id(p): 4 * (p.shape[0] + p.shape[1] if p.dim() == 2 else p.numel()) for p in params}
    expected = 0
    for batch in swapped._batch_layout():
        sizes = [params[index].numel() * 4 for index, _, _ in batch["pieces"]]
        if sizes:
            made = 3 * (sum(sizes) if foreach else max(sizes))
            expected = max(expected, made + sum(new_states[id(params[index])] for index, _, _ in batch["pieces"]))
    assert swapped.memory_stats()["update_temporary_bytes"] == expected
    assert len(swapped._batch_layout()) < len(params), "a call must hold several params for foreach to count"


@pytest.mark.parametrize("name, largest", [("SGD", 0), ("Muon", 256 * 700 * 4), ("Adafactor", 70000 * 4)])
def test_memory_stats_name_the_largest_param_that_moves_whole(name, largest):
    """Muon's and Adafactor's params are never cut: memory_stats says how much
    state the largest of them stages, and the arenas hold at least that."""
    kwargs = first_variant(name)
    params = make_params(name)
    swapped = so.SwapOptimizer(getattr(torch.optim, name)(params, **kwargs), swap_times=16, min_numel=0)
    give_grads(0, params)
    swapped.step()
    stats = swapped.memory_stats()
    assert stats["largest_whole_param_state_bytes"] == largest
    assert stats["peak_staging_bytes"] >= 2 * largest


@requires_cuda
@pytest.mark.parametrize("name,kwargs", [("SGD", dict(momentum=0.9, nesterov=True, weight_decay=0.01)),
                                         ("NAdam", dict(weight_decay=0.01)), ("Adafactor", dict()),
                                         ("Adafactor", dict(foreach=True)), ("Adafactor", dict(foreach=False)),
                                         ("Muon", dict())])
def test_device_peak_stays_within_staging_and_the_temporaries_estimate_on_cuda(name, kwargs):
    """Measured: the step's device peak above params and grads is at most the
    staging bytes plus update_temporary_bytes (plus 1 MiB for small
    allocations: scalars, the allocator's rounding). The first step is not
    measured: its first matmul allocates cuBLAS's workspace, which stays."""
    params = make_params(name, device="cuda")
    swapped = so.SwapOptimizer(getattr(torch.optim, name)(params, lr=0.01, **kwargs), swap_times=4, min_numel=0)
    give_grads(0, params)
    swapped.step()
    for step in range(1, 4):
        give_grads(step, params)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        swapped.step()
        torch.cuda.synchronize()
        stats = swapped.memory_stats()
        assert torch.cuda.max_memory_allocated() - baseline <= \
            stats["peak_staging_bytes"] + stats["update_temporary_bytes"] + 2 ** 20, step


def test_state_dict_round_trips_with_the_plain_optimizer():
    """Save from SwapOptimizer, load into the plain optimizer and go on; and
    back: both resumes are bitwise the uninterrupted plain run."""
    for name, kwargs in [(name, first_variant(name)) for name in ("NAdam", "ASGD", "Adafactor")]:
        cls = getattr(torch.optim, name)
        a, b, c = make_params(name), make_params(name), make_params(name)
        reference = cls(a, **kwargs)
        swapped = so.SwapOptimizer(cls(b, **kwargs), swap_times=4, min_numel=0)
        for step in range(5):
            give_grads(step, a, b)
            reference.step()
            swapped.step()
        resumed = cls(c, **kwargs)
        with torch.no_grad():
            for p, q in zip(c, b):
                p.copy_(q)
        resumed.load_state_dict(swapped.state_dict())
        back = so.SwapOptimizer(cls(make_params(name), **kwargs), swap_times=2, min_numel=0)
        back_params = back.param_groups[0]["params"]
        with torch.no_grad():
            for p, q in zip(back_params, b):
                p.copy_(q)
        back.load_state_dict(reference.state_dict())
        for step in range(5, 10):
            give_grads(step, a, c, back_params)
            reference.step()
            resumed.step()
            back.step()
        assert all(same_bits(p, q) and same_bits(p, r) for p, q, r in zip(a, c, back_params)), name
        assert_same_state(reference, back)


def test_no_state_means_nothing_to_swap():
    swapped = run_rule_pair("SGD", dict(lr=0.1), steps=3, swap_times=4).swapped
    stats = swapped.memory_stats()
    assert stats["host_state_bytes"] == 0 and stats["batches"] == 0 and stats["swapped_state_keys"] == []
    assert swapped.state_dict()["state"] == {}


def test_momentum_turned_on_by_a_scheduler_before_the_first_step():
    """OneCycleLR's cycle_momentum sets SGD's momentum when it is built: the
    store is laid out again at the first step, with momentum buffers."""
    a, b = make_params("SGD"), make_params("SGD")
    plain = torch.optim.SGD(a, lr=0.1)
    swapped = so.SwapOptimizer(torch.optim.SGD(b, lr=0.1), swap_times=4, min_numel=0)
    schedulers = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20) for o in (plain, swapped)]
    for step in range(10):
        give_grads(step, a, b)
        plain.step()
        swapped.step()
        for scheduler in schedulers:
            scheduler.step()
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)
    assert swapped.memory_stats()["host_state_bytes"] > 0


def test_a_setting_that_would_change_a_stepped_params_states_is_refused():
    params = make_params("RMSprop")
    swapped = so.SwapOptimizer(torch.optim.RMSprop(params, lr=0.01), swap_times=2, min_numel=0)
    give_grads(0, params)
    swapped.step()
    before = {k: v.clone() for k, v in swapped.state[params[0]].items()}
    swapped.param_groups[0]["centered"] = True
    with pytest.raises(ValueError, match="has stepped with"):
        swapped.step()
    swapped.param_groups[0]["centered"] = False
    for key, value in before.items():
        assert torch.equal(swapped.state[params[0]][key], value)


REFUSED = {
    "LBFGS": (lambda ps: torch.optim.LBFGS(ps), TypeError, "cannot wrap LBFGS: LBFGS keeps one history"),
    "SparseAdam": (lambda ps: torch.optim.SparseAdam(ps), TypeError, "cannot wrap SparseAdam"),
    "subclass": (lambda ps: type("MySGD", (torch.optim.SGD,), {})(ps, lr=0.1), TypeError, "the classes themselves"),
    "differentiable": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, differentiable=True), ValueError,
                       "has differentiable=True, which SwapOptimizer does not support"),
    "capturable": (lambda ps: torch.optim.RMSprop(ps, capturable=True), ValueError,
                   "has capturable=True, which SwapOptimizer does not support"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refusals(case):
    make, error, message = REFUSED[case]
    with pytest.raises(error, match=message):
        so.SwapOptimizer(make(make_params("SGD")))


def test_a_sparse_grad_is_refused_before_anything_moves():
    params = make_params("SGD")
    swapped = so.SwapOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), swap_times=2, min_numel=0)
    before = [p.detach().clone() for p in params]
    give_grads(0, params)
    params[1].grad = params[1].grad.to_sparse()
    with pytest.raises(RuntimeError, match="has a sparse gradient"):
        swapped.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and swapped.state_dict()["state"] == {}


def test_muon_refuses_a_1d_param_added_later():
    """torch's Muon.add_param_group takes a 1-D param and fails only mid-step:
    SwapOptimizer refuses it up front, and keeps its groups and state."""
    params = make_params("Muon")
    swapped = so.SwapOptimizer(torch.optim.Muon(params, lr=0.01), swap_times=2, min_numel=0)
    give_grads(0, params)
    swapped.step()
    before = {k: v.clone() for k, v in swapped.state[params[0]].items()}
    with pytest.raises(ValueError, match="Muon updates 2-D matrices only"):
        swapped.add_param_group(dict(params=[nn.Parameter(torch.zeros(7))]))
    assert len(swapped.param_groups) == 1
    assert all(torch.equal(swapped.state[params[0]][k], v) for k, v in before.items())
    give_grads(1, params)
    swapped.step()


@pytest.mark.parametrize("name", ["SGD", "Muon"])
def test_a_staging_budget_picks_swap_times_counting_torchs_temporaries(name):
    """staging_budget_bytes: the smallest swap_times whose arenas plus the
    estimate of torch's temporaries fit; bitwise the plain optimizer; a budget
    below the least that works is refused, naming it (and, for Muon, that its
    params move whole)."""
    kwargs = first_variant(name)
    cls = getattr(torch.optim, name)
    params = make_params(name)
    fine = so.SwapOptimizer(cls(params, **kwargs), swap_times=8, min_numel=0)
    give_grads(0, params)
    fine.step()
    fine = fine.memory_stats()
    budget = fine["peak_staging_bytes"] + fine["update_temporary_bytes"] + 1
    a, b = make_params(name), make_params(name)
    plain = cls(a, **kwargs)
    swapped = so.SwapOptimizer(cls(b, **kwargs), staging_budget_bytes=budget, min_numel=0)
    for step in range(4):
        give_grads(step, a, b)
        plain.step()
        swapped.step()
    stats = swapped.memory_stats()
    assert stats["peak_staging_bytes"] + stats["update_temporary_bytes"] <= budget
    assert stats["batches"] <= fine["batches"]
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)
    whole = "; params its rule never cuts move whole, the largest of 179200 elements" if name == "Muon" else ""
    with pytest.raises(ValueError, match=f"staging_budget_bytes=1000 is too small for {name}: the smallest budget "
                                         f"that works is \\d+ bytes .*{whole}"):
        so.SwapOptimizer(cls(make_params(name), **kwargs), staging_budget_bytes=1000, min_numel=0)


@pytest.mark.parametrize("setting,message", [
    # (bf16 and 8-bit states work with every elementwise optimizer: tests/rules/test_compact_rules.py;
    # so does kahan_summation: tests/rules/test_kahan_rules.py)
    (dict(state_dtype=torch.float32), "state_dtype work\\(s\\) with Adam/AdamW only"),
    (dict(master_weights=True), "master_weights work\\(s\\) with Adam/AdamW only"),
    (dict(state_keys=("exp_avg",)), "are not states of SGD here; its states are \\['momentum_buffer'\\]"),
])
def test_adam_only_settings_are_refused(setting, message):
    with pytest.raises(ValueError, match=message):
        so.SwapOptimizer(torch.optim.SGD(make_params("SGD"), lr=0.1, momentum=0.9), **setting)


@pytest.mark.parametrize("dtype,message", [(torch.float64, "has dtype torch.float64"),
                                           (torch.complex64, "is complex")])
def test_float64_and_complex_params_are_refused(dtype, message):
    with pytest.raises(TypeError, match=message):
        so.SwapOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(4, dtype=dtype))], lr=0.1, momentum=0.9))


def test_state_keys_keep_the_others_on_the_device():
    """state_keys names the wrapped optimizer's states: the ones not named stay
    resident, and the results do not change."""
    swapped = run_rule_pair("RMSprop", first_variant("RMSprop"), steps=5, swap_times=4, state_keys=("square_avg",)).swapped
    assert swapped.memory_stats()["swapped_state_keys"] == ["square_avg"]
    assert swapped.memory_stats()["resident_state_bytes"] > 0


def torn_sgd():
    """An SGD SwapOptimizer after one step, whose second step failed inside
    torch's own update (a group value only the update reads), so that its
    batch is torn; and the state dict saved after the first step."""
    params = make_params("SGD")
    swapped = so.SwapOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False), swap_times=2,
                               min_numel=0)
    give_grads(0, params)
    swapped.step()
    saved = swapped.state_dict()
    swapped.param_groups[0]["lr"] = "fast"
    give_grads(1, params)
    with pytest.raises(RuntimeError, match="may be partly updated"):
        swapped.step()
    swapped.param_groups[0]["lr"] = 0.1
    return swapped, saved


def test_a_failure_inside_torchs_step_tears_the_batch_and_a_checkpoint_mends_it():
    """torch's own step raising for a batch (a group value only its update
    reads) may have written part of that batch: its params are marked torn,
    step() refuses until a state dict is loaded, and then training goes on."""
    swapped, saved = torn_sgd()
    with pytest.raises(RuntimeError, match="partly updated; step\\(\\) refuses to run"):
        swapped.step()
    swapped.load_state_dict(saved)
    swapped.step()


def test_adafactor_mixing_dtypes_needs_an_explicit_eps1():
    """eps=(None, ...) takes eps1 from the first param of torch's call, which
    batch by batch may have another dtype: refused; with eps1 given, a mixed
    group is bitwise the plain one."""
    def mixed():
        generator = torch.Generator().manual_seed(3)
        return [nn.Parameter(torch.randn(300, 300, generator=generator).to(dtype))
                for dtype in (torch.float32, torch.float16)]
    with pytest.raises(ValueError, match="mixes param dtypes .* with eps=\\(None, ...\\)"):
        so.SwapOptimizer(torch.optim.Adafactor(mixed(), lr=0.01), swap_times=2, min_numel=0)
    a, b = mixed(), mixed()
    plain = torch.optim.Adafactor(a, lr=0.01, eps=(1e-30, 1e-3))
    swapped = so.SwapOptimizer(torch.optim.Adafactor(b, lr=0.01, eps=(1e-30, 1e-3)), swap_times=2, min_numel=0)
    assert swapped.memory_stats()["batches"] == 2
    for step in range(4):
        give_grads(step, a, b)
        plain.step()
        swapped.step()
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)


def test_fused_with_a_non_contiguous_param_is_refused():
    param = nn.Parameter(torch.randn(64, 48).t())
    with pytest.raises(ValueError, match="has fused=True and a non-contiguous param"):
        so.SwapOptimizer(torch.optim.Adagrad([param], fused=True), min_numel=0)


def test_a_rejected_load_keeps_the_groups_and_the_torn_refusal():
    """A state dict refused by load_state_dict changes nothing: the groups stay
    the optimizer's own, and a torn optimizer still refuses to step."""
    swapped, saved = torn_sgd()
    # As torch's, the state dict shares the state's entries: edited on copies.
    bad = dict(param_groups=[dict(g, lr=123.0) for g in saved["param_groups"]],
               state={i: dict(e) for i, e in saved["state"].items()})
    bad["state"][0]["momentum_buffer"] = torch.zeros(3)
    with pytest.raises(ValueError, match="'momentum_buffer' has shape \\(3,\\)"):
        swapped.load_state_dict(bad)
    assert swapped.param_groups[0]["lr"] == 0.1
    with pytest.raises(RuntimeError, match="partly updated; step\\(\\) refuses to run"):
        swapped.step()


@pytest.mark.slow  # (9 s of the README's tier; Muon's bitwise test of each config stays there)
def test_muon_for_the_matrices_beside_adamw_for_the_rest():
    """Muon's usual set-up: the hidden matrices on Muon, the embedding, norms
    and head on AdamW, each its own SwapOptimizer, stepped in one loop with
    the same grads as their plain twins. Muon is bitwise torch's; AdamW within
    its fused kernel's stated tolerance (docs/design.md). Each step releases
    its arenas, so at any time the device holds at most the larger staging of
    the two."""
    def params():
        generator = torch.Generator().manual_seed(7)
        hidden = [nn.Parameter(torch.randn(256, 512, generator=generator)),
                  nn.Parameter(torch.randn(512, 256, generator=generator))]
        rest = [nn.Parameter(torch.randn(*shape, generator=generator)) for shape in ((1000, 256), (256,), (256,))]
        return hidden, rest

    (hidden_a, rest_a), (hidden_b, rest_b) = params(), params()
    plain = [torch.optim.Muon(hidden_a, lr=0.02), torch.optim.AdamW(rest_a, lr=1e-3)]
    swapped = [so.SwapOptimizer(torch.optim.Muon(hidden_b, lr=0.02), swap_times=2, min_numel=0),
               so.SwapOptimizer(torch.optim.AdamW(rest_b, lr=1e-3), swap_times=2, min_numel=0)]
    for step in range(6):
        give_grads(step, hidden_a + rest_a, hidden_b + rest_b)
        for optimizer in plain + swapped:
            optimizer.step()
        for optimizer in swapped:
            assert optimizer.memory_stats()["staging_bytes"] == 0  # released once its step is done
    assert all(same_bits(p, q) for p, q in zip(hidden_a, hidden_b))
    assert_same_state(plain[0], swapped[0])
    for p, q in zip(rest_a, rest_b):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    peaks = [optimizer.memory_stats()["peak_staging_bytes"] for optimizer in swapped]
    assert all(peak > 0 for peak in peaks)


@pytest.mark.parametrize("name", ["SGD", "NAdam", "Adafactor"])
def test_an_interrupt_lets_the_step_finish_then_raises(name):
    """Ctrl-C during the step (at every batch): torch's update is Python, where
    a signal could land mid-batch, so the step finishes first and the
    KeyboardInterrupt follows it. Every param and its states, scalars
    included, are then new, bitwise the plain optimizer's, and stepping goes
    on."""
    kwargs = first_variant(name)
    cls = getattr(torch.optim, name)
    a, b = make_params(name), make_params(name)
    plain = cls(a, **kwargs)
    swapped = so.SwapOptimizer(cls(b, **kwargs), swap_times=4, min_numel=0)
    batches = len(swapped._batch_layout())
    assert batches >= 3
    for step, fault_batch in enumerate(range(1, batches)):  # taken between batches
        give_grads(step, a, b)
        plain.step()
        swapped._set_test_hooks(fault="interrupt", fault_batch=fault_batch)
        with pytest.raises(KeyboardInterrupt):
            swapped.step()
        swapped._set_test_hooks()
        assert all(same_bits(p, q) for p, q in zip(a, b)), fault_batch
        assert_same_state(plain, swapped)
    give_grads(99, a, b)
    plain.step()
    swapped.step()
    assert all(same_bits(p, q) for p, q in zip(a, b))


def entry_bits(entry):
    return {key: bits(value).clone() if torch.is_tensor(value) else value for key, value in entry.items()}


@pytest.mark.parametrize("fault", ["stage_in", "update"])
@pytest.mark.parametrize("name", ["SGD", "NAdam", "Adafactor"])
def test_a_fault_at_any_batch_loses_nothing(name, fault):
    """A copy in or an update failing at each batch: every param not reported
    torn is, with its states and scalars, wholly the plain optimizer's before
    the step or wholly after it; a torn one makes step() refuse until a state
    dict is loaded, and training from that state then matches the plain
    optimizer's."""
    kwargs = first_variant(name)
    cls = getattr(torch.optim, name)
    batches = len(so.SwapOptimizer(cls(make_params(name), **kwargs), swap_times=4, min_numel=0)._batch_layout())
    assert batches >= 3
    tears = 0
    for fault_batch in range(batches):
        params = make_params(name)
        swapped = so.SwapOptimizer(cls(params, **kwargs), swap_times=4, min_numel=0)
        give_grads(0, params)
        swapped.step()
        saved = copy.deepcopy(swapped.state_dict())  # torch's load would keep the store's own tensors
        before = [(bits(p).clone(), entry_bits(swapped.state[p])) for p in params]
        reference = [p.detach().clone() for p in params]
        plain = cls(reference, **kwargs)
        plain.load_state_dict(saved)
        give_grads(1, reference, params)
        plain.step()
        after = [(bits(p).clone(), entry_bits(plain.state[p])) for p in reference]
        swapped._set_test_hooks(fault=fault, fault_batch=fault_batch)
        with pytest.raises(RuntimeError) as failure:
            swapped.step()
        swapped._set_test_hooks()
        torn = {int(i) for i in re.findall(r"param (\d+) \(shape", str(failure.value))}
        for i, p in enumerate(params):
            if i in torn:
                continue
            now = (bits(p), entry_bits(swapped.state[p]))
            assert any(torch.equal(now[0], then[0]) and now[1].keys() == then[1].keys() and all(
                torch.equal(now[1][k], v) if torch.is_tensor(v) else now[1][k] == v for k, v in then[1].items())
                for then in (before[i], after[i])), (fault_batch, i)
        if torn:
            tears += 1
            with pytest.raises(RuntimeError, match="partly updated"):
                swapped.step()
        swapped.load_state_dict(plain.state_dict())  # mends a torn param; either way training goes on
        with torch.no_grad():
            for p, q in zip(params, reference):
                p.copy_(q)
        give_grads(2, reference, params)
        plain.step()
        swapped.step()
        assert all(same_bits(p, q) for p, q in zip(params, reference)), fault_batch
        assert_same_state(plain, swapped)
    assert (tears > 0) == (name not in WHOLE), "a fault inside a cut param tears it; whole params never tear"


@pytest.mark.parametrize("name", ["SGD", "NAdam", "Adafactor"])
def test_writes_through_data_between_steps(name):
    """A param's values written through .data (in place, or a new tensor put
    in its place, as weight-averaging and checkpoint-loading code does)
    between steps: the next steps use them, bitwise like the plain optimizer."""
    kwargs = first_variant(name)
    cls = getattr(torch.optim, name)
    a, b = make_params(name), make_params(name)
    plain = cls(a, **kwargs)
    swapped = so.SwapOptimizer(cls(b, **kwargs), swap_times=4, min_numel=0)
    for step in range(4):
        give_grads(step, a, b)
        plain.step()
        swapped.step()
        for p, q in zip(a, b):
            if step == 1:
                p.data.mul_(0.5)
                q.data.mul_(0.5)
            if step == 2:
                p.data = p.data.clone() + 1
                q.data = q.data.clone() + 1
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)


@pytest.mark.parametrize("name", ["SGD", "NAdam"])
def test_state_edits_between_steps_reach_the_store(name):
    """`state` edited between steps as torch.optim allows, each the same on
    the plain optimizer: a state's value replaced inside an entry, a scalar
    replaced (NAdam's step), an entry replaced by a new dict of new values,
    an entry removed (torch starts its state anew), an entry's tensor written
    in place: the next steps use them, bitwise like the plain optimizer (the
    store tells an edit from the entries it showed, whatever their batch)."""
    kwargs = dict(first_variant(name), foreach=True)
    cls = getattr(torch.optim, name)
    a, b = make_params(name), make_params(name)
    plain = cls(a, **kwargs)
    swapped = so.SwapOptimizer(cls(b, **kwargs), swap_times=4, min_numel=0)
    state_name = "momentum_buffer" if name == "SGD" else "exp_avg"
    generator = torch.Generator().manual_seed(7)
    for step in range(7):
        give_grads(step, a, b)
        plain.step()
        swapped.step()
        i = step % len(a)
        new = torch.randn(a[i].shape, generator=generator)
        if step == 1:  # a value replaced inside the entry
            plain.state[a[i]][state_name] = new.clone()
            swapped.state[b[i]][state_name] = new.clone()
        if step == 2 and name == "NAdam":  # a scalar replaced
            plain.state[a[i]]["step"] = torch.tensor(40.0)
            swapped.state[b[i]]["step"] = torch.tensor(40.0)
        if step == 3:  # the entry replaced by a new dict
            plain.state[a[i]] = {**plain.state[a[i]], state_name: new.clone()}
            swapped.state[b[i]] = {**swapped.state[b[i]], state_name: new.clone()}
        if step == 4:  # the entry removed: the state starts anew
            del plain.state[a[i]]
            del swapped.state[b[i]]
        if step == 5:  # written in place: the store's own view
            plain.state[a[i]][state_name].mul_(0.5)
            swapped.state[b[i]][state_name].mul_(0.5)
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)


def test_a_setting_changed_with_an_edit_keeps_both():
    """A state edited and, in the same interval, a setting that changes an
    unstepped param's layout (the store is laid out again): the edit is
    kept, as torch.optim steps from it."""
    def run(wrap):
        torch.manual_seed(0)
        a = [nn.Parameter(torch.randn(300)) for _ in range(2)]
        b = [nn.Parameter(torch.randn(300))]
        optimizer = torch.optim.SGD([{"params": a, "momentum": 0.9}, {"params": b, "momentum": 0.0}], lr=0.1)
        if wrap:
            optimizer = so.SwapOptimizer(optimizer, swap_times=2, min_numel=0)
        for step in range(4):
            give_grads(step, a + b)
            optimizer.step()
            if step == 1:
                optimizer.state[a[0]]["momentum_buffer"] = torch.full((300,), 0.25)
                optimizer.param_groups[1]["momentum"] = 0.9
        return optimizer, a + b

    (plain, a), (swapped, b) = run(False), run(True)
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)


@pytest.mark.parametrize("how", ["data", "inference"])
def test_a_group_tensor_changed_without_a_version_bump(how):
    """A group's tensor value that changes without a version bump: through
    .data (SGD's momentum turned on before a param's first step: its
    momentum_buffer is kept from then on), or an inference tensor (it keeps
    no version): bitwise like the plain optimizer."""
    def run(wrap):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(300)) for _ in range(2)]
        if how == "data":
            optimizer = torch.optim.SGD(params, lr=0.1, momentum=torch.tensor(0.0))
        else:
            with torch.inference_mode():
                lr = torch.tensor(0.1)
            optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
        if wrap:
            optimizer = so.SwapOptimizer(optimizer, swap_times=2, min_numel=0)
        for step in range(4):
            give_grads(step, params[:1] if step == 0 else params)
            optimizer.step()
            if step == 0 and how == "data":
                optimizer.param_groups[0]["momentum"].data = torch.tensor(0.9)
        return optimizer, params

    (plain, a), (swapped, b) = run(False), run(True)
    assert sorted(swapped.state[b[1]]) == sorted(plain.state[a[1]])
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)


def test_a_group_no_longer_fused_refuses_the_scale_in_step():
    params = make_params("SGD")
    swapped = so.SwapOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True), swap_times=4, min_numel=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    give_grads(0, params)
    scaler.scale(torch.ones(()))
    scaler.step(swapped)
    scaler.update()
    swapped.param_groups[0]["fused"] = False
    before = [p.detach().clone() for p in params]
    give_grads(1, params)
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="param group\\(s\\) \\[0\\] of SGD are not fused=True \\(any more\\)"):
        scaler.step(swapped)
    assert all(same_bits(p, q) for p, q in zip(params, before))


def test_foreach_left_to_torch_is_counted_as_torch_chooses_it_on_cuda():
    """foreach=None: torch runs most optimizers' foreach path on CUDA (three
    lists of the call's bytes), but Adafactor's for-loop (three of the largest
    param), on CUDA too; on the CPU every for-loop."""
    from swap_optimizer.rules.declarations import declaration_for, estimated_temporaries

    rows = [((100, 10), 4), ((50,), 4)]  # 4000 and 200 bytes
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    sgd = declaration_for(torch.optim.SGD(make_params("SGD"), lr=0.1, momentum=0.9))
    adafactor = declaration_for(torch.optim.Adafactor(make_params("Adafactor")))
    assert estimated_temporaries(sgd, rows, dict(foreach=None), cuda, 0) == 3 * 4200
    assert estimated_temporaries(sgd, rows, dict(foreach=None), cpu, 0) == 3 * 4000
    assert estimated_temporaries(adafactor, rows, dict(foreach=None), cuda, 0) == 3 * 4000
    assert estimated_temporaries(adafactor, rows, dict(foreach=True), cuda, 0) == 3 * 4200


def test_a_group_value_that_cannot_be_copied_is_shared_not_refused():
    """The values a step reads are copied at step() (tensors and containers),
    but objects a group may hold besides (a lock, a module) are shared as a
    shallow copy of the group shares them: stepping neither copies nor
    refuses them, and stays bitwise."""
    import threading

    a, b = make_params("SGD"), make_params("SGD")
    extra = [threading.Lock(), nn.Linear(4, 4)]
    plain = torch.optim.SGD([{"params": a, "extra": extra}], lr=0.1, momentum=0.9)
    swapped = so.SwapOptimizer(torch.optim.SGD([{"params": b, "extra": extra}], lr=0.1, momentum=0.9),
                               swap_times=2, min_numel=0)
    for step in range(3):
        give_grads(step, a, b)
        plain.step()
        swapped.step()
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert swapped.param_groups[0]["extra"] is extra


def test_every_rule_implements_the_interface_and_optimizer_calls_nothing_else():
    """Each rule has every member of rules.UpdateRule, and SwapOptimizer calls
    nothing of its rule beyond them (a new rule needs exactly those)."""
    import inspect
    import re
    from swap_optimizer import optimizer as optimizer_module
    from swap_optimizer.rules import PackedKernelRule, TorchUpdateRule, UpdateRule, VouchedForRule
    members = {name for name in dir(UpdateRule) if not name.startswith("_")} - {"optimizer"}
    for rule in (PackedKernelRule, TorchUpdateRule, VouchedForRule):
        assert all(callable(getattr(rule, name, None)) or isinstance(getattr(rule, name, None), property)
                   for name in members), rule
    called = set(re.findall(r"_rule\.([a-z_]+)", inspect.getsource(optimizer_module)))
    assert called <= members, called - members
    torch.manual_seed(0)
    wrapped = so.SwapOptimizer(torch.optim.SGD([nn.Parameter(torch.randn(8))], lr=0.1, momentum=0.9))
    assert isinstance(wrapped._rule, UpdateRule)

