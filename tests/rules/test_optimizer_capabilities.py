"""Every capability over the table of optimizers (tests/optimizer_cases.py):
each test runs a row per (optimizer, kwargs variant), and a capability the
table marks False for an optimizer makes that optimizer's rows skip or
assert SwapOptimizer's refusal. Tiny params and 3 steps a row: the point is
the coverage, not the soak (tests/rules/test_rules.py and the others go deep on
single features)."""

import copy
import re

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import swap_optimizer as so
from optimizer_cases import DTYPES, IMPLEMENTATIONS, rows
from pairs import give_grads, run_pair

STEPS = 3
EXACT = dict(rtol=0, atol=0)
# Where the table says an optimizer is not bitwise (none today: Adam/AdamW
# are marked bitwise, the target): their fused kernel's stated fp32 tolerance.
NOT_BITWISE = dict(rtol=1e-5, atol=1e-7)


def assert_entries_close(ours, theirs, tolerance, what=""):
    """Two state dicts' "state" entries: tensors within `tolerance` (as
    torch.testing compares them, on the CPU), anything else equal."""
    assert ours.keys() == theirs.keys(), what
    for index, entry in theirs.items():
        assert ours[index].keys() == entry.keys(), (what, index)
        for key, value in entry.items():
            mine = ours[index][key]
            if torch.is_tensor(value):
                assert_close(mine.cpu(), value.cpu(), **tolerance, msg=lambda m: f"{what} state {index}/{key}: {m}")
            else:
                assert mine == value, (what, index, key)


def assert_runs_alike(params, other_params, optimizer, other, tolerance, what=""):
    for i, (p, q) in enumerate(zip(params, other_params)):
        assert_close(p.detach(), q.detach(), **tolerance, msg=lambda m: f"{what} param {i}: {m}")
    assert_entries_close(optimizer.state_dict()["state"], other.state_dict()["state"], tolerance, what)


def tolerance_of(case):
    return EXACT if case.bitwise else NOT_BITWISE


def swap_settings(case, **settings):
    return dict(dict(min_numel=0, **case.settings), **settings)


# ------------------------------------------------------------------ parity
@pytest.mark.parametrize("case, variant, implementation, dtype", rows(IMPLEMENTATIONS, DTYPES))
def test_parity_with_the_plain_optimizer(case, variant, implementation, dtype):
    """Params, states and param groups after STEPS steps: bitwise the plain
    optimizer with the same implementation flags (for-loop, foreach, fused),
    the large params cut into pieces where the optimizer allows it."""
    if not case.has(implementation):
        pytest.skip(f"torch has no {implementation} {case.name}")
    if dtype not in case.dtypes:
        pytest.skip(f"{case.name} runs {', '.join(case.dtypes)} params only (its entry in optimizer_cases.py says why)")
    pair = run_pair(case.make(variant, implementation), case.params(DTYPES[dtype]), STEPS,
                    **swap_settings(case, swap_times=4))
    assert_runs_alike(pair.swapped_params, pair.plain_params, pair.swapped, pair.plain, tolerance_of(case),
                      f"{case.name} {variant} {implementation} {dtype}")
    assert pair.swapped.state_dict()["param_groups"] == pair.plain.state_dict()["param_groups"]


# ------------------------------------------------------ state-dict round trip
@pytest.mark.parametrize("case, variant", rows())
def test_state_dict_round_trip_with_the_plain_optimizer(case, variant):
    """Plain for two steps, its state dict into a SwapOptimizer for two, that
    one's back into a plain one for two: bitwise the plain run that never
    left (params and states)."""
    make, fresh = case.make(variant), case.params()
    reference_params = fresh()
    reference = make(reference_params)
    params = [fresh() for _ in range(3)]
    plain = make(params[0])
    swapped = so.SwapOptimizer(make(params[1]), **swap_settings(case, swap_times=4))
    back = make(params[2])
    for leg, (optimizer, previous) in enumerate([(plain, None), (swapped, plain), (back, swapped)]):
        if previous is not None:
            with torch.no_grad():
                for p, q in zip(params[leg], params[leg - 1]):
                    p.copy_(q)
            optimizer.load_state_dict(previous.state_dict())
        for step in range(2 * leg, 2 * leg + 2):
            give_grads(step, reference_params, params[leg])
            reference.step()
            optimizer.step()
    assert_runs_alike(params[2], reference_params, back, reference, tolerance_of(case), f"{case.name} {variant}")


# ----------------------------------------------------------------- overlap
def tiny_model(case):
    torch.manual_seed(0)
    bias = not case.only_2d
    return nn.Sequential(nn.Linear(16, 24, bias=bias), nn.Tanh(), nn.Linear(24, 24, bias=bias), nn.Tanh(),
                         nn.Linear(24, 8, bias=bias))


