"""overlap_forward=True: step() enqueues the step, and the next forward's blocks
wait for their own params. Training with it must be bitwise the training
without it, whatever the loop does around the step.

On the host backend the updates run on an update thread while the main thread
runs the forward; random delays on every copy make the updates lag, so a
missed wait reads a param before its update and changes bits (checked: with
the waits switched off these tests fail). Comparisons are torch.equal (bitwise)
against the same loop with overlap_forward=False. The first step after the
optimizer is made runs whole (the probe); the ones after it overlap.
tests/overlap/test_overlap_models.py has the model code the hooks were not written for.
"""


import gc
import os
import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import swap_optimizer as so
from conftest import PACKED_KERNEL, DEVICES, requires_cuda
from swap_optimizer.overlap import find_blocks
from swap_training import round_trip

VOCAB, WIDTH = 64, 32


class OverlapLM(nn.Module):
    """Embedding, an nn.TransformerEncoder (MultiheadAttention reads its
    out_proj.weight directly), a final norm and a head tied to the embedding."""

    def __init__(self, layers=3, tied=True, activation_checkpointing=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, dim_feedforward=64, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.activation_checkpointing = activation_checkpointing

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.activation_checkpointing:  # the backward runs each layer's forward (and its hooks) again
            for layer in self.encoder.layers:
                x = checkpoint(layer, x, use_reentrant=False)
        else:
            x = self.encoder(x)
        return self.head(self.norm(x))


def build(device, **kwargs):
    torch.manual_seed(0)
    return OverlapLM(**kwargs).to(device)


def tokens_for(step, device, micro=0):
    generator = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (4, 12), generator=generator).to(device)


def loss_of(model, tokens):
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), torch.roll(tokens, -1, 1).reshape(-1))


def make_optimizer(model, overlap, device, compiled=None, delay_us=300, **fields):
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    extra = dict(model=model if compiled is None else compiled, overlap_forward=True) if overlap else {}
    optimizer = so.SwapOptimizer(inner, swap_times=6, num_arenas=3, min_numel=0, **fields, **extra)
    if overlap:
        optimizer._set_test_hooks(copy_delay_us=delay_us, compute_delay_us=300, seed=5)  # updates lag behind the forward
    return optimizer


def train(model, optimizer, steps, device, feature, forward=None):
    """A training loop exercising `feature`; returns what it logged (losses,
    eval losses, weight norms), compared bitwise between runs."""
    forward = model if forward is None else forward
    logged = []
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if feature == "scheduler" \
        else None
    # grad_scaler_in_step: the deferred step unscales with the grad_scale
    # tensor GradScaler hands it, while scaler.update() doubles the scale
    # (growth_interval=1) right after step() returns.
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10, growth_interval=1) \
        if feature in ("grad_scaler", "grad_scaler_in_step") else None
    for step in range(steps):
        if feature == "closure":  # Lightning's loop: forward and backward inside step()
            def closure():
                optimizer.zero_grad()
                loss = loss_of(forward, tokens_for(step, device))
                loss.backward()
                return loss
            logged.append(optimizer.step(closure).detach())
            continue
        optimizer.zero_grad(set_to_none=feature != "zero_grad_to_zeros")
        micro_batches = 2 if feature == "accumulation" else 1
        for micro in range(micro_batches):
            loss = loss_of(forward, tokens_for(step, device, micro)) / micro_batches
            (scaler.scale(loss) if scaler else loss).backward()
            logged.append(loss.detach())
        if feature in ("clip", "grad_scaler"):
            if scaler:
                scaler.unscale_(optimizer)
            logged.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).detach())
        if scaler:
            scaler.step(optimizer)
            scaler.update()
            logged.append(scaler.get_scale() * torch.ones(()))
        else:
            optimizer.step()
        if scheduler:
            scheduler.step()
        if feature == "read_after_wait":  # a weight read outside the forward
            optimizer.wait()
            logged.append(model.encoder.layers[1].linear1.weight.norm().detach())
        if feature == "inference_eval":
            model.eval()
            # The probe's watch (a TorchFunctionMode) turns off torch's fused
            # eval fast path of TransformerEncoderLayer during the first forward
            # after a new store, whose last bits differ from the slow path's: the
            # optimizer's results do not (docs/usage.md); compared on one path.
            fast_path = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
            with torch.inference_mode():
                logged.append(loss_of(forward, tokens_for(10_000 + step, device)))
            torch.backends.mha.set_fastpath_enabled(fast_path)
            model.train()
    return [t.detach().float().cpu().clone() for t in logged]


def snapshot(model, optimizer):
    params = {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}  # waits (a model hook)
    state = round_trip(optimizer.state_dict())["state"]
    return params, state


def assert_bitwise(first, second):
    (params_a, state_a), (params_b, state_b) = first, second
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), f"param {name} differs"
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for key in state_a[index]:
            assert torch.equal(torch.as_tensor(state_a[index][key]), torch.as_tensor(state_b[index][key])), \
                f"state {index}/{key} differs"


