"""device_budget_bytes="auto" on the CPU backend, against a simulated free
memory and peak: after the warm-up steps the budget is derived once (by the
arithmetic usage.md states), the states move to its plan exactly at that step
boundary (bitwise a run planned for that budget from the start), the old store
is let go before the new one is made, a failure while moving loses nothing, a
rebuild re-plans with the derived budget, and ranks agree (distributed case
ddp_auto_budget). The GPU check proves the measurement itself."""

import logging
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import swap_optimizer as so
from conftest import PACKED_KERNEL
from test_device_budget import SLOW_LINK, SWAP_TIMES, adamw, build, train, unbudgeted_device_bytes

WARMUP = 2
HEADROOM = 4096


def simulated(budget):
    """A device whose free memory, peak and allocation make an "auto" budget
    of `budget` bytes for an optimizer holding 4096 resident bytes (the Stack
    model's min_numel residents at min_numel 1024)."""
    return dict(free_bytes=budget + 10_000_000, peak_bytes=12_000_000 + 4096, allocated_bytes=2_000_000 + HEADROOM)


def auto_optimizer(net, **fields):
    fields = dict(dict(swap_times=SWAP_TIMES, num_arenas=2, cost_model=SLOW_LINK), **fields)
    return so.SwapOptimizer(adamw(net.parameters()), device_budget_bytes="auto", auto_warmup_steps=WARMUP,
                            auto_headroom_bytes=HEADROOM, **fields)


def snapshot(optimizer, model):
    return ([p.detach().clone() for p in model.parameters()],
            [{k: v.detach().clone() for k, v in optimizer.state[p].items()} for p in model.parameters()])


