"""overlap_forward=True: one test per rule that places a wait, each able to
fail when that one rule is missing (issue 30, section 6).

The models are built so that no wait hides another: every param is its own
batch (min_numel=0, swap_times = the number of params, all params the same
size) and no two modules share a param, so a single misplaced wait leaves a
param whose update lags behind the read (random delays on every copy and
update, as in tests/overlap/test_overlap.py). Each run with overlap is compared
bitwise (torch.equal) with the same loop without it; its negative control
switches off exactly its own rule (OverlapTestHooks.knocked_out_rules, listed in
swap_optimizer.overlap.KNOCKABLE_RULES) and the same comparison then fails.
Each case runs under both watches: the global hooks and the read watch (the
rules above), and params and grads that watch themselves (an armed pass,
whose rules are swap_optimizer.overlap.armed.ARMED_RULES: each case's own
armed rule switched off fails it too).
test_each_rule_is_caught_by_its_own_case (slow tier) runs every rule against
every case: the matrix, and why a few cases also fail without another rule.
step()'s own refusal to be captured lives in swap_optimizer.step_guards, not
in the overlap: its test patches that module's `capturing`.
"""

import warnings
from unittest import mock

import pytest
import torch
from torch import nn

import swap_optimizer as so
import swap_optimizer.overlap.armed as armed_module
import swap_optimizer.overlap.waits as overlap_module  # the rules it knocks out; where `capturing` is looked up
import swap_optimizer.step_guards as step_guards_module

WIDTH = VOCAB = 16  # every param is WIDTH x WIDTH: the embedding, each linear, the head, a layer-scale
STEPS = 6
COPY_DELAY_US, COMPUTE_DELAY_US = 2000, 2000  # the updates lag far behind a forward that does not wait


def linear():
    return nn.Linear(WIDTH, WIDTH, bias=False)


class Plain(nn.Module):
    """Embedding, three linears in a ModuleList, a head: every read is of a
    called module's own weight. Keeps the embedding's output (`hidden`) for
    autograd.grad."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(linear() for _ in range(3))
        self.head = linear()

    def forward(self, tokens):
        x = self.hidden = self.embed(tokens)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class SavesItsWeights(Plain):
    """Plain, its layers' and head's weights read by torch.matmul, which
    saves each weight itself for backward (a Linear saves a transposed view,
    an alias: a pass with such a graph alive at step() does not arm). A graph
    built before step() then holds no alias, the pass arms, and that graph's
    backward reads the weights with no op on them."""

    def forward(self, tokens):
        x = self.hidden = self.embed(tokens)
        for layer in self.layers:
            x = torch.tanh(torch.matmul(x, layer.weight))
        return torch.matmul(x, self.head.weight)


class RootReadsAnother(Plain):
    """The model's own forward reads `mix.weight` (a module it never calls,
    not in a block) right after the embedding's call: only the probe places
    that read, at the embedding's call."""

    def __init__(self):
        super().__init__()
        self.mix = linear()

    def forward(self, tokens):
        x = self.embed(tokens) @ self.mix.weight
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class ScaledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = linear()
        self.gamma = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH)  # a layer-scale, as a matrix

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) @ self.gamma


class ForwardCalledBlocks(nn.Module):
    """Blocks called through block.forward(x): no hook of theirs runs, and
    each reads its own gamma after its fc's call; only the probe places that
    read (at the fc's call)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(ScaledBlock() for _ in range(3))
        self.head = linear()

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer.forward(x)
        return self.head(x)


class GatedBlock(nn.Module):
    """Reads its `gate` child's weight itself (never calling it), and only
    once the model's gate is on: a read the probe's forward did not make,
    which only the block's whole-subtree wait covers."""

    def __init__(self, model):
        super().__init__()
        self.fc = linear()
        self.gate = linear()
        self._model = [model]  # not a submodule

    def forward(self, x):
        x = torch.tanh(self.fc(x))
        if self._model[0].gate_on:
            x = x + torch.sigmoid(x @ self.gate.weight)
        return x


class GatedInList(nn.Module):
    """GatedBlocks in a ModuleList; the gates turn on after the probe's
    forward (a branch switched on after warm-up)."""

    def __init__(self, sequential=False):
        super().__init__()
        self.gate_on = True
        self.embed = nn.Embedding(VOCAB, WIDTH)
        blocks = [GatedBlock(self) for _ in range(3)]
        self.blocks = nn.Sequential(*blocks) if sequential else nn.ModuleList(blocks)
        self.head = linear()

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:  # iterated, never called as a whole
            x = block(x)
        return self.head(x)