FEATURES = ["plain", "scheduler", "grad_scaler", "grad_scaler_in_step", "clip", "accumulation", "zero_grad_to_zeros",
            "read_after_wait", "inference_eval", "closure", "checkpointing", "untied"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("feature", FEATURES)
# (the hooks and the read watch: every feature in the slow tier; the README's tier checks that watch
# in test_the_global_hooks_are_on_only_while_a_pass_needs_them and every mutation case)
@pytest.mark.parametrize("watch", ["armed", pytest.param("mode", marks=pytest.mark.slow)])
def test_overlap_trains_bitwise_like_without(feature, device, watch, overlap_may_arm):
    """Each feature's loop, bitwise with overlap off, under either watch: the
    params and grads watching themselves (armed, where a pass may) or the
    global hooks and the read watch (mode)."""
    device = torch.device(device)
    runs = []
    # (the encoder's eval fast path, on, keeps passes unarmed: its slow path's last bits differ)
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(watch == "mode")
    try:
        for overlap in (False, True):
            runs.append(train_and_snapshot(device, feature, watch, overlap))
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
    (logged_off, snap_off), (logged_on, snap_on) = runs
    assert len(logged_off) == len(logged_on)
    for a, b in zip(logged_off, logged_on):
        assert torch.equal(a, b), f"{feature}: logged values differ: {a} vs {b}"
    assert_bitwise(snap_off, snap_on)


def train_and_snapshot(device, feature, watch, overlap):
    """One run of test_overlap_trains_bitwise_like_without: what it logged
    and its snapshot. Under the armed watch every overlapped pass arms."""
    from unittest import mock

    from swap_optimizer.overlap.armed import ArmedPass

    model = build(device, tied=feature != "untied", activation_checkpointing=feature == "checkpointing")
    # The step reads the scaler's tensors.
    # (unscale_in_step with AdamW: the packed kernel's fp32 states, or torch's fused=True)
    fields = dict(unscale_in_step=True, **PACKED_KERNEL) if feature.startswith("grad_scaler") else {}
    optimizer = make_optimizer(model, overlap, device, **fields)
    if overlap:
        optimizer._overlap.set_test_hooks(mode_watch=watch == "mode")
    with mock.patch.object(ArmedPass, "arm", autospec=True, side_effect=ArmedPass.arm) as arm:
        logged = train(model, optimizer, 5, device, feature)
    if overlap:  # (the steps after the probe's)
        assert arm.call_count == (4 if watch == "armed" else 0), (watch, arm.call_count)
    return logged, snapshot(model, optimizer)


@pytest.mark.parametrize("device", DEVICES)
def test_the_waits_are_what_keeps_it_right(device):
    """The check above can fail: with every wait of the forward and of ops
    outside it switched off, the same overlapped loop differs from the plain
    one (longer copy delays: the reads then certainly come first)."""
    device = torch.device(device)
    model, plain_model = build(device), build(device)
    optimizer = make_optimizer(model, True, device, delay_us=4000)
    plain = make_optimizer(plain_model, False, device)
    optimizer._overlap.set_test_hooks(knocked_out=range(len(list(model.parameters()))), unguarded={"ops"})
    logged = train(model, optimizer, 5, device, "plain")
    logged_plain = train(plain_model, plain, 5, device, "plain")
    optimizer.wait()
    assert any(not torch.equal(a, b) for a, b in zip(logged, logged_plain))


def overlap_hooks_on():
    """Whether overlap's global module hooks (pre and always-called post) are installed."""
    from torch.nn.modules import module

    from swap_optimizer.overlap.hooks import _after_call, _before_call
    return (any(hook is _before_call for hook in module._global_forward_pre_hooks.values()),
            any(hook is _after_call for hook in module._global_forward_hooks.values()))


@pytest.mark.parametrize("armed", [True, False])
def test_the_global_hooks_are_on_only_while_a_pass_needs_them(armed, overlap_may_arm):
    """Any global module hook sends every nn.Module call in the process down
    torch's slow path, so overlap's are on only while a pass needs them (the
    probe after the first step, a pending step whose params do not watch
    themselves) and off once the step is waited for or the pass has ended:
    an idle forward, of this model or any other, calls none. A pass whose
    params and grads watch themselves (armed) needs none while pending: its
    params are PendingParameters until read. The loop stays bitwise the one
    without overlap."""
    from swap_optimizer.overlap.armed import PendingParameter

    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # (the encoder's eval fast path on keeps passes unarmed)
    try:
        hooks_on_only_while_needed(armed, PendingParameter)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)


def hooks_on_only_while_needed(armed, PendingParameter):
    device = torch.device("cpu")
    model, plain_model = build(device), build(device)
    optimizer = make_optimizer(model, True, device)
    optimizer._overlap.set_test_hooks(mode_watch=not armed)
    plain = make_optimizer(plain_model, False, device)
    pending_hooks = (not armed, not armed)
    assert overlap_hooks_on() == (False, False)  # made, nothing to watch yet
    logged = train(model, optimizer, 1, device, "plain")
    assert optimizer._overlap.probing and overlap_hooks_on() == (True, True)
    logged += train(model, optimizer, 1, device, "plain")
    assert optimizer._overlap.pending and overlap_hooks_on() == pending_hooks
    assert all(isinstance(p, PendingParameter) == armed for p in model.parameters())
    optimizer.wait()
    assert overlap_hooks_on() == (False, False)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    with torch.no_grad():  # an idle forward: nothing pending
        logged.append(loss_of(model, tokens_for(500, device)))
    assert overlap_hooks_on() == (False, False)
    logged += train(model, optimizer, 2, device, "plain")  # pending again: the next forward waits
    assert optimizer._overlap.pending and overlap_hooks_on() == pending_hooks
    with torch.no_grad():  # its last block waits for the last batch: the pass ends, and the hooks go
        logged.append(loss_of(model, tokens_for(501, device)))
        logged.append(loss_of(model, tokens_for(502, device)))
    assert not optimizer._overlap.pending and overlap_hooks_on() == (False, False)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    logged_plain = train(plain_model, plain, 1, device, "plain") + train(plain_model, plain, 1, device, "plain")
    with torch.no_grad():
        logged_plain.append(loss_of(plain_model, tokens_for(500, device)))
    logged_plain += train(plain_model, plain, 2, device, "plain")
    with torch.no_grad():
        logged_plain.append(loss_of(plain_model, tokens_for(501, device)))
        logged_plain.append(loss_of(plain_model, tokens_for(502, device)))
    assert all(torch.equal(a, b) for a, b in zip(logged, logged_plain, strict=True))
    assert_bitwise(snapshot(model, optimizer), snapshot(plain_model, plain))


@pytest.mark.parametrize("keep_watching", [False, True])
def test_a_pass_whose_step_is_done_ends_at_its_next_check(keep_watching):
    """Once every batch of the pending step is updated (a check that does not
    wait: the runtime's deferred_step_updated), the pass ends at the stepping
    thread's next module call or op, its watch and hooks with it, so the rest
    of a forward, of this model or any other, runs without them; while the
    step is in flight it goes on. keep_watching (the benchmark's control)
    keeps it to its last wait, which another model's ops never reach."""
    device = torch.device("cpu")
    model, other = build(device), build(device)
    optimizer = make_optimizer(model, True, device)
    optimizer._overlap.set_test_hooks(keep_watching=keep_watching, mode_watch=True)  # (armed: the next test)
    train(model, optimizer, 2, device, "plain")  # the probe's step, then a pending one
    optimizer.wait()
    optimizer._set_test_hooks(compute_delay_us=200_000, seed=3)  # about 0.6 s of updates in all
    train(model, optimizer, 1, device, "plain")
    assert optimizer._overlap.pending and not optimizer._runtime.deferred_step_updated()
    optimizer._runtime.synchronize()  # every batch updated; the pass is still on
    assert optimizer._overlap.pending and optimizer._runtime.deferred_step_updated()
    with torch.no_grad():
        loss_of(other, tokens_for(0, device))
    assert optimizer._overlap.pending == keep_watching
    assert overlap_hooks_on() == (keep_watching, keep_watching)
    optimizer.wait()
    assert not optimizer._overlap.pending and optimizer._runtime.deferred_step_updated()