def assert_bitwise(first, second):
    for p, q in zip(first[0], second[0]):
        assert torch.equal(p, q)
    for a, b in zip(first[1], second[1]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def middle_budget():
    base, host = unbudgeted_device_bytes("cpu")
    return base + int(0.4 * host)


def test_the_budget_is_derived_once_and_the_states_move_exactly(caplog):
    budget = middle_budget()
    model = build("cpu")
    optimizer = auto_optimizer(model)
    optimizer._auto.simulated = simulated(budget)
    train(model, optimizer, WARMUP, "cpu")
    assert optimizer.memory_stats()["device_budget_bytes"] is None  # the warm-up runs the plan as given
    before = optimizer.memory_stats()["resident_share"]
    with caplog.at_level(logging.INFO, logger="swap_optimizer"):
        train(model, optimizer, 3, "cpu")
    stats = optimizer.memory_stats()
    # allocated + free - (peak - held) - headroom, by hand
    assert stats["device_budget_bytes"] == budget
    assert stats["auto_budget"]["measured"] == dict(at_step=WARMUP + 1, free_bytes=budget + 10_000_000,
                                                    peak_bytes=12_004_096, allocated_bytes=2_000_000 + HEADROOM,
                                                    held_bytes=4096, budget_bytes=budget)
    assert stats["resident_share"] > before and stats["plan"]["resident_params"] in ([0, 3, 4], [0, 3])
    logged = [r for r in caplog.records if "device_budget_bytes='auto'" in r.getMessage()]
    assert len(logged) == 1 and f"is {budget} bytes after {WARMUP} warm-up steps" in logged[0].getMessage()
    # bitwise a run planned for that budget from the start (the same split), and one with no budget
    for fields in (dict(device_budget_bytes=budget), {}):
        twin_model = build("cpu")
        twin = so.SwapOptimizer(adamw(twin_model.parameters()), swap_times=SWAP_TIMES, num_arenas=2,
                                cost_model=SLOW_LINK, **fields)
        train(twin_model, twin, WARMUP, "cpu")  # the same batches, in the same calls
        train(twin_model, twin, 3, "cpu")
        assert_bitwise(snapshot(optimizer, model), snapshot(twin, twin_model))


@pytest.mark.parametrize("mode", [dict(state_dtype=torch.uint8), dict(master_weights=True, dtype=torch.bfloat16)],
                         ids=["8-bit", "bf16-masters"])
def test_compact_states_move_byte_for_byte(mode):
    mode = dict(mode)
    dtype = mode.pop("dtype", torch.float32)
    base, host = unbudgeted_device_bytes("cpu", dtype, **mode)
    budget = base + int(0.4 * host)
    model, twin_model = build("cpu", dtype), build("cpu", dtype)
    optimizer = auto_optimizer(model, **mode)
    optimizer._auto.simulated = simulated(budget)
    twin = so.SwapOptimizer(adamw(twin_model.parameters()), swap_times=SWAP_TIMES, num_arenas=2, **mode)
    train(model, optimizer, WARMUP + 2, "cpu")
    train(twin_model, twin, WARMUP + 2, "cpu")
    assert optimizer.memory_stats()["plan"]["resident_params"]
    assert_bitwise(snapshot(optimizer, model), snapshot(twin, twin_model))


def test_the_old_store_is_let_go_before_the_new_one_is_made(monkeypatch):
    model = build("cpu")
    optimizer = auto_optimizer(model)
    optimizer._auto.simulated = simulated(middle_budget())
    train(model, optimizer, WARMUP, "cpu")
    old = weakref.ref(optimizer._runtime)
    made = []
    original = so._C.SwapRuntime

    def checked(*args, **kwargs):
        made.append(old() is None)
        return original(*args, **kwargs)

    monkeypatch.setattr(so._C, "SwapRuntime", checked)
    train(model, optimizer, 1, "cpu")
    assert made == [True]


def warmed_up_with_a_twin():
    """An "auto" optimizer whose next step moves its store, and an unbudgeted
    twin at the same point."""
    model, twin_model = build("cpu"), build("cpu")
    optimizer = auto_optimizer(model)
    optimizer._auto.simulated = simulated(middle_budget())
    twin = so.SwapOptimizer(adamw(twin_model.parameters()), swap_times=SWAP_TIMES, num_arenas=2)
    train(model, optimizer, WARMUP, "cpu")
    train(twin_model, twin, WARMUP, "cpu")
    return (model, optimizer), (twin_model, twin)


def test_a_failure_while_moving_loses_nothing(monkeypatch):
    (model, optimizer), (twin_model, twin) = warmed_up_with_a_twin()
    original, calls = so._C.SwapRuntime, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: no room for the new store")
        return original(*args, **kwargs)

    monkeypatch.setattr(so._C, "SwapRuntime", fails_once)
    with pytest.raises(RuntimeError, match="injected: no room for the new store"):
        train(model, optimizer, 1, "cpu")
    monkeypatch.setattr(so._C, "SwapRuntime", original)
    # nothing stepped, nothing lost: the old plan with the same bytes, and training goes on bitwise
    assert optimizer.memory_stats()["device_budget_bytes"] is None and len(calls) == 2
    assert_bitwise(snapshot(optimizer, model), snapshot(twin, twin_model))
    train(model, optimizer, 2, "cpu")
    train(twin_model, twin, 2, "cpu")
    assert_bitwise(snapshot(optimizer, model), snapshot(twin, twin_model))


def test_a_rebuild_replans_with_the_derived_budget():
    budget = middle_budget()
    model = build("cpu")
    optimizer = auto_optimizer(model)
    optimizer._auto.simulated = simulated(budget)
    train(model, optimizer, WARMUP + 1, "cpu")
    extra = torch.nn.Parameter(torch.randn(64, 64))
    optimizer.add_param_group({"params": [extra]})
    stats = optimizer.memory_stats()
    assert stats["device_budget_bytes"] == budget and stats["plan"]["device_bytes"]["total"] <= budget
    optimizer.load_state_dict(optimizer.state_dict())
    assert optimizer.memory_stats()["device_budget_bytes"] == budget


def test_other_optimizers_move_to_the_derived_plan_bitwise():
    make = lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.9)  # noqa: E731
    probe = so.SwapOptimizer(make(build("cpu").parameters()), swap_times=SWAP_TIMES, num_arenas=2)
    budget = probe.plan_report()["chosen"]["device_bytes"] + probe.memory_stats()["host_state_bytes"] // 2
    model, twin_model = build("cpu"), build("cpu")
    optimizer = so.SwapOptimizer(make(model.parameters()), device_budget_bytes="auto", auto_warmup_steps=WARMUP,
                                 auto_headroom_bytes=HEADROOM, swap_times=SWAP_TIMES, num_arenas=2,
                                 cost_model=SLOW_LINK)
    optimizer._auto.simulated = simulated(budget)
    plain = make(twin_model.parameters())
    train(model, optimizer, WARMUP + 3, "cpu", (twin_model, plain))
    assert optimizer.memory_stats()["device_budget_bytes"] == budget
    assert 0 < optimizer.memory_stats()["resident_share"] < 1
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(torch.as_tensor(optimizer.state[p][k]), torch.as_tensor(v))
                   for k, v in plain.state[q].items())