class GatedInSequential(GatedInList):
    """The same blocks in an nn.Sequential the forward iterates (no ModuleList
    anywhere): its children must count as blocks."""

    def __init__(self):
        super().__init__(sequential=True)


def tokens_for(step, micro=0):
    generator = torch.Generator().manual_seed(100 * step + micro)
    return torch.randint(0, VOCAB, (4, 12), generator=generator)


def loss_of(model, tokens):
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.roll(tokens, -1, 1).reshape(-1))


# ---------------------------------------------------------------- the loops: each returns what it logged
def plain_loop(model, optimizer, step):
    optimizer.zero_grad()
    loss = loss_of(model, tokens_for(step))
    loss.backward()
    optimizer.step()
    return [loss.detach()]


def gate_after_warmup_loop(model, optimizer, step):
    model.gate_on = step != 1  # off in the probe's forward (the pass after the first step) only
    return plain_loop(model, optimizer, step)


def foreach_and_cat_reads_loop(model, optimizer, step):
    """Norms logged with a foreach op, and a copy of the weights made with
    torch.cat, right after step(): the params are only inside the ops' lists."""
    logged = plain_loop(model, optimizer, step)
    with torch.no_grad():
        params = list(model.parameters())
        logged += list(torch._foreach_norm(params))
        logged.append(torch.cat(params))
    return logged


def backward_after_step_loop(model, optimizer, step):
    """A second loss, built before step(), backpropagated after it while the
    step is pending: its grads accumulate into the ones the step reads."""
    optimizer.zero_grad()
    loss = loss_of(model, tokens_for(step))
    later = loss_of(model, tokens_for(step, micro=1))
    loss.backward()
    optimizer.step()
    later.backward()
    return [loss.detach(), later.detach()] + [p.grad.clone() for p in model.parameters()]


def autograd_grad_after_step_loop(model, optimizer, step):
    """torch.autograd.grad of a loss built before step(), after it: its
    backward reads the weights the pending step updates."""
    optimizer.zero_grad()
    loss = loss_of(model, tokens_for(step))
    later = loss_of(model, tokens_for(step, micro=1))
    loss.backward()
    optimizer.step()
    (grad,) = torch.autograd.grad(later, model.hidden)
    return [loss.detach(), later.detach(), grad]


def zero_grad_in_place_after_step_loop(model, optimizer, step):
    """model.zero_grad(set_to_none=False) right after step(): zeroes in place
    the grads the pending step still reads."""
    loss = loss_of(model, tokens_for(step))
    loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=False)
    return [loss.detach()]


# case: (model, loop, the rule of the hooks and read watch it covers)
CASES = {
    "read_in_the_models_own_call": (RootReadsAnother, plain_loop, "probe_rank_late"),
    "layer_scale_in_blocks_called_through_forward": (ForwardCalledBlocks, plain_loop, "probe_ranks"),
    "subtree_read_in_a_module_list_block": (GatedInList, gate_after_warmup_loop, "subtree"),
    "subtree_read_in_a_sequential_block": (GatedInSequential, gate_after_warmup_loop, "sequential"),
    "foreach_and_cat_after_step": (Plain, foreach_and_cat_reads_loop, "lists"),
    "backward_after_step": (Plain, backward_after_step_loop, "backward"),
    "autograd_grad_after_step": (Plain, autograd_grad_after_step_loop, "backward"),
    "zero_grad_in_place_after_step": (Plain, zero_grad_in_place_after_step_loop, "grads"),
}


# case -> the armed pass's rule it covers (with the model ARMED_MODEL gives, if any)
ARMED_RULE = {
    "read_in_the_models_own_call": "armed_ops",
    "layer_scale_in_blocks_called_through_forward": "armed_ops",
    "subtree_read_in_a_module_list_block": "armed_ops",
    "subtree_read_in_a_sequential_block": "armed_ops",
    "foreach_and_cat_after_step": "armed_lists",
    "backward_after_step": "armed_backward",
    "autograd_grad_after_step": "armed_backward",
    "zero_grad_in_place_after_step": "armed_grads",
}
ARMED_MODEL = {"backward_after_step": SavesItsWeights, "autograd_grad_after_step": SavesItsWeights}