def test_a_pass_retires_at_its_first_call_or_at_a_later_wait(monkeypatch):
    """The other two checks of a done step: at a pass's first call, before
    the structure walk (a forward that starts after the step is done walks
    nothing and waits for nothing more); and at a call that needs a new
    position, when the step finished during the forward (the rest of the
    forward runs without the watch)."""
    import swap_optimizer.overlap.waits as overlap_module

    device = torch.device("cpu")
    model = build(device)
    optimizer = make_optimizer(model, True, device)
    overlap = optimizer._overlap
    overlap.set_test_hooks(mode_watch=True)  # (the calls' checks: an armed pass makes none)
    train(model, optimizer, 2, device, "plain")  # the probe's step, then a pending one
    walks = []
    real_structure = overlap_module._structure
    monkeypatch.setattr(overlap_module, "_structure", lambda m: walks.append(m) or real_structure(m))
    tokens = tokens_for(0, device)  # (an op outside the model's calls would end the pass first)
    optimizer._runtime.synchronize()
    with torch.no_grad():
        model(tokens)
    assert walks == [] and not overlap.pending

    optimizer._set_test_hooks(compute_delay_us=200_000, seed=3)  # the step is in flight at the first call
    train(model, optimizer, 1, device, "plain")
    schedule = overlap.schedule
    last = max(schedule.wait_at)
    later = next(j for j in range(2, len(schedule.sequence)) if schedule.wait_at[1] < schedule.wait_at[j] < last)
    seen = {}

    def note_pending(module, args):  # (a module's own pre-hook runs after overlap's global one)
        seen.setdefault("pending", overlap.pending)

    handles = [schedule.sequence[1].register_forward_pre_hook(lambda m, a: optimizer._runtime.synchronize()),
               schedule.sequence[later].register_forward_pre_hook(note_pending)]
    try:
        with torch.no_grad():
            loss_of(model, tokens_for(1, device))
    finally:
        for handle in handles:
            handle.remove()
    assert len(walks) == 1 and seen == {"pending": False}
    optimizer.wait()