def test_without_a_device_to_measure_the_plan_stays_and_says_so():
    model = build("cpu")
    optimizer = auto_optimizer(model)
    train(model, optimizer, WARMUP, "cpu")
    with pytest.warns(RuntimeWarning, match="has no device memory to measure on the CPU; the plan stays"):
        train(model, optimizer, 1, "cpu")
    small_model = build("cpu")
    tiny = auto_optimizer(small_model)
    tiny._auto.simulated = simulated(100)
    train(small_model, tiny, WARMUP, "cpu")
    with pytest.warns(RuntimeWarning, match="derived 100 bytes, in which no plan fits"):
        train(small_model, tiny, 1, "cpu")
    assert tiny.memory_stats()["device_budget_bytes"] is None


def test_auto_settings_are_checked():
    with pytest.raises(ValueError, match="device_budget_bytes must be None, an int >= 1 or 'auto'"):
        so.SwapOptimizer(adamw(build("cpu").parameters()), device_budget_bytes="max")
    with pytest.raises(ValueError, match="auto_warmup_steps must be an int >= 1"):
        so.SwapOptimizer(adamw(build("cpu").parameters()), device_budget_bytes="auto", auto_warmup_steps=0)


def test_with_overlap_the_move_comes_before_the_step_is_deferred():
    """overlap_forward=True: the step that moves the store runs whole (a new
    store is probed again by the next forward), and training stays bitwise
    that without overlap."""
    budget = middle_budget()
    runs = []
    for overlap in (False, True):
        model = build("cpu")
        optimizer = auto_optimizer(model, **(dict(overlap_forward=True, model=model) if overlap else {}))
        optimizer._auto.simulated = simulated(budget)
        train(model, optimizer, WARMUP + 3, "cpu")
        optimizer.wait()
        assert optimizer.memory_stats()["device_budget_bytes"] == budget
        runs.append(snapshot(optimizer, model))
    assert_bitwise(*runs)


def test_an_interrupt_during_the_move_waits_until_the_store_is_whole(monkeypatch):
    """A Ctrl-C landing while the states are copied into the new store is
    raised once they all are: nothing is left half moved."""
    import signal
    (model, optimizer), (twin_model, twin) = warmed_up_with_a_twin()
    rule = type(optimizer._rule)
    original = rule.restore_bookkeeping

    def interrupted(self, opt, kept):
        signal.raise_signal(signal.SIGINT)  # as a Ctrl-C would, between two bytecodes of the move
        original(self, opt, kept)

    monkeypatch.setattr(rule, "restore_bookkeeping", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(model, optimizer, 1, "cpu")
    monkeypatch.setattr(rule, "restore_bookkeeping", original)
    # the move finished, the step did not begin: the states are the twin's, in the new plan
    assert optimizer.memory_stats()["device_budget_bytes"] == middle_budget()
    assert len(optimizer.state_dict()["state"]) == len(list(model.parameters()))
    assert_bitwise(snapshot(optimizer, model), snapshot(twin, twin_model))
    train(model, optimizer, 2, "cpu")
    train(twin_model, twin, 2, "cpu")
    assert_bitwise(snapshot(optimizer, model), snapshot(twin, twin_model))


def test_measuring_the_device_leaves_the_users_random_stream_alone():
    from swap_optimizer import budget
    budget._measured_update.cache_clear()
    budget._measured_link.cache_clear()
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    so.StepCostModel.for_device("cpu")
    assert torch.equal(torch.rand(4), expected)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(128, 256), nn.Linear(256, 128)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(h)))