def make_optimizer(model, overlap, rules=(), lag=1, watch="mode"):
    params = list(model.parameters())
    inner = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    extra = dict(model=model, overlap_forward=True) if overlap else {}
    optimizer = so.SwapOptimizer(inner, swap_times=len(params), num_arenas=2, min_numel=0, **extra)
    plan = optimizer._batch_layout()
    assert sorted(p for batch in plan for p in batch["params"]) == list(range(len(params)))
    assert all(len(batch["params"]) == 1 for batch in plan), "a param shares a batch: one wait would cover another"
    if overlap:
        optimizer._set_test_hooks(copy_delay_us=lag * COPY_DELAY_US, compute_delay_us=lag * COMPUTE_DELAY_US, seed=5)
        known = overlap_module.KNOCKABLE_RULES if watch == "mode" else armed_module.ARMED_RULES
        assert set(rules) <= set(known)
        optimizer._overlap.set_test_hooks(knocked_out_rules=rules, mode_watch=watch == "mode")
    return optimizer


def run(case, overlap, rules=(), lag=1, watch="mode"):
    """The case's loop for STEPS steps: what it logged, then the params and
    the optimizer state. lag scales the update's delays; watch: "mode" (the
    hooks and the read watch) or "armed" (every overlapped pass armed)."""
    build, loop, _ = CASES[case]
    build = ARMED_MODEL.get(case, build) if watch == "armed" else build
    torch.manual_seed(0)
    model = build()
    optimizer = make_optimizer(model, overlap, rules, lag, watch)
    logged = []
    with mock.patch.object(armed_module.ArmedPass, "arm", autospec=True,
                           side_effect=armed_module.ArmedPass.arm) as arm:
        for step in range(STEPS):
            logged += [t.detach().clone() for t in loop(model, optimizer, step)]
    if overlap:  # the steps after the probe's did overlap, every one armed under the armed watch
        assert optimizer._overlap.schedule is not None and optimizer._overlap._last_step_deferred
        assert arm.call_count == (STEPS - 1 if watch == "armed" else 0), (watch, arm.call_count)
    optimizer.wait()
    params = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for p in model.parameters() for v in optimizer.state[p].values()]
    return logged + params + state


def differs(first, second):
    return len(first) != len(second) or any(not torch.equal(a, b) for a, b in zip(first, second))


def differs_without(plain, case, rule, watch="mode"):
    """Whether the case differs from `plain` with `rule` knocked out. A read
    that no longer waits differs only if it comes before the update it races:
    on a loaded machine the forward may lag behind even the delayed update, so
    a run that shows no difference is tried again with the delays 10x."""
    return any(differs(plain, run(case, True, rules={rule}, lag=lag, watch=watch)) for lag in (1, 10))


def first_difference(first, second):
    """Where two runs' records first differ (logged values, then params, then state)."""
    return next((i for i, (a, b) in enumerate(zip(first, second)) if not torch.equal(a, b)), None)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("watch", ["mode", "armed"])
def test_each_wait_is_needed_and_enough(case, watch, overlap_may_arm):
    """Bitwise like overlap off, under either watch; with the case's own rule
    of that watch knocked out, not."""
    rule = CASES[case][2] if watch == "mode" else ARMED_RULE[case]
    plain = run(case, False, watch=watch)
    overlapped = run(case, True, watch=watch)
    assert not differs(plain, overlapped), \
        f"overlap changed the results (first at record {first_difference(plain, overlapped)} of {len(plain)})"
    assert differs_without(plain, case, rule, watch), \
        f"negative control: without the rule {rule!r} " \
        f"({ {**overlap_module.KNOCKABLE_RULES, **armed_module.ARMED_RULES}[rule]}) the results should differ"


# Where a case also fails without a rule other than its own, and why:
# - "probe_ranks" drops every place the probe found, "probe_rank_late" moves
#   each one call later: a read only the probe places (both read cases) is
#   then read before its wait either way.
# - the Sequential case's blocks get their subtree wait from the "subtree"
#   rule, which "sequential" feeds.
ALSO_CAUGHT_BY = {
    "read_in_the_models_own_call": {"probe_ranks"},
    "layer_scale_in_blocks_called_through_forward": {"probe_rank_late"},
    "subtree_read_in_a_sequential_block": {"subtree"},
}