def train_model(model, optimizer, steps):
    losses = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
        optimizer.step()
    params = [p.detach().clone() for p in model.parameters()]  # waits for the last step's updates
    return losses, params


@pytest.mark.parametrize("case, variant", rows())
def test_overlap_forward_is_bitwise_the_run_without(case, variant):
    """overlap_forward=True with a model (random copy and compute delays, so
    that a missed wait would change bits): losses, params and states bitwise
    the run without overlap; the step deferred where the table says so."""
    if not case.overlap:
        pytest.skip(f"{case.name} has no overlap_forward")
    runs = []
    for overlap in (False, True):
        model = tiny_model(case)
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        optimizer = so.SwapOptimizer(case.make(variant)(model.parameters()),
                                     **swap_settings(case, swap_times=4, num_arenas=3), **extra)
        if overlap:
            optimizer._set_test_hooks(copy_delay_us=100, compute_delay_us=100, seed=5)
        losses, params = train_model(model, optimizer, STEPS)
        if overlap:
            assert optimizer._overlap._last_step_deferred == case.overlap_deferred
        runs.append((losses, params, optimizer))
    (losses_off, params_off, off), (losses_on, params_on, on) = runs
    assert_close(torch.stack(losses_on), torch.stack(losses_off), **EXACT)
    assert_runs_alike(params_on, params_off, on, off, EXACT, f"{case.name} {variant} overlap")


# ------------------------------------------------------------ split params
@pytest.mark.parametrize("case, variant", rows())
def test_params_cut_into_pieces_are_bitwise_whole_ones(case, variant):
    """swap_times=8 cuts the two large params across batches where the
    optimizer allows it: bitwise the run that moves every param whole
    (swap_times=1). Where it does not, no param is ever cut."""
    whole = run_pair(case.make(variant), case.params(), STEPS, **swap_settings(case, swap_times=1))
    cut = run_pair(case.make(variant), case.params(), STEPS, **swap_settings(case, swap_times=8, num_arenas=3))
    assert whole.swapped.memory_stats()["split_params"] == 0
    if case.split:
        assert cut.swapped.memory_stats()["split_params"] >= 1
    else:
        assert cut.swapped.memory_stats()["split_params"] == 0, f"{case.name}'s params must move whole"
    assert_runs_alike(cut.swapped_params, whole.swapped_params, cut.swapped, whole.swapped, EXACT,
                      f"{case.name} {variant} cut")


# ----------------------------------------------------------- device budget
SLOW_LINK = so.StepCostModel(1e9, 1e9, 1.6e9, 1e11, batch_seconds=20e-6, step_seconds=100e-6)