def test_an_entry_held_across_a_deferred_step_takes_edits():
    """An entry of `state` held across step() and edited after it returns, as
    torch.optim allows: the edit reaches the next step whether the step was
    deferred or not (the entry keeps its identity, as torch's)."""
    def run(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        inner = torch.optim.NAdam(model.parameters(), lr=1e-2)
        extra = dict(model=model, overlap_forward=True) if mode == "overlap" else {}
        optimizer = inner if mode == "plain" else so.SwapOptimizer(inner, swap_times=3, min_numel=0, **extra)
        x = torch.randn(8, 64)
        weight = model[0].weight
        deferred = None
        for step in range(5):
            model(x).square().mean().backward()
            held = optimizer.state[weight] if step == 3 else None
            optimizer.step()
            optimizer.zero_grad()
            if step == 3:
                deferred = mode == "overlap" and optimizer._overlap.pending
                held["exp_avg"] = torch.full_like(weight, 0.5)
        model(x).square().mean().backward()
        optimizer.step()
        if mode != "plain":
            optimizer.wait()
        return [p.detach().clone() for p in model.parameters()], deferred

    reference, _ = run("plain")
    for mode in ("whole", "overlap"):
        params, deferred = run(mode)
        assert deferred in (None, False) if mode == "whole" else deferred, "the edited step was deferred"
        assert all(torch.equal(p, q) for p, q in zip(params, reference)), mode


def test_the_private_torch_apis_overlap_uses_work_on_this_torch(monkeypatch):
    """Each wrapper of swap_optimizer/torch_internals.py does what overlap
    relies on, on the torch under test (2.14 in CI, 2.11 in the GPU check)."""
    from torch._dynamo.utils import counters
    from torch.overrides import TorchFunctionMode

    from swap_optimizer import torch_internals

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch_internals.check_mode_stack()
    mode, depth = Passing(), torch_internals.mode_stack_length()
    torch_internals.push_mode(mode)
    assert torch_internals.mode_stack_length() == depth + 1 and torch_internals.mode_at(depth) is mode
    assert torch_internals.pop_mode() is mode and torch_internals.mode_stack_length() == depth
    torch.set_default_device("cpu")
    try:
        default = torch_internals.default_device_mode()
        assert default is not None and torch_internals.mode_at(torch_internals.mode_stack_length() - 1) is default
    finally:
        torch.set_default_device(None)
    layer = nn.Linear(2, 2)
    assert not torch_internals.compiled_in_place(layer)
    layer.compile()
    assert torch_internals.compiled_in_place(layer)
    inner = nn.Linear(2, 2)
    assert torch_internals.compiled_wrapper_inner(torch.compile(inner)) is inner
    assert torch_internals.compiled_wrapper_inner(inner) is None
    # module_structure: equal while nothing changed; a param replaced or tied, a
    # module replaced or added, a module compiled in place each change it
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    model.append(model[0])  # a module held twice counts once, as modules() walks it
    before = torch_internals.module_structure(model)
    assert torch_internals.module_structure(model) == before
    changes = [lambda: setattr(model[0], "weight", nn.Parameter(torch.randn(2, 2))),
               lambda: setattr(model[1][0], "weight", model[0].weight),
               lambda: model[1].__setitem__(0, nn.Linear(2, 2)),
               lambda: model.append(nn.ReLU()),
               lambda: model[1].compile()]
    for change in changes:
        change()
        after = torch_internals.module_structure(model)
        assert after != before
        before = after
    # a scripted module keeps its params and children in mappings of its own
    scripted = nn.Sequential(nn.Linear(2, 2), torch.jit.script(nn.Linear(2, 2)))
    assert torch_internals.module_structure(scripted) == torch_internals.module_structure(scripted)
    moved = nn.Linear(2, 2)
    del moved.__dict__["_parameters"]  # as a torch that keeps them elsewhere would
    with pytest.raises(TypeError, match="without `_parameters`.*overlap_forward=False"):
        torch_internals.module_structure(nn.Sequential(moved))
    # a storage one tensor holds, then an alias too (a view, .data, .detach())
    alone = torch.randn(4, requires_grad=True)
    assert torch_internals.storage_is_shared(alone) is False
    for make_alias in (lambda t: t.view(2, 2), lambda t: t.data, lambda t: t.detach()):
        alias = make_alias(alone)
        assert torch_internals.storage_is_shared(alone) is True
        del alias
        assert torch_internals.storage_is_shared(alone) is False
    # every backward calls `before` first: Tensor.backward, autograd.backward and grad
    monkeypatch.setattr(torch.autograd, "_engine_run_backward", torch.autograd._engine_run_backward)
    calls = []
    assert torch_internals.call_before_every_backward(lambda: calls.append("before"))
    (alone * 2).sum().backward()
    torch.autograd.backward((alone * 3).sum())
    torch.autograd.grad((alone * 4).sum(), alone)
    assert calls == ["before"] * 3
    # whether torch.compile compiled a frame: its frame counter
    monkeypatch.setitem(counters, "frames", counters["frames"].copy())
    counters["frames"].clear()
    assert not torch_internals.compiled_anything()
    counters["frames"]["total"] += 1
    assert torch_internals.compiled_anything()


def test_the_span_lookup_finds_every_alias_among_an_ops_arguments():
    """_C.SpanIndex (the read watch's lookup): views, slices and aliases of
    a watched tensor, inside lists and tuples (not with lists=False), in
    positional or keyword arguments given as any sequence or mapping; not
    tensors beside it, empty or meta ones, or another device type's."""
    from collections import OrderedDict

    from swap_optimizer import _C

    storage = torch.zeros(100)
    watched, beside = storage[10:20], storage[20:30]
    index = _C.SpanIndex([(watched, 7), (torch.zeros(3), 8)], torch.device("cpu"))
    assert index.touched((watched.view(2, 5),), {}) == [7]
    assert index.touched((storage[15:25],), {}) == [7]
    assert index.touched((storage,), {}) == [7]  # the whole storage holds it
    assert index.touched((beside, storage[:10], torch.empty(0), torch.empty(3, device="meta")), {}) == []
    assert index.touched(([beside, (watched[3],)],), {}) == []  # (a tuple inside a list: one level only)
    assert index.touched(([beside, watched[3]],), {}) == [7]
    assert index.touched(([beside, watched[3]],), {}, lists=False) == []
    assert index.touched([watched], OrderedDict(out=watched)) == [7, 7]
    assert index.touched((), None) == []
    assert _C.SpanIndex([(watched, 7)], torch.device("meta")).touched((watched,), {}) == []


def test_only_ops_that_may_need_a_wait_reach_the_watchs_python_check():
    """_C.PassChecks and WatchCalls (the read watch's per-op triage, in C++):
    an op that touches a watched tensor (in a list too, unless lists is off),
    whose name only Python decides (attribute access, backward), or that runs
    once the pending step is updated (unless keep_watching) goes through the
    watch's check first; metadata reads and ops on other tensors run at once;
    with no pass, only the names Python decides are checked. WatchCalls
    counts its calls in progress on this thread, also through an op that
    raises, and checks nothing once retired."""
    from swap_optimizer import _C
    from swap_optimizer.overlap.guard import pass_checks

    checks = pass_checks()
    watched, other = torch.randn(4), torch.randn(4)
    assert not checks.needs_check(torch.add, (watched, watched), None)  # no pass
    assert checks.needs_check(torch.Tensor.backward, (watched,), None)
    checks.spans = _C.SpanIndex([(watched, 0)], torch.device("cpu"))
    assert checks.needs_check(torch.add, (other, watched[1:]), None)
    assert checks.needs_check(torch.add, (other,), {"other": watched})
    assert checks.needs_check(torch.cat, ([other, watched],), None)
    checks.lists = False
    assert not checks.needs_check(torch.cat, ([other, watched],), None)
    checks.lists = True
    assert not checks.needs_check(torch.add, (other, other), {"alpha": 2})
    assert not checks.needs_check(torch.Tensor.size, (watched,), None)  # metadata
    assert checks.needs_check(torch.Tensor.backward, (other,), None)
    assert checks.needs_check(torch.Tensor.data.__set__, (other, other), None)
    model = build(torch.device("cpu"))
    optimizer = so.SwapOptimizer(torch.optim.AdamW(model.parameters()), swap_times=2, min_numel=0)
    checks.runtime = optimizer._runtime  # no step pending: it counts as updated, the check ends the pass
    assert checks.needs_check(torch.add, (other, other), None)
    checks.keep_watching = True
    assert not checks.needs_check(torch.add, (other, other), None)
    checks.runtime = None
    assert checks.runtime is None and checks.spans is not None

    calls, seen = _C.WatchCalls(checks), []
    assert torch.equal(calls.call(torch.add, (other, watched), None, lambda *op: seen.append(calls.running_here())),
                       other + watched)
    assert seen == [True] and not calls.running_here()
    assert calls.call(lambda *args: calls.running_here(), (other,), None, seen.append)  # (untouched: no check)
    assert calls.call(torch.add, (other,), {"other": other, "alpha": 2}, seen.append).equal(other + 2 * other)
    with pytest.raises(TypeError, match="kwargs must be a dict or None"):
        calls.call(torch.add, (other, other), [("alpha", 2)], seen.append)
    with pytest.raises(RuntimeError, match="size"):
        calls.call(torch.add, (torch.randn(2), watched), None, lambda *op: seen.append("checked"))
    assert seen == [True, "checked"] and not calls.running_here()
    calls.retire()
    calls.call(torch.add, (other, watched), None, seen.append)
    assert seen == [True, "checked"]


def test_a_torch_without_the_private_apis_it_needs_is_refused_naming_them(monkeypatch):
    """overlap_forward relies on torch's function mode stack (private API,
    wrapped once in swap_optimizer/torch_internals.py): a torch that lacks it
    is refused when the optimizer is made, naming what is missing and the fix.
    Tests' knobs are checked by name too."""
    model = build(torch.device("cpu"))
    optimizer = make_optimizer(model, True, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"unknown rules \['nope'\]"):
        optimizer._overlap.set_test_hooks(knocked_out_rules={"nope"})
    monkeypatch.delattr(torch._C, "_push_on_torch_function_stack")
    with pytest.raises(RuntimeError, match=r"no torch._C._push_on_torch_function_stack.*use overlap_forward=False"):
        make_optimizer(build(torch.device("cpu")), True, torch.device("cpu"))


GC_INSIDE_ARM = r"""
import gc, sys
sys.path.insert(0, sys.argv[1])
import conftest  # noqa: F401  (puts the tests' folders on sys.path)
import torch
import swap_optimizer as so
from swap_optimizer.overlap import hooks
from test_overlap import build

def make_cycle():  # an overlapping optimizer that only the cyclic collector frees
    model = build(torch.device("cpu"))
    optimizer = so.SwapOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swap_times=2, min_numel=0,
                                 model=model, overlap_forward=True)
    optimizer.me = optimizer

gc.disable()
make_cycle()
register = hooks.nn.modules.module.register_module_forward_pre_hook
def collecting(*args, **kwargs):  # a collection that an allocation inside arm() triggers
    gc.collect()
    return register(*args, **kwargs)
hooks.nn.modules.module.register_module_forward_pre_hook = collecting
hooks._Watch.arm()
print("armed", len(hooks._Watch.overlaps))
"""


def test_a_collection_inside_arm_that_drops_an_optimizer_does_not_hang(tmp_path):
    """A garbage collection while the hooks go on may finalize an overlapping
    optimizer held in a reference cycle; its finalizer takes the hooks off
    on the same thread: the lock they share is reentrant (it hung)."""
    import subprocess
    import sys

    import conftest
    script = tmp_path / "gc_inside_arm.py"
    script.write_text(GC_INSIDE_ARM)
    result = subprocess.run([sys.executable, str(script), str(conftest.TESTS)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "armed 0" in result.stdout, result.stdout + result.stderr


def test_an_error_in_the_forward_after_an_orphaned_step_lands_stays_the_users():
    """An orphaned pass (its optimizer collected while its step ran) whose step
    lands inside a forward that then raises: the user's error comes out, not
    torch's "mutated during iteration" (the always-called post hook never
    takes the hooks off; the next pre-hook or wait does)."""
    from torch.nn.modules import module

    device = torch.device("cpu")
    model = build(device)
    optimizer = make_optimizer(model, True, device)
    train(model, optimizer, 2, device, "plain")
    overlap = optimizer._overlap
    assert overlap.pending
    extra = module.register_module_forward_hook(lambda *args: None)  # another global hook (a profiler's)
    layer = model.encoder.layers[0]
    layer_forward = layer.forward

    def failing(*args, **kwargs):
        assert overlap.pending, "the pass is still pending here"
        overlap._pending_runtime.wait_step()  # as the orphaned pass's own thread does
        overlap.orphan()
        overlap.pending = False
        raise ValueError("the user's error")

    layer.forward = failing
    try:
        with pytest.raises(ValueError, match="the user's error"):
            model(tokens_for(0, device))
    finally:
        extra.remove()
        layer.forward = layer_forward
    model(tokens_for(1, device))  # the next pre-hook unregisters the orphaned pass
    assert overlap not in overlap_module_watch().overlaps


def overlap_module_watch():
    from swap_optimizer.overlap.hooks import _Watch
    return _Watch


# CPU only: on CUDA the compiled path is the same whole-step wait() the other
# CUDA tests drive, and two compiles would take much of the GPU check's budget.
def test_compiled_model_waits_once_at_entry():
    device = torch.device("cpu")
    runs = []
    for overlap in (False, True):
        model = build(device)
        compiled = torch.compile(model, backend="aot_eager")
        optimizer = make_optimizer(model, overlap, device, compiled=compiled)
        logged = train(model, optimizer, 4, device, "plain", forward=compiled)
        if overlap:
            assert optimizer._overlap.schedule.compiled  # the probe saw the wrapper's call
        runs.append((logged, snapshot(model, optimizer)))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, b)
    assert_bitwise(runs[0][1], runs[1][1])


class NestedBlocks(nn.Module):
    """ModuleList([ModuleList([attn, ff]), ...]) iterated as `for attn, ff in
    self.layers`: the inner lists are never called, their modules are."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])
                                    for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for attn, ff in self.layers:
            x = x + ff(torch.tanh(attn(x)))
        return self.head(x)


def test_nested_module_lists_give_their_called_modules_as_blocks():
    device = torch.device("cpu")
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = NestedBlocks()
        optimizer = make_optimizer(model, overlap, device)
        if overlap:
            assert find_blocks(model) == [m for pair in model.layers for m in pair]
        logged = train(model, optimizer, 5, device, "plain")
        runs.append((logged, snapshot(model, optimizer)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert_bitwise(runs[0][1], runs[1][1])


def test_model_load_state_dict_waits_for_the_step():
    """Loading weights into the model while a step runs would race with it:
    the model's load_state_dict waits first, so the loaded weights stay."""
    device = torch.device("cpu")
    model = build(device)
    optimizer = make_optimizer(model, True, device)
    train(model, optimizer, 2, device, "plain")
    fresh = build(device, tied=True)
    model.load_state_dict(fresh.state_dict())
    assert not optimizer._runtime.has_deferred_step()
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def test_cut_params_keep_their_pieces_in_order():
    """A large embedding split across batches: its chain of batches moves as
    one when the pipeline is put in block order; training stays bitwise."""
    device = torch.device("cpu")
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = OverlapLM()
        model.embed = nn.Embedding(2048, WIDTH)  # 64K elements: cut into pieces at swap_times 8
        model.head = nn.Linear(WIDTH, VOCAB, bias=False)
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        optimizer = so.SwapOptimizer(inner, swap_times=8, num_arenas=2, min_numel=0, **extra)
        assert optimizer.memory_stats()["split_params"] >= 1
        if overlap:
            optimizer._set_test_hooks(copy_delay_us=300, seed=2)
            plan = optimizer._batch_layout()
            embed = [i for i, p in enumerate(model.parameters()) if p is model.embed.weight][0]
            pieces = [piece for batch in plan for piece in batch["pieces"] if piece[0] == embed]
            assert len(pieces) > 1 and [offset for _, offset, _ in pieces] == sorted(offset for _, offset, _ in pieces)
        logged = train(model, optimizer, 4, device, "plain")
        runs.append((logged, snapshot(model, optimizer)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert_bitwise(runs[0][1], runs[1][1])


def test_the_plan_follows_the_reads():
    """After the probe: the batches run in the order the forward first reads
    their params (the embedding first, also used by the tied head last), and
    each call waits for what is read before the next call, such as the
    out_proj.weight that MultiheadAttention reads itself."""
    model = build(torch.device("cpu"))
    optimizer = make_optimizer(model, True, torch.device("cpu"))
    train(model, optimizer, 2, torch.device("cpu"), "plain")
    plan = optimizer._overlap.schedule
    assert plan.sequence[0] is model and plan.sequence[1] is model.embed
    index = {id(p): i for i, p in enumerate(model.parameters())}
    batches = optimizer._batch_layout()  # pipeline order
    last = {i: max(b for b, batch in enumerate(batches) if i in batch["params"]) for i in index.values()}
    embed = index[id(model.embed.weight)]
    assert embed in batches[0]["params"]
    assert plan.wait_at == sorted(plan.wait_at) and plan.wait_at[-1] == len(batches) - 1
    for layer in model.encoder.layers:
        call = next(k for k, module in enumerate(plan.sequence) if module is layer.self_attn)
        assert plan.wait_at[call] >= last[index[id(layer.self_attn.out_proj.weight)]]
        assert plan.wait_at[call] >= last[index[id(layer.self_attn.in_proj_weight)]]
    first_layer = next(k for k, module in enumerate(plan.sequence) if module is model.encoder.layers[0])
    assert plan.wait_at[first_layer] < len(batches) - 1, "the first layer waits for the whole step"


def test_staging_counts_until_the_step_is_waited_for():
    device = torch.device("cpu")
    model = build(device)
    optimizer = make_optimizer(model, True, device)
    train(model, optimizer, 2, device, "plain")  # the probe, then an overlapped step
    stats = optimizer.memory_stats()
    assert stats["staging_bytes"] == stats["peak_staging_bytes"] > 0
    optimizer.wait()
    assert optimizer.memory_stats()["staging_bytes"] == 0


def _process_threads() -> set:
    return set(os.listdir("/proc/self/task"))


def _gnu_openmp_loaded() -> bool:
    with open("/proc/self/maps") as maps:
        return any("libgomp" in line for line in maps)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or not _gnu_openmp_loaded(),
                    reason="lists the process's threads in /proc; torch's OpenMP is libgomp (whose workers end "
                           "with the thread that made them)")
def test_a_deferred_step_leaves_no_thread_behind():
    """The host backend runs a deferred step on a thread of its own that ends
    with the step, and the OpenMP team its update's ops made ends with it.
    Kept (as this backend once kept them), more threads than CPUs made
    libgomp cut every team's spin-wait short: each parallel op anywhere in
    the process then slept and woke its workers, and every forward after the
    first deferred step ran about 4.5x slower on 2 cores."""
    torch.manual_seed(0)
    # weights of 65k elements: the update's elementwise ops run on torch's
    # intra-op threads (with more than one, a team of the update thread's own)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    x = torch.randn(8, 256)
    optimizer = so.SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), swap_times=2, min_numel=0,
                                 model=model, overlap_forward=True)

    def train_step():
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    train_step()  # the probe's step, whole
    model(x)  # the forward that makes the wait plan
    optimizer.wait()
    gc.collect()  # (earlier tests' runtimes go now, not while this one counts)
    so._C.wait_for_dropped_runtimes()
    before = _process_threads()
    for _ in range(3):
        train_step()
        assert optimizer._runtime.has_deferred_step()
        model(x)  # beside the step
        optimizer.wait()
        # No thread made since `before` outlives the step (threads that end
        # meanwhile cannot hide one that stays). OpenMP's workers leave on
        # their own once their team's thread has ended.
        deadline = time.monotonic() + 30
        while _process_threads() - before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _process_threads() - before


def test_bad_uses_are_refused():
    device = torch.device("cpu")
    model = build(device)
    inner = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="needs model="):
        so.SwapOptimizer(inner, overlap_forward=True)
    with pytest.raises(ValueError, match="only with overlap_forward=True"):
        so.SwapOptimizer(inner, model=model)
    with pytest.raises(TypeError, match="must be the torch.nn.Module"):
        so.SwapOptimizer(inner, model="model", overlap_forward=True)
    with pytest.raises(ValueError, match="nn.DataParallel copies every param"):
        so.SwapOptimizer(torch.optim.AdamW(model.parameters()), model=nn.DataParallel(model), overlap_forward=True)
    stranger = nn.Parameter(torch.randn(8))
    with pytest.raises(ValueError, match=r"param\(s\) \[\d+\] are not in the model"):
        so.SwapOptimizer(torch.optim.AdamW(list(model.parameters()) + [stranger]), model=model,
                         overlap_forward=True)
    optimizer = so.SwapOptimizer(torch.optim.AdamW(model.parameters()), model=model, overlap_forward=True)
    with pytest.raises(ValueError, match="not in the model"):
        optimizer.add_param_group({"params": [stranger]})
    assert len(optimizer.param_groups) == 1