class Blocks(nn.Module):
    """The head is defined first and read last; the embedding read first is
    defined after the blocks: param order is not the forward's order."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(128, 128)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.embed = nn.Linear(64, 128)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Routed(Blocks):
    """Calls `extra` in every other forward (as a router might): the call
    indices the probes see change from step to step."""

    def __init__(self):
        super().__init__()
        self.extra, self.forwards = nn.Linear(64, 64), 0

    def forward(self, x):
        self.forwards += 1
        return super().forward(self.extra(x) if self.forwards % 2 else x)


def run_blocks(cls, make, overlap, budget=None, steps=6, moves=None, **settings):
    """Trains `cls` on fresh random batches; `moves` collects the steps at
    which the store moved; returns the model, the optimizer and, per step,
    whether it was deferred into the next forward."""
    torch.manual_seed(0)
    model = cls()
    fields = dict(overlap_forward=True, model=model) if overlap else {}
    optimizer = so.SwapOptimizer(make(model.parameters()), swap_times=4, num_arenas=2, cost_model=SLOW_LINK,
                                 **({} if budget is None else dict(device_budget_bytes=budget)), **fields, **settings)
    if moves is not None:
        move = optimizer._move_to_budget_choice
        optimizer._move_to_budget_choice = lambda undo: (moves.append(step), move(undo))
    deferred = []
    for step in range(steps):
        rng = np.random.default_rng([9, step])
        x = torch.from_numpy(rng.standard_normal((8, 64), dtype=np.float32))
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()
        deferred.append(overlap and optimizer._overlap._last_step_deferred)
    optimizer.wait()
    return model, optimizer, deferred


def a_quarter_resident_budget(cls, make, **settings):
    _, probe, _ = run_blocks(cls, make, False, steps=1, **settings)
    return probe.plan_report()["chosen"]["device_bytes"] + probe.memory_stats()["host_state_bytes"] // 4


SGD = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731  (the rule path)


# (AdamW under the packed kernel: its budget has no first-step states to make
# room for, so a quarter of the state keeps the embedding out in param order)
@pytest.mark.parametrize("make, settings", [(adamw, PACKED_KERNEL), (SGD, {})], ids=["adamw-packed", "sgd"])
def test_with_overlap_the_residents_follow_the_forward_and_each_block_has_its_own(make, settings):
    """A budget with overlap_forward: once a forward was probed, the store is
    laid out again, once, at a step boundary, keeping resident the params the
    forward reads first, each block's in a resident batch of its own (block 0
    does not wait for the others' updates); later steps are deferred into the
    forward as before; bitwise the same loop without overlap."""
    budget = a_quarter_resident_budget(Blocks, make, **settings)
    plain_model, plain, _ = run_blocks(Blocks, make, False, budget, **settings)
    moves = []
    model, optimizer, deferred = run_blocks(Blocks, make, True, budget, moves=moves, **settings)
    assert_bitwise(snapshot(optimizer, model), snapshot(plain, plain_model))
    assert len(moves) == 1 and all(deferred[moves[0] + 1:])  # the moving step probes the new store
    names = [name for name, _ in model.named_parameters()]
    resident = {names[i] for i in optimizer.memory_stats()["plan"]["resident_params"]}
    by_param_order = {names[i] for i in plain.memory_stats()["plan"]["resident_params"]}
    # the forward's first reads get the room first; in param order the embedding, read first, is last
    assert {"embed.weight", "blocks.0.up.weight"} <= resident and "embed.weight" not in by_param_order
    # a resident batch per block (or module outside the blocks), the embedding's (read first) first
    resident_batches = [[names[i] for i in b["params"]] for b in optimizer._batch_layout() if b["resident"]]
    owners = [{name.rsplit(".", 2)[0] if name.startswith("blocks.") else name.split(".")[0] for name in batch}
              for batch in resident_batches]
    assert all(len(owner) == 1 for owner in owners) and owners[0] == {"embed"} and {"blocks.0"} in owners
    assert len(resident_batches) >= 3


def test_a_forward_whose_calls_vary_moves_the_store_once():
    """A forward whose call indices change from step to step (probed again
    each time) lays the residents out once per set of params, not every step."""
    budget = a_quarter_resident_budget(Routed, adamw)
    plain_model, plain, _ = run_blocks(Routed, adamw, False, budget)
    moves = []
    model, optimizer, _ = run_blocks(Routed, adamw, True, budget, moves=moves)
    assert len(moves) == 1
    assert_bitwise(snapshot(optimizer, model), snapshot(plain, plain_model))


def test_a_failed_resident_layout_warns_and_keeps_param_order(monkeypatch):
    """A failure while the residents move to the forward's order lays the
    param-order store out again, warns, and is not retried; nothing is lost."""
    budget = a_quarter_resident_budget(Blocks, adamw)
    plain_model, plain, _ = run_blocks(Blocks, adamw, False, budget)
    original, made = so._C.SwapRuntime, []

    def fails_on_grouped_residents(*args, **kwargs):
        made.append(bool(kwargs.get("resident_groups")))
        if made[-1]:
            raise RuntimeError("injected: no room for the grouped store")
        return original(*args, **kwargs)

    monkeypatch.setattr(so._C, "SwapRuntime", fails_on_grouped_residents)
    with pytest.warns(RuntimeWarning, match="stay in param order"):
        model, optimizer, deferred = run_blocks(Blocks, adamw, True, budget)
    assert made.count(True) == 1 and all(deferred[2:])
    assert optimizer.memory_stats()["plan"]["resident_params"] == plain.memory_stats()["plan"]["resident_params"]
    assert_bitwise(snapshot(optimizer, model), snapshot(plain, plain_model))


def test_auto_with_overlap_moves_once_into_the_forwards_order():
    """"auto" with overlap_forward: the warm-up's probe ranks the params, and
    the one move to the derived budget's plan takes that order along (not a
    second move)."""
    torch.manual_seed(0)
    model, moves = Blocks(), []
    optimizer = so.SwapOptimizer(adamw(model.parameters()), swap_times=4, num_arenas=2, cost_model=SLOW_LINK,
                                 device_budget_bytes="auto", auto_warmup_steps=WARMUP, auto_headroom_bytes=HEADROOM,
                                 overlap_forward=True, model=model)
    optimizer._auto.simulated = simulated(a_quarter_resident_budget(Blocks, adamw))
    move = optimizer._move_to_budget_choice
    optimizer._move_to_budget_choice = lambda undo: (moves.append(step), move(undo))
    for step in range(WARMUP + 3):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
    optimizer.wait()
    names = [name for name, _ in model.named_parameters()]
    assert moves == [WARMUP] and optimizer.memory_stats()["device_budget_bytes"] is not None
    assert "embed.weight" in {names[i] for i in optimizer.memory_stats()["plan"]["resident_params"]}


def test_a_layout_the_model_no_longer_allows_leaves_the_store_whole():
    """A check any layout makes (here: a param the model no longer holds)
    fails before the old store is let go: a warning, and every state kept."""
    budget = a_quarter_resident_budget(Blocks, adamw)
    torch.manual_seed(0)
    model = Blocks()
    optimizer = so.SwapOptimizer(adamw(model.parameters()), swap_times=4, num_arenas=2, cost_model=SLOW_LINK,
                                 device_budget_bytes=budget, overlap_forward=True, model=model)
    model.head = nn.Linear(128, 128)  # surgery after the optimizer was made
    with pytest.warns(RuntimeWarning, match="stay in param order"):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            model(torch.randn(8, 64)).square().mean().backward()
            optimizer.step()
    optimizer.wait()
    in_the_model = {id(p) for p in model.parameters()}
    trained = [p for p in optimizer.param_groups[0]["params"] if id(p) in in_the_model]
    assert len(trained) == 14 and len(optimizer.state_dict()["state"]) >= 14  # all but the old head
    assert all(optimizer.state[p]["step"].item() == 3 for p in trained)


class SharingBlock(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.up, self.shared = nn.Linear(128, 128), shared

    def forward(self, h):
        return h + self.up(torch.relu(self.shared(h)))


class SharedInBlocks(nn.Module):
    """Every block calls one shared module (cross-layer sharing)."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(128, 128)
        self.embed = nn.Linear(64, 128)
        self.blocks = nn.ModuleList(SharingBlock(shared) for _ in range(4))
        self.head = nn.Linear(128, 8)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_module_shared_between_blocks_does_not_tie_them_together():
    torch.manual_seed(0)
    model = SharedInBlocks()
    names = [name for name, _ in model.named_parameters()]
    optimizer = so.SwapOptimizer(adamw(model.parameters()), swap_times=4, num_arenas=2, cost_model=SLOW_LINK,
                                 device_budget_bytes=10**8, overlap_forward=True, model=model)
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
    optimizer.wait()
    resident_batches = [{names[i] for i in b["params"]} for b in optimizer._batch_layout() if b["resident"]]
    for k in range(1, 4):  # each later block's own params form a resident batch of their own
        assert {f"blocks.{k}.up.weight", f"blocks.{k}.up.bias"} in resident_batches