def partial_budget(case, variant, fields, floor, host):
    """A budget that keeps part of the state resident: of 13 from the
    all-swapped plan's device bytes (floor) to that plus every swapped state
    byte (host), the one keeping the largest share short of all; where none
    does (Adafactor: keeping all resident costs little more than swapping
    all, so the window is narrow), the least budget keeping any, bisected.
    Wrapping alone plans, but for a vouched-for optimizer, whose states are
    learned at its first step."""
    def share(budget):
        params = case.params()()
        optimizer = so.SwapOptimizer(case.make(variant)(params), device_budget_bytes=budget, **fields)
        if case.vouched_for:
            give_grads(0, params)
            optimizer.step()
        return optimizer.memory_stats()["resident_share"]

    shares = {budget: share(budget) for budget in (floor + i * host // 12 for i in range(13))}
    partial = [budget for budget, value in shares.items() if 0 < value < 1]
    if partial:
        return max(partial, key=shares.get)
    low, high = floor, floor + host
    while high - low > 64:
        middle = (low + high) // 2
        shares[middle] = share(middle)
        low, high = (low, middle) if shares[middle] > 0 else (middle, high)
    assert 0 < share(high) < 1, f"no budget keeps part of {case.name}'s state resident: {shares}"
    return high


@pytest.mark.parametrize("case, variant", rows())
def test_a_device_budget_is_bitwise_the_run_without(case, variant):
    """device_budget_bytes keeping part of the state resident (a share
    strictly between 0 and 1): within the budget, bitwise the unbudgeted run."""
    fields = swap_settings(case, swap_times=4, num_arenas=2, cost_model=SLOW_LINK)
    unbudgeted = run_pair(case.make(variant), case.params(), STEPS, **fields)
    budget = partial_budget(case, variant, fields, unbudgeted.swapped.plan_report()["chosen"]["device_bytes"],
                            unbudgeted.swapped.memory_stats()["host_state_bytes"])
    budgeted = run_pair(case.make(variant), case.params(), STEPS, device_budget_bytes=budget, **fields)
    stats = budgeted.swapped.memory_stats()
    assert 0 < stats["resident_share"] < 1, stats["resident_share"]
    assert stats["plan"]["device_bytes"]["total"] <= budget
    assert_runs_alike(budgeted.swapped_params, unbudgeted.swapped_params, budgeted.swapped, unbudgeted.swapped,
                      EXACT, f"{case.name} {variant} budget")


# ---------------------------------------------------------- compact states
# How far compact states may take the params from the exact run's after STEPS
# steps, as a share of how far the exact run moved them (the largest change
# of any element: a step is about lr for Adam, lr times the momentum for SGD):
# measured up to 0.006 with bf16 states and 0.19 with 8-bit ones (8-bit
# Adagrad's and RMSprop's denominators of tiny grads in a block of large
# ones; every case of the table); about 3x and 2x that.
COMPACT = {"bf16": (torch.bfloat16, 0.02), "8bit": (torch.uint8, 0.4)}


@pytest.mark.parametrize("case, variant, mode", rows(COMPACT))
def test_compact_states_stay_close_or_are_refused(case, variant, mode):
    """state_dtype=torch.bfloat16 / torch.uint8: where the optimizer has
    compact states, a short run ends within the stated tolerance of the exact
    one and moves fewer bytes a param each way; where its states are not worth
    quantizing (Rprop), a warning and the exact run, bitwise; elsewhere the
    wrap is refused with the reason."""
    state_dtype, share = COMPACT[mode]
    fields = swap_settings(case, swap_times=4)
    compacts = case.compact[mode] if isinstance(case.compact, dict) else case.compact
    if not compacts:
        reason = "needs trust_elementwise_step" if case.vouched_for else "works with elementwise optimizers"
        with pytest.raises(ValueError, match=reason):
            so.SwapOptimizer(case.make(variant)(case.params()()), state_dtype=state_dtype, **fields)
        return
    exact = run_pair(case.make(variant), case.params(), STEPS, **fields)
    if compacts == "exact":
        with pytest.warns(UserWarning, match="stay exact"):
            compact = run_pair(case.make(variant), case.params(), STEPS, state_dtype=state_dtype, **fields)
        assert_runs_alike(compact.swapped_params, exact.swapped_params, compact.swapped, exact.swapped, EXACT,
                          f"{case.name} {variant} {mode}")
        return
    compact = run_pair(case.make(variant), case.params(), STEPS, state_dtype=state_dtype, **fields)
    if case.sign_update:  # (a sign flipped near 0 moves that element a whole step: the mean is bounded)
        for i, (p, q, start) in enumerate(zip(compact.swapped_params, exact.swapped_params, case.params()())):
            off, moved = (p - q).abs().mean().item(), (q - start).abs().mean().item()
            assert off <= share * moved, f"{mode} param {i}: mean difference {off:.3g}, {share} of {moved:.3g} allowed"
    else:
        moved = max((q.detach() - start).abs().max().item()
                    for q, start in zip(exact.swapped_params, case.params()()))
        for i, (p, q) in enumerate(zip(compact.swapped_params, exact.swapped_params)):
            assert_close(p.detach(), q.detach(), rtol=0, atol=share * moved, msg=lambda m: f"{mode} param {i}: {m}")
    moved = [pair.swapped.memory_stats()["bytes_per_param_each_way"] for pair in (compact, exact)]
    assert moved[0] < moved[1], f"{mode} moves {moved[0]:.3f} bytes a param each way, the exact run {moved[1]:.3f}"


# -------------------------------------------------------------------- kahan
@pytest.mark.parametrize("case, variant", rows())
def test_kahan_summation_is_bitwise_across_cuts_or_refused(case, variant):
    """kahan_summation=True with bf16 params: where accepted, each param keeps
    a bf16 compensation, and the run is bitwise the same whole (swap_times=1)
    and cut (swap_times=4); elsewhere the wrap is refused with the reason.
    (Its accuracy and its reference: tests/rules/test_kahan_rules.py.)"""
    if not case.kahan:
        reason = "needs trust_elementwise_step" if case.vouched_for else "works with elementwise optimizers"
        with pytest.raises(ValueError, match=reason):
            so.SwapOptimizer(case.make(variant)(case.params(torch.bfloat16)()), kahan_summation=True,
                             **swap_settings(case))
        return
    runs = []
    for swap_times in (1, 4):
        params = case.params(torch.bfloat16)()
        optimizer = so.SwapOptimizer(case.make(variant)(params), kahan_summation=True,
                                     **swap_settings(case, swap_times=swap_times))
        for step in range(STEPS):
            give_grads(step, params)
            optimizer.step()
        assert all(optimizer.state[p]["compensation"].dtype == torch.bfloat16 for p in params)
        runs.append(([p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict()["state"])))
    assert runs[1][1] and runs[0][1].keys() == runs[1][1].keys()
    for a, b in zip(runs[0][0], runs[1][0]):
        assert_close(b, a, rtol=0, atol=0)
    for index, entry in runs[0][1].items():
        for key, value in entry.items():
            assert_close(torch.as_tensor(runs[1][1][index][key]), torch.as_tensor(value), rtol=0, atol=0,
                         msg=lambda m: f"state {index}/{key}: {m}")


# ------------------------------------------------------------------- faults
def snapshot(params, optimizer):
    return [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict()["state"])


@pytest.mark.parametrize("case, variant, fault", rows(["stage_in", "update"], slow_variants=True))
def test_a_fault_at_any_batch_loses_nothing_and_a_retry_matches(case, variant, fault):
    """A copy in or an update failing at each batch of the second step: every
    param not reported torn is, with its states, wholly as before the step or
    wholly as after it (a run without the fault); loading the state saved
    before the step and retrying gives that run's result bitwise, and the
    next step too. The first variant of each optimizer; the others in the
    slow tier (the faults are the pipeline's, whatever the hyper-parameters)."""
    make, fresh = case.make(variant), case.params()
    fields = swap_settings(case, swap_times=4)
    reference_params = fresh()
    reference = so.SwapOptimizer(make(reference_params), **fields)
    snapshots = []
    for step in range(3):
        give_grads(step, reference_params)
        reference.step()
        snapshots.append(snapshot(reference_params, reference))
    batches = len(reference._batch_layout())  # (a vouched-for optimizer's is learned at its first step)
    assert batches >= 2
    for fault_batch in range(batches):
        params = fresh()
        swapped = so.SwapOptimizer(make(params), **fields)
        give_grads(0, params)
        swapped.step()
        saved = copy.deepcopy(swapped.state_dict())
        give_grads(1, params)
        swapped._set_test_hooks(fault=fault, fault_batch=fault_batch)
        with pytest.raises(RuntimeError) as failure:
            swapped.step()
        swapped._set_test_hooks()
        torn = {int(i) for i in re.findall(r"param (\d+) \(shape", str(failure.value))}
        now = snapshot(params, swapped)
        for i in range(len(params)):
            if i not in torn:
                assert any(torch.equal(now[0][i], then[0][i]) and _entry_equal(now[1].get(i), then[1].get(i))
                           for then in snapshots[:2]), (fault_batch, i)
        if torn:
            with pytest.raises(RuntimeError, match="partly updated"):
                swapped.step()
        swapped.load_state_dict(saved)
        with torch.no_grad():
            for p, q in zip(params, snapshots[0][0]):
                p.copy_(q)
        for step in (1, 2):
            give_grads(step, params)
            swapped.step()
        assert_runs_alike(params, snapshots[2][0], swapped, reference, EXACT,
                          f"{case.name} {variant} {fault} at batch {fault_batch}")


def _entry_equal(a, b):
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(
        torch.equal(a[k], v) if torch.is_tensor(v) else a[k] == v for k, v in b.items())


# -------------------------------------------------------------------- FSDP2
@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo process group in this process and its device mesh:
    enough for DTensor params and the wrap's checks, without spawning ranks
    (tests/distributed/test_distributed.py runs two)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_available():
        pytest.skip("torch was built without torch.distributed")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case, variant", rows())
def test_fsdp2_dtensor_params_are_bitwise_local_ones_or_refused(case, variant, mesh):
    """DTensor params sharded on dim 0 (FSDP2's layout), on one rank: bitwise
    the same SwapOptimizer on plain tensors, states as DTensors; where the
    optimizer's update needs the whole param (or it is vouched for), the wrap
    is refused."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    def sharded():
        return [nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in case.params()()]

    fields = swap_settings(case, swap_times=4)
    if not case.fsdp2:
        with pytest.raises(ValueError, match="with DTensor params \\(FSDP2\\)"):
            so.SwapOptimizer(case.make(variant)(sharded()), **fields)
        return
    params, local_params = sharded(), case.params()()
    swapped, local = (so.SwapOptimizer(case.make(variant)(ps), **fields) for ps in (params, local_params))
    for step in range(STEPS):
        give_grads(step, local_params)
        for p, q in zip(params, local_params):
            p.grad = distribute_tensor(q.grad.clone(), mesh, [Shard(0)])
        swapped.step()
        local.step()
    assert all(isinstance(value, DTensor) for entry in swapped.state.values() for value in entry.values()
               if torch.is_tensor(value) and value.dim() > 0)
    for i, (p, q) in enumerate(zip(params, local_params)):
        assert_close(p.to_local().detach(), q.detach(), **EXACT, msg=lambda m: f"param {i}: {m}")
    for p, q in zip(params, local_params):
        for key, value in local.state[q].items():
            mine = swapped.state[p][key]
            mine = mine.to_local() if isinstance(mine, DTensor) else mine
            if torch.is_tensor(value):
                assert_close(torch.as_tensor(mine).cpu(), value.cpu(), **EXACT)
            else:
                assert mine == value