def fault_snapshot(model, optimizer):
    optimizer.wait()
    return [p.detach().clone() for p in model.parameters()], {
        (i, k): v.clone() for i, p in enumerate(model.parameters()) for k, v in optimizer.state[p].items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fault", ["stage_in", "update", "update_last_call"])
def test_fault_at_every_batch_of_a_deferred_step_loses_nothing(fault, device):
    """A failure at any batch: on the host backend it shows at the next wait
    (here the next forward's hook), on CUDA when step() enqueues. Each param is
    then wholly old or wholly new; exactly the batches before the failing one
    are new for update faults; and training goes on bitwise like a plain
    optimizer loaded from that state."""
    device = torch.device(device)
    model = build(device)
    optimizer = make_optimizer(model, True, device)
    train(model, optimizer, 2, device, "plain")
    plan = optimizer._batch_layout()
    params = list(model.parameters())
    for fault_batch in range(len(plan)):
        before = fault_snapshot(model, optimizer)
        reference_model = build(device)
        reference_model.load_state_dict(model.state_dict())
        reference = make_optimizer(reference_model, False, device)
        reference.load_state_dict(round_trip(optimizer.state_dict()))
        train(reference_model, reference, 1, device, "plain")
        after = fault_snapshot(reference_model, reference)

        optimizer._set_test_hooks(fault=fault, fault_batch=fault_batch)
        with pytest.raises(RuntimeError, match="injected test fault"):
            train(model, optimizer, 1, device, "plain")
            loss_of(model, tokens_for(0, device))  # the forward's first wait reports it
        optimizer._set_test_hooks(copy_delay_us=300, seed=fault_batch)
        now = fault_snapshot(model, optimizer)
        new = []
        for i in range(len(params)):
            keys = [k for (j, k) in now[1] if j == i]
            old = torch.equal(now[0][i], before[0][i]) and all(torch.equal(now[1][(i, k)], before[1][(i, k)])
                                                                for k in keys)
            fresh = torch.equal(now[0][i], after[0][i]) and all(torch.equal(now[1][(i, k)], after[1][(i, k)])
                                                                 for k in keys)
            assert old != fresh, f"{fault} at batch {fault_batch}: param {i} is neither wholly old nor new"
            if fresh:
                new.append(i)
        if fault != "stage_in":
            assert new == sorted(i for batch in plan[:fault_batch] for i in batch["params"])
        assert optimizer._runtime.torn_params() == []
    # Training goes on, overlapped, bitwise like the plain loop from here.
    plain_model = build(device)
    plain_model.load_state_dict(model.state_dict())
    plain = make_optimizer(plain_model, False, device)
    plain.load_state_dict(round_trip(optimizer.state_dict()))
    assert all(torch.equal(a, b) for a, b in zip(train(model, optimizer, 3, device, "plain"),
                                                 train(plain_model, plain, 3, device, "plain")))
    assert_bitwise(snapshot(model, optimizer), snapshot(plain_model, plain))


def test_interrupt_at_every_batch_lets_the_deferred_step_complete():
    """Ctrl-C during a deferred step (raised on the update thread, as a signal
    may land on any thread): the step completes, and KeyboardInterrupt reaches
    the main thread by the next wait at the latest."""
    device = torch.device("cpu")
    model, plain_model = build(device), build(device)
    optimizer = make_optimizer(model, True, device)
    plain = make_optimizer(plain_model, False, device)
    train(model, optimizer, 1, device, "plain")  # the probe: the steps after it are deferred
    train(plain_model, plain, 1, device, "plain")
    plan = optimizer._batch_layout()
    for fault_batch in range(1, len(plan)):
        optimizer._set_test_hooks(fault="interrupt", fault_batch=fault_batch)
        with pytest.raises(KeyboardInterrupt):
            train(model, optimizer, 1, device, "plain")
            optimizer.wait()
        train(plain_model, plain, 1, device, "plain")
        optimizer._set_test_hooks()
        assert_bitwise(snapshot(model, optimizer), snapshot(plain_model, plain))


def test_handler_inside_a_whole_step_may_wait_and_save():
    """A signal handler that runs inside a whole step (the probe's, between
    batches) calls wait(), synchronize() and state_dict(): they return (no
    deferred step exists; waiting for the step's own lock never would), and
    training goes on bitwise."""
    import faulthandler
    import signal
    device = torch.device("cpu")
    model, plain_model = build(device), build(device)
    optimizer = make_optimizer(model, True, device)
    plain = make_optimizer(plain_model, False, device)
    served = []

    def handler(signum, frame):
        optimizer.wait()
        optimizer.synchronize()
        served.append(optimizer.state_dict())

    previous = signal.signal(signal.SIGINT, handler)
    faulthandler.dump_traceback_later(120, exit=True)  # a deadlock ends the run, loudly, instead of hanging CI
    try:
        optimizer._set_test_hooks(fault="interrupt", fault_batch=2)
        train(model, optimizer, 1, device, "plain")  # the whole (probe) step: the handler runs inside it
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGINT, previous)
    optimizer._set_test_hooks()
    assert len(served) == 1
    train(plain_model, plain, 1, device, "plain")
    assert all(torch.equal(a, b) for a, b in zip(train(model, optimizer, 3, device, "plain"),
                                                 train(plain_model, plain, 3, device, "plain")))
    assert_bitwise(snapshot(model, optimizer), snapshot(plain_model, plain))


