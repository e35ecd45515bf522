"""overlap_forward=True with optimizers other than Adam/AdamW: torch's own
update (a Python rule; on the host backend the update thread runs it under the
GIL while the main thread runs the next forward) is bitwise the run without
overlap, over the same loops as tests/overlap/test_overlap.py, with random copy and
compute delays so that a missed wait would change bits."""

import pytest
import torch

import swap_optimizer as so
from conftest import DEVICES
from test_overlap import assert_bitwise, build, loss_of, snapshot, tokens_for, train
from optimizer_cases import Lion

OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "SGD-foreach-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=True),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=3e-3, weight_decay=0.01),
    "Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
}


def make(model, name, overlap, **fields):
    extra = dict(model=model, overlap_forward=True) if overlap else {}
    optimizer = so.SwapOptimizer(OPTIMIZERS[name](model.parameters()), swap_times=6, num_arenas=3, min_numel=0,
                                 **fields, **extra)
    if overlap:
        optimizer._set_test_hooks(copy_delay_us=300, compute_delay_us=300, seed=5)
    return optimizer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("feature", ["plain", "scheduler", "clip", "accumulation", "read_after_wait"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_overlap_trains_bitwise_like_without(name, feature, device):
    device = torch.device(device)
    runs = []
    for overlap in (False, True):
        model = build(device)
        optimizer = make(model, name, overlap)
        logged = train(model, optimizer, 5, device, feature)
        if overlap:  # the steps after the probe ran beside the next forward
            assert optimizer._overlap.schedule is not None and optimizer._overlap._last_step_deferred
        runs.append((logged, snapshot(model, optimizer)))
    (logged_off, snap_off), (logged_on, snap_on) = runs
    assert len(logged_off) == len(logged_on)
    for a, b in zip(logged_off, logged_on):
        assert torch.equal(a, b), f"{name} {feature}: logged values differ"
    assert_bitwise(snap_off, snap_on)


def test_the_waits_are_what_keeps_it_right():
    """The check above can fail: with the waits switched off, the overlapped
    SGD run differs from the plain one."""
    device = torch.device("cpu")
    model, plain_model = build(device), build(device)
    optimizer = make(model, "SGD", True)
    optimizer._set_test_hooks(copy_delay_us=4000, compute_delay_us=300, seed=5)
    plain = make(plain_model, "SGD", False)
    optimizer._overlap.set_test_hooks(knocked_out=range(len(list(model.parameters()))), unguarded={"ops"})
    logged = train(model, optimizer, 5, device, "plain")
    logged_plain = train(plain_model, plain, 5, device, "plain")
    optimizer.wait()
    assert any(not torch.equal(a, b) for a, b in zip(logged, logged_plain))


@pytest.mark.parametrize("feature", ["plain", "scheduler", "clip", "accumulation", "read_after_wait"])
def test_a_vouched_for_optimizer_is_deferred_once_learned(feature):
    """A vouched-for optimizer (trust_per_param_step, params cut) runs its
    first step whole inside step() (its states learned, its contract
    probed); every later one runs beside the next forward: bitwise the run
    without overlap."""
    device = torch.device("cpu")
    runs = []
    for overlap in (False, True):
        model = build(device)
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        optimizer = so.SwapOptimizer(Lion(model.parameters()), trust_per_param_step=True,
                                     trust_elementwise_step=True, swap_times=6, num_arenas=3, min_numel=0, **extra)
        if overlap:
            optimizer._set_test_hooks(copy_delay_us=300, compute_delay_us=300, seed=5)
        logged = train(model, optimizer, 5, device, feature)
        if overlap:
            assert optimizer._overlap._last_step_deferred
        runs.append((logged, snapshot(model, optimizer)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert_bitwise(runs[0][1], runs[1][1])


class GroupCounter(Lion):
    """Lion that counts its steps in its param group at every step, as timm's Adan does."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
        return super().step(closure)


class NotesEveryThirdStep(Lion):
    """Lion that writes its param group only at every third update of its
    params (from a count kept per param): a step the overlap deferred,
    having seen no write at the step before, writes its group after all."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["updates"] = state.get("updates", 0) + 1
                    if state["updates"] % 3 == 0:
                        group["noted_at"] = state["updates"]
        return super().step(closure)


@pytest.mark.parametrize("name, deferred", [
    ("GroupCounter", [False] * 7),  # each step writes its group: each runs inside step()
    # the third and sixth write theirs: landed at the wait, the step after them runs inside step()
    ("NotesEveryThirdStep", [False, True, True, False, True, True, False]),
])
def test_a_vouched_for_step_that_writes_its_groups(name, deferred):
    """A vouched-for step that wrote its param groups is followed by one
    that runs inside step(); a deferred step that writes them has its
    writes land when it is waited for (here: the next step()), unless the
    value was changed since step() (the user's later write, kept as the
    plain optimizer's order keeps it). Params, states and the groups after
    each wait bitwise the run without overlap."""
    make = {"GroupCounter": GroupCounter, "NotesEveryThirdStep": NotesEveryThirdStep}[name]
    device = torch.device("cpu")
    runs = []
    for overlap in (False, True):
        model = build(device)
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        optimizer = so.SwapOptimizer(make(model.parameters()), trust_per_param_step=True, trust_elementwise_step=True,
                                     swap_times=6, num_arenas=3, min_numel=0, **extra)
        if overlap:
            optimizer._set_test_hooks(copy_delay_us=300, compute_delay_us=300, seed=5)
        seen, groups = [], []
        for step in range(len(deferred)):
            optimizer.zero_grad()
            loss_of(model, tokens_for(step, device)).backward()
            optimizer.step()
            if overlap:
                seen.append(optimizer._overlap._last_step_deferred)
            if step == 5:  # written by the user after the sixth step(), which writes it too
                optimizer.param_groups[0]["noted_at"] = -1
            optimizer.wait()
            groups.append({k: v for k, v in optimizer.param_groups[0].items() if k != "params"})
        if overlap:
            assert seen == deferred
        runs.append((snapshot(model, optimizer), {k: v for k, v in optimizer.param_groups[0].items() if k != "params"},
                     groups))
    assert_bitwise(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]
    assert runs[1][1]["step" if name == "GroupCounter" else "noted_at"] == (7 if name == "GroupCounter" else -1)
    assert runs[0][2] == runs[1][2]  # the groups after each step's wait


def test_muon_beside_adamw_both_overlapped():
    """Muon for the hidden matrices and AdamW for the rest, two SwapOptimizers
    overlapping the same model's forward: bitwise the loop without overlap.
    Without overlap each step releases its arenas before the next one runs
    (peak staging: the larger of the two); with it both steps hold theirs
    until the forward has waited for them (peak: the sum)."""
    def run(overlap):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                    torch.nn.GELU(), torch.nn.LayerNorm(256), torch.nn.Linear(256, 8))
        hidden = [model[0].weight, model[2].weight]
        rest = [p for p in model.parameters() if all(p is not q for q in hidden)]
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        optimizers = [so.SwapOptimizer(torch.optim.Muon(hidden, lr=0.02), swap_times=2, min_numel=0, **extra),
                      so.SwapOptimizer(torch.optim.AdamW(rest, lr=1e-3), swap_times=2, min_numel=0, **extra)]
        if overlap:
            for optimizer in optimizers:
                optimizer._set_test_hooks(copy_delay_us=300, compute_delay_us=300, seed=3)
        losses, held = [], []
        for step in range(6):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
            for optimizer in optimizers:
                optimizer.step()
            held.append([optimizer.memory_stats()["staging_bytes"] for optimizer in optimizers])
        for optimizer in optimizers:
            optimizer.wait()
        return losses, [p.detach().clone() for p in model.parameters()], held

    losses_off, params_off, held_off = run(False)
    losses_on, params_on, held_on = run(True)
    assert all(torch.equal(a, b) for a, b in zip(losses_off, losses_on))
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_on))
    assert all(held == [0, 0] for held in held_off)
    assert all(muon > 0 and adamw > 0 for muon, adamw in held_on[1:])  # after the probe step: both at once