@pytest.mark.slow
def test_each_rule_is_caught_by_its_own_case(monkeypatch):
    """Every knockable rule against every case: a case differs from the plain
    run exactly when its own rule (or one listed in ALSO_CAUGHT_BY) is off,
    and the simulated capture after wait() is taken only without "unproven"."""
    plain = {case: run(case, False) for case in CASES}
    failures = []
    for rule in overlap_module.KNOCKABLE_RULES:
        for case, (_, _, own) in CASES.items():
            expected = rule == own or rule in ALSO_CAUGHT_BY.get(case, ())
            seen = differs_without(plain[case], case, rule) if expected else \
                differs(plain[case], run(case, True, rules={rule}))
            if seen != expected:
                failures.append(f"{rule} x {case}: {'no difference' if expected else 'differs'}")
        if capture_refused_after_wait(monkeypatch, rules={rule}) != (rule != "unproven"):
            failures.append(f"{rule} x the capture after wait()")
    assert not failures, failures


# ---------------------------------------------------------------- captures (CUDA graphs), simulated on the CPU
def capture_refused_after_wait(monkeypatch, rules=()):
    """An overlapped step whose overlap believes its params are on CUDA,
    wait() (a stream wait there), then a simulated capture of the forward:
    whether it is refused. After synchronize() it is taken."""
    capturing = [False]
    monkeypatch.setattr(overlap_module, "capturing", lambda device: capturing[0])
    torch.manual_seed(0)
    model = Plain()
    optimizer = make_optimizer(model, True, rules)
    overlap = optimizer._overlap
    for step in range(2):  # the probe's step, then an overlapped one
        plain_loop(model, optimizer, step)
    optimizer.wait()
    assert not overlap.unproven  # a CPU step proves its own end
    overlap.set_test_hooks(as_if_cuda=True)  # the capture rules as for params on a GPU
    try:
        plain_loop(model, optimizer, 2)
        assert overlap.pending
        optimizer.wait()
        capturing[0] = True
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "captured in a CUDA graph", when taken
                model(tokens_for(9))
        except RuntimeError as error:
            assert "call optimizer.synchronize() before capturing" in str(error)
            refused = True
        else:
            refused = False
            assert overlap.graphed
        if refused:
            capturing[0] = False
            optimizer.synchronize()
            capturing[0] = True
            with pytest.warns(RuntimeWarning, match="captured in a CUDA graph"):
                model(tokens_for(9))
            assert overlap.graphed
        return refused
    finally:
        capturing[0] = False
        overlap.set_test_hooks(as_if_cuda=False)
        monkeypatch.undo()


def test_an_overlapped_step_on_cuda_is_unproven_until_synchronize(monkeypatch):
    """On CUDA, wait() after an overlapped step is a stream wait: nothing on
    the host proves that the step ended, so a capture is refused until
    synchronize(). The overlapped step itself marks that (the set-point of
    `unproven`; tests/overlap/test_overlap.py sets it by hand): simulated with the
    overlap's device set to CUDA for one deferred step and captures faked."""
    assert capture_refused_after_wait(monkeypatch), \
        "a capture was taken after a stream wait: the overlapped step did not mark itself unproven"
    assert not capture_refused_after_wait(monkeypatch, rules={"unproven"}), "negative control: the capture was refused"


@pytest.mark.parametrize("kind", ["adamw_packed", "adamw", "rule_sgd"])
def test_step_refuses_to_be_captured(monkeypatch, kind):
    """step() inside a CUDA graph capture is refused before anything moves,
    by the check in step() itself (step_guards.refuse_step_capture; patching
    the overlap's `capturing` does not reach it), for the packed kernel and
    for torch's update alike."""
    torch.manual_seed(0)
    model = Plain()
    inner = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9) if kind == "rule_sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-2)
    settings = dict(state_dtype=torch.float32) if kind == "adamw_packed" else {}
    optimizer = so.SwapOptimizer(inner, swap_times=2, min_numel=0, **settings)
    module = step_guards_module
    plain_loop(model, optimizer, 0)
    loss_of(model, tokens_for(1)).backward()

    def snapshot():
        return [p.detach().clone() for p in model.parameters()] + \
            [v.clone() for p in model.parameters() for v in optimizer.state[p].values()]
    before = snapshot()
    monkeypatch.setattr(module, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match=r"SwapOptimizer.step\(\) cannot be captured in a CUDA graph"):
        optimizer.step()
    monkeypatch.undo()
    assert not differs(before, snapshot())
    optimizer.step()  # outside a capture it steps
    assert differs(before, snapshot())