@requires_cuda
def test_cuda_forward_waits_on_the_stream_without_host_sync():
    """On CUDA the hooks' waits are stream waits: step() and the next forward
    return before the update stream has finished (a host-side delay on the
    copy streams holds it back), and the results are still right."""
    device = torch.device("cuda")
    model, plain_model = build(device), build(device)
    optimizer = make_optimizer(model, True, device)
    plain = make_optimizer(plain_model, False, device)
    optimizer._set_test_hooks(copy_delay_us=20_000, seed=1)
    train(model, optimizer, 1, device, "plain")
    train(plain_model, plain, 1, device, "plain")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the caller's stream is whatever is current at the hooks
        train(model, optimizer, 1, device, "plain")
        loss = loss_of(model, tokens_for(1, device))  # enqueued behind the update, not waited for on the host
        reached = torch.cuda.Event()
        reached.record()
    assert not reached.query(), "step() or the forward's waits synchronised with the host"
    train(plain_model, plain, 1, device, "plain")
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(loss, loss_of(plain_model, tokens_for(1, device)))
    assert_bitwise(snapshot(model, optimizer), snapshot(plain_model, plain))


def capture_forward(model, tokens):
    """A CUDA graph of the model's forward (no grad), after warm-up calls on a
    side stream as torch.cuda.graph asks; returns the graph and its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):
            model(tokens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        output = model(tokens)
    return graph, output


@requires_cuda
def test_cuda_graph_capture_after_wait_is_refused_until_synchronize():
    """After an overlapped step, wait() is a stream wait: nothing proves on the
    host that the step ended, and a capture can neither wait on the step's
    events nor sync. The capture is refused before any CUDA call, with advice
    that works: after optimizer.synchronize() it is taken, and from then on
    each step completes inside step() (replays run no hooks), bitwise like a
    plain loop whose graph is replayed the same way."""
    device = torch.device("cuda")
    model, plain_model = build(device), build(device)
    optimizer, plain = make_optimizer(model, True, device), make_optimizer(plain_model, False, device)
    train(model, optimizer, 2, device, "plain")
    train(plain_model, plain, 2, device, "plain")
    tokens = tokens_for(0, device)
    optimizer.wait()
    with pytest.raises(RuntimeError, match=r"call optimizer.synchronize\(\) before capturing"):
        with torch.no_grad(), torch.cuda.graph(torch.cuda.CUDAGraph()):
            model(tokens)
    optimizer.synchronize()
    with pytest.warns(RuntimeWarning, match="captured in a CUDA graph"):
        graph, output = capture_forward(model, tokens)
    plain_graph, plain_output = capture_forward(plain_model, tokens)
    assert optimizer._overlap.graphed
    for step in range(3):
        train(model, optimizer, 1, device, "plain")
        train(plain_model, plain, 1, device, "plain")
        assert not optimizer._overlap.pending, "a step was deferred after the forward was captured"
        graph.replay()
        plain_graph.replay()
        assert torch.equal(output, plain_output)
    assert_bitwise(snapshot(model, optimizer), snapshot(plain_model, plain))


@requires_cuda
def test_cuda_graph_captured_before_the_first_step_never_races_a_step():
    """The forward captured before any step (nothing pending: taken), then
    replayed after each step: the steps complete inside step(), so a replay
    on the stream that stepped reads updated params."""
    device = torch.device("cuda")
    model, plain_model = build(device), build(device)
    optimizer, plain = make_optimizer(model, True, device), make_optimizer(plain_model, False, device)
    tokens = tokens_for(0, device)
    with pytest.warns(RuntimeWarning, match="captured in a CUDA graph"):
        graph, output = capture_forward(model, tokens)
    plain_graph, plain_output = capture_forward(plain_model, tokens)
    optimizer._set_test_hooks(copy_delay_us=20_000, seed=3)  # a racing replay would read old params
    for step in range(3):
        train(model, optimizer, 1, device, "plain")
        train(plain_model, plain, 1, device, "plain")
        graph.replay()
        plain_graph.replay()
        assert torch.equal(output, plain_output)


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU (params on a device that is not current)")
def test_cuda_graph_capture_is_seen_on_the_params_device():
    """Params on cuda:1 while cuda:0 is current: the capture on cuda:1's
    stream is seen there (torch.cuda.is_current_stream_capturing() alone looks
    at the current device) and refused while a step may run."""
    device = torch.device("cuda:1")
    model = build(device)
    optimizer = make_optimizer(model, True, device)
    train(model, optimizer, 2, device, "plain")
    optimizer.wait()
    tokens = tokens_for(0, device)
    stream = torch.cuda.Stream(device=device)
    with pytest.raises(RuntimeError, match=r"call optimizer.synchronize\(\) before capturing"):
        with torch.no_grad(), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            with torch.cuda.device(0):
                model(tokens)


def test_capture_rules_on_the_cpu(monkeypatch):
    """The capture rules without a GPU (a capture and CUDA's unproven step end
    simulated): refused while a step may run, even right after wait(); taken
    after synchronize(), and then every later step completes inside step()."""
    import contextlib

    import swap_optimizer.overlap.waits as overlap_module  # where the waits look `capturing` up
    device = torch.device("cpu")
    model = build(device)
    optimizer = make_optimizer(model, True, device)
    overlap = optimizer._overlap
    overlap.set_test_hooks(as_if_cuda=True)  # idle calls watched, an overlapped step unproven until synchronize()

    @contextlib.contextmanager
    def simulated_capture():
        monkeypatch.setattr(overlap_module, "capturing", lambda device: True)
        try:
            yield
        finally:
            monkeypatch.setattr(overlap_module, "capturing", lambda device: False)

    train(model, optimizer, 2, device, "plain")
    assert overlap.pending
    with pytest.raises(RuntimeError, match=r"call optimizer.synchronize\(\) before capturing"), simulated_capture():
        model(tokens_for(0, device))
    optimizer.wait()
    assert overlap.unproven  # wait() is a stream wait on CUDA
    with pytest.raises(RuntimeError, match=r"call optimizer.synchronize\(\) before capturing"), simulated_capture():
        model(tokens_for(0, device))
    optimizer.synchronize()
    with pytest.warns(RuntimeWarning, match="captured in a CUDA graph"), simulated_capture():
        model(tokens_for(0, device))
    train(model, optimizer, 2, device, "plain")
    assert overlap.graphed and not overlap.pending


def test_a_fault_inside_a_cut_param_of_a_deferred_step_tears_it_and_says_so():
    """Tear accounting by pipeline position: an update fault after the cut
    embedding's first piece and at or before its last leaves it torn, named in
    the error the forward's hook raises; step() then refuses until a
    checkpoint is loaded. Anywhere else nothing is torn."""
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = OverlapLM()
    model.embed = nn.Embedding(2048, WIDTH)
    model.head = nn.Linear(WIDTH, VOCAB, bias=False)
    optimizer = so.SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), swap_times=8, num_arenas=2,
                                 min_numel=0, model=model, overlap_forward=True)
    train(model, optimizer, 1, device, "plain")
    embed = [i for i, p in enumerate(model.parameters()) if p is model.embed.weight][0]
    plan = optimizer._batch_layout()
    holding = [b for b, batch in enumerate(plan) if embed in batch["params"]]
    assert len(holding) > 1
    for fault_batch in range(len(plan)):
        checkpoint = round_trip(optimizer.state_dict())
        weights = {name: t.clone() for name, t in model.state_dict().items()}
        optimizer._set_test_hooks(fault="update", fault_batch=fault_batch)
        with pytest.raises(RuntimeError, match="injected test fault") as info:
            train(model, optimizer, 1, device, "plain")
            loss_of(model, tokens_for(0, device))
        torn = min(holding) < fault_batch <= max(holding)
        assert optimizer._runtime.torn_params() == ([embed] if torn else [])
        assert ("partly updated" in str(info.value)) == torn
        if torn:
            with pytest.raises(RuntimeError, match="refuses to run"):
                optimizer.step()
        optimizer._set_test_hooks()
        model.load_state_dict(weights)
        optimizer.load_state_dict(checkpoint)
        assert optimizer._runtime.torn_params() == []
    train(model, optimizer, 1, device, "plain")


@pytest.mark.parametrize("fields", [dict(kahan_summation=True), dict(master_weights=True, state_dtype=torch.float32)],
                         ids=["kahan", "master"])
def test_16bit_params_follow_outside_writes_as_without_overlap(fields):
    """bf16 params with Kahan buffers or fp32 masters: the deferred step bumps
    no version counter, so a write made outside step() (here the model's
    load_state_dict between steps) is followed exactly as without overlap."""
    device = torch.device("cpu")
    runs = []
    for overlap in (False, True):
        model = build(device).to(torch.bfloat16)
        optimizer = make_optimizer(model, overlap, device, **fields)
        logged = train(model, optimizer, 2, device, "plain")
        edited = {name: (t * 0.5 if t.is_floating_point() else t) for name, t in model.state_dict().items()}
        model.load_state_dict(edited)
        logged += train(model, optimizer, 2, device, "plain")
        runs.append((logged, snapshot(model, optimizer)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert_bitwise(runs[0][1], runs[1][1])


def test_a_model_with_a_compiled_block_waits_once_at_entry():
    """A block compiled in place runs no eager hook inside, so a model with
    any module compiled in place waits for the whole step at its first call;
    training stays bitwise."""
    device = torch.device("cpu")
    runs = []
    for overlap in (False, True):
        model = build(device)
        model.encoder.layers[1].compile(backend="aot_eager")
        optimizer = make_optimizer(model, overlap, device)
        logged = train(model, optimizer, 3, device, "plain")
        if overlap:
            assert optimizer._overlap.schedule.compiled
        runs.append((logged, snapshot(model, optimizer)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert_bitwise(runs[0][1], runs[1][1])
