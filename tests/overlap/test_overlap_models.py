"""overlap_forward=True on model code written the way people write it, not the
way the hooks would like it: blocks in an nn.Sequential the forward iterates,
a holder whose method calls the real model, a module registered in a block and
read before it, blocks called through .forward(), timm's checkpoint_seq, layer
drop, torch.compile applied after the optimizer was made, and reads of params
outside the forward (an EMA, norm logging, deepcopy, torch.save) right after
step().

Each run with overlap is compared bitwise (torch.equal) with the same loop
without it. Random delays on every copy make the updates lag behind the
forward, so a read that did not wait changes bits. Each case has a negative
control: the wait that covers it is knocked out (the param's waits, or the
watch on ops outside the forward), and the same comparison then fails.
"""

import copy
import gc
import io
import warnings

import pytest
import torch
import torch.nn.utils.prune
from torch import nn
from torch.utils.checkpoint import checkpoint

import swap_optimizer as so
from conftest import PACKED_KERNEL, DEVICES

VOCAB, WIDTH, STEPS = 64, 32, 5


class Block(nn.Module):
    def __init__(self, layer_scale=False):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.gamma = nn.Parameter(torch.full((WIDTH,), 0.5)) if layer_scale else None

    def forward(self, x):
        y = self.fc2(torch.tanh(self.fc1(self.norm(x))))
        return x + (self.gamma * y if self.gamma is not None else y)


class SequentialBlocks(nn.Module):
    """Case 1: blocks in an nn.Sequential that the forward iterates (no
    ModuleList anywhere), as timm's ViT does around checkpoint_seq."""

    def __init__(self, blocks=3, layer_scale=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*[Block(layer_scale) for _ in range(blocks)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Holder(nn.Module):
    """Case 2: what the optimizer is given (a LightningModule, say) holds the
    model, and its training step calls the inner model; the holder itself is
    never called."""

    def __init__(self):
        super().__init__()
        self.model = SequentialBlocks()

    def training_step(self, tokens):
        return loss_of(self.model, tokens)


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x):
        return x * self.weight


class SharedScale(nn.Module):
    """Case 3: a module owned outside the blocks and also registered inside
    one (layers[2].shared), read before that block runs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.scale = Scale()
        self.layers[2].shared = self.scale
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.scale(self.embed(tokens))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class ForwardCalls(nn.Module):
    """Case 4: blocks called through block.forward(x): no __call__, no hook of
    theirs runs. With layer_scale, each block has a parameter of its own."""

    def __init__(self, layer_scale=False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block(layer_scale) for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer.forward(x)
        return self.head(x)


def checkpoint_seq(functions, x, every=1, use_reentrant=False):
    """timm.models.helpers.checkpoint_seq, as timm writes it: segments of an
    nn.Sequential run under torch.utils.checkpoint, indexing the Sequential."""
    def run_function(start, end, functions):
        def forward(_x):
            for j in range(start, end + 1):
                _x = functions[j](_x)
            return _x
        return forward

    count = len(functions)
    for start in range(0, count, every):
        end = min(start + every - 1, count - 1)
        x = checkpoint(run_function(start, end, functions), x, use_reentrant=use_reentrant)
    return x


class CheckpointSeq(SequentialBlocks):
    def __init__(self, use_reentrant):
        super().__init__()
        self.use_reentrant = use_reentrant

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(checkpoint_seq(self.blocks, x, every=2, use_reentrant=self.use_reentrant))


class LayerDrop(nn.Module):
    """The set of called blocks changes between steps (a layer dropped on
    odd steps)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.calls = 0

    def forward(self, tokens):
        x = self.embed(tokens)
        dropped = 1 + self.calls % 3 if self.calls % 2 else None
        self.calls += 1
        for i, layer in enumerate(self.layers):
            if i != dropped:
                x = layer(x)
        return self.head(x)


def tokens_for(step):
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (4, 12), generator=generator)


def loss_of(model, tokens):
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.roll(tokens, -1, 1).reshape(-1))


def make_optimizer(model, overlap, delay_us=300, own_batches=False):
    """own_batches: every param its own batch (swap_times = the number of
    params), so that a wait knocked out is not covered by another's."""
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    extra = dict(model=model, overlap_forward=True) if overlap else {}
    swap_times = len(list(model.parameters())) if own_batches else 6
    # The packed kernel: the negative controls (a wait knocked out must change
    # the results) are timed on its updates' lag; torch's update runs the same
    # protocol (tests/overlap/test_overlap_rules.py, and overlapped_pair below).
    optimizer = so.SwapOptimizer(inner, swap_times=swap_times, num_arenas=3, min_numel=0, **extra, **PACKED_KERNEL)
    if own_batches:
        assert all(len(batch["params"]) == 1 for batch in optimizer._batch_layout())
    if overlap:
        # The updates lag; with a batch per param, each update lags on its own.
        optimizer._set_test_hooks(copy_delay_us=delay_us, compute_delay_us=2000 if own_batches else 300, seed=5)
    return optimizer


def index_of(model, *params):
    ids = {id(p) for p in params}
    return {i for i, p in enumerate(model.parameters()) if id(p) in ids}


# The negative controls' copies take longer, so that a read that does not wait
# certainly comes before the update even on a loaded machine.
CONTROL_DELAY_US = 4000


def run(build, overlap, steps=STEPS, step_loss=loss_of, after_step=None, knock_out=None, unguarded=(),
        device="cpu", own_batches=False):
    """Trains `steps` steps; returns the losses and whatever after_step logged,
    then the params and optimizer state."""
    torch.manual_seed(0)
    model = build().to(device)
    control = knock_out is not None or bool(unguarded)
    optimizer = make_optimizer(model, overlap, delay_us=CONTROL_DELAY_US if control else 300, own_batches=own_batches)
    if overlap:
        optimizer._overlap.set_test_hooks(knocked_out=knock_out(model) if knock_out is not None else (),
                                          unguarded=unguarded)
    logged = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = step_loss(model, tokens_for(step).to(device))
        loss.backward()
        logged.append(loss.detach().clone())
        optimizer.step()
        if after_step is not None:
            logged += [t.detach().clone() for t in after_step(model, optimizer, step)]
    optimizer.wait()
    params = [p.detach().cpu().clone() for p in model.parameters()]
    state = [v.cpu().clone() for p in model.parameters() for v in optimizer.state[p].values()]
    return [t.cpu() for t in logged], params + state


def differs(first, second):
    return len(first[0]) != len(second[0]) or \
        any(not torch.equal(a, b) for a, b in zip(first[0] + first[1], second[0] + second[1]))


def check_case(build, knock_out, **kwargs):
    """Bitwise like overlap off; and with the covering waits knocked out, not."""
    plain = run(build, False, **kwargs)
    assert not differs(plain, run(build, True, **kwargs)), "overlap changed the results"
    assert differs(plain, run(build, True, knock_out=knock_out, **kwargs)), \
        "negative control: without the waits that cover this case the results should differ"


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_in_a_sequential_the_forward_iterates(device):
    check_case(SequentialBlocks, lambda m: index_of(m, *m.blocks.parameters()), device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_holder_whose_method_calls_the_inner_model(device):
    """The holder is given as model= and never called: the inner model's
    first call waits (here for the embedding), not a hook on the holder."""
    holder_loss = lambda holder, tokens: holder.training_step(tokens)  # noqa: E731
    check_case(Holder, lambda h: index_of(h, h.model.embed.weight), step_loss=holder_loss, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_module_registered_in_a_block_and_read_before_it(device):
    check_case(SharedScale, lambda m: index_of(m, m.scale.weight), device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_called_through_forward(device):
    """No hook of theirs runs: their reads wait at the call before them."""
    check_case(ForwardCalls, lambda m: index_of(m, *m.layers.parameters()), device=device)


def test_a_layer_scale_gamma_in_blocks_called_through_forward():
    """Each block's own gamma (an nn.Parameter of the block, whose call runs no
    hook) is read after its fc2's call: it waits there, as the probe saw. Its
    control knocks out the gammas alone, each its own batch (sharing one with
    a param the fc2 call waits for, it would be covered by that wait)."""
    check_case(lambda: ForwardCalls(layer_scale=True), lambda m: index_of(m, *(layer.gamma for layer in m.layers)),
               own_batches=True)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("device", DEVICES)
def test_timm_checkpoint_seq(use_reentrant, device):
    check_case(lambda: CheckpointSeq(use_reentrant), lambda m: index_of(m, *m.blocks.parameters()), device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_drop_waits_for_the_whole_step_where_the_calls_differ(device):
    """Odd forwards skip a layer (the probe's forward skipped layer 2): the
    calls differ from the probe's there, and the whole step is waited for at
    that point. Without that wait, layer 2, which the probe never saw called,
    would read its params before their update."""
    plain = run(LayerDrop, False, device=device)
    assert not differs(plain, run(LayerDrop, True, device=device))
    assert differs(plain, run(LayerDrop, True, unguarded={"divergence"}, device=device))


def test_compile_with_fullgraph_after_the_optimizer_was_made():
    """torch.compile(model, fullgraph=True) after the optimizer: the compiled
    wrapper's call waits for the whole step (no hook inside runs eagerly)."""
    compiled = {}

    def compiled_loss(model, tokens):
        if id(model) not in compiled:  # made at the first step, after the optimizer
            compiled[id(model)] = torch.compile(model, fullgraph=True, backend="aot_eager")
        return loss_of(compiled[id(model)], tokens)
    plain = run(SequentialBlocks, False, step_loss=compiled_loss)
    assert not differs(plain, run(SequentialBlocks, True, step_loss=compiled_loss))
    assert differs(plain, run(SequentialBlocks, True, step_loss=compiled_loss, unguarded={"compiled", "ops"}))


class WeightNormed(SequentialBlocks):
    """fc1 under torch.nn.utils.parametrizations.weight_norm: its weight is
    computed from two params at every access, inside the call."""

    def __init__(self):
        super().__init__()
        for block in self.blocks:
            torch.nn.utils.parametrizations.weight_norm(block.fc1)


class Pruned(SequentialBlocks):
    """fc2 pruned: a module pre-hook of torch's computes weight from
    weight_orig and a mask before each call."""

    def __init__(self):
        super().__init__()
        for block in self.blocks:
            torch.nn.utils.prune.random_unstructured(block.fc2, "weight", 0.3)


class MaxNormEmbedding(SequentialBlocks):
    """nn.Embedding(max_norm=...) renormalises rows of its weight in place
    during the forward: a write that must follow the update."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, max_norm=1.0)


class TwoViews(SequentialBlocks):
    """The model called twice per step (two views of the batch)."""

    def forward(self, tokens):
        return super().forward(tokens) + super().forward(torch.flip(tokens, [1]))


def evaluate_after_step(model, optimizer, step):
    """An evaluation forward (eval mode, no grad) right after step(), before
    the next training forward; its loss is logged."""
    model.eval()
    with torch.no_grad():
        loss = loss_of(model, tokens_for(100 + step))
    model.train()
    return [loss]


# case: (model, what runs right after step(), the params whose waits its control knocks out)
MORE_MODEL_CODE = {
    # fc1's weight computed from its parametrization's two params, inside fc1's call
    "weight_norm": (WeightNormed, None, lambda m: index_of(m, *(p for block in m.blocks
                                                                   for p in block.fc1.parametrizations.parameters()))),
    # fc2's weight computed from weight_orig by torch's pre-hook of fc2
    "pruning_pre_hook": (Pruned, None, lambda m: index_of(m, *(block.fc2.weight_orig for block in m.blocks))),
    # rows of the embedding renormalised in place by its own call
    "embedding_max_norm": (MaxNormEmbedding, None, lambda m: index_of(m, m.embed.weight)),
    # the embedding, read first by each view (the second view's calls follow the probe's second half)
    "two_views": (TwoViews, None, lambda m: index_of(m, m.embed.weight)),
    # the embedding, read first by the evaluation forward, whose loss is logged
    "eval_after_step": (SequentialBlocks, evaluate_after_step, lambda m: index_of(m, m.embed.weight)),
}


@pytest.mark.parametrize("case", list(MORE_MODEL_CODE))
def test_more_model_code(case):
    """Bitwise like overlap off; with the waits of the params the case is
    about knocked out (each param its own batch), not."""
    build, after_step, knock_out = MORE_MODEL_CODE[case]
    check_case(build, knock_out, after_step=after_step, own_batches=True)


def test_two_overlapping_optimizers_on_one_model():
    """Two SwapOptimizers (as for Muon on the matrices and AdamW on the rest),
    each over part of one model, both overlapped: bitwise like neither."""
    def train(overlap):
        torch.manual_seed(0)
        model = SequentialBlocks()
        params = list(model.parameters())
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        optimizers = [so.SwapOptimizer(torch.optim.AdamW(part, lr=3e-3), swap_times=3, num_arenas=2, min_numel=0,
                                       **extra) for part in (params[::2], params[1::2])]
        for seed, optimizer in enumerate(optimizers):
            if overlap:
                optimizer._set_test_hooks(copy_delay_us=500, seed=seed)
        logged = []
        for step in range(STEPS):
            for optimizer in optimizers:
                optimizer.zero_grad()
            loss = loss_of(model, tokens_for(step))
            loss.backward()
            logged.append(loss.detach())
            for optimizer in optimizers:
                optimizer.step()
        for optimizer in optimizers:
            optimizer.wait()
        return logged, [p.detach().clone() for p in model.parameters()]
    assert not differs(train(False), train(True))


# ---------------------------------------------------------------- reads outside the forward
AVERAGED = {}


def ema_after_step(model, optimizer, step):
    if step == 0:
        AVERAGED[id(model)] = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    averaged = AVERAGED[id(model)]
    averaged.update_parameters(model)
    return list(averaged.module.parameters())


def norms_after_step(model, optimizer, step):
    return [torch.stack([p.norm() for p in model.parameters()])]


def deepcopy_after_step(model, optimizer, step):
    return list(copy.deepcopy(model).parameters())


def save_after_step(model, optimizer, step):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return list(torch.load(buffer, weights_only=False).parameters())


@pytest.mark.parametrize("after_step", [ema_after_step, norms_after_step, deepcopy_after_step, save_after_step],
                         ids=["averaged_model_ema", "norm_logging", "deepcopy", "torch_save"])
@pytest.mark.parametrize("device", DEVICES)
def test_reads_right_after_step_wait_by_themselves(after_step, device):
    plain = run(SequentialBlocks, False, after_step=after_step, device=device)
    assert not differs(plain, run(SequentialBlocks, True, after_step=after_step, device=device))
    assert differs(plain, run(SequentialBlocks, True, after_step=after_step, unguarded={"ops"}, device=device)), \
        "negative control: with the watch on ops outside the forward off, the read should see old values"


def test_a_copy_of_the_model_neither_waits_nor_keeps_the_optimizer():
    """The model stays picklable; copies have no hooks and other params, so
    calling one never waits for the original's step, and the original's
    optimizer goes away with it."""
    import gc
    import weakref
    torch.manual_seed(0)
    model = SequentialBlocks()
    optimizer = make_optimizer(model, True)
    for step in range(2):
        loss_of(model, tokens_for(step)).backward()
        optimizer.step()
    copied = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    optimizer._set_test_hooks(copy_delay_us=20_000, seed=1)  # a step that takes a while
    loss_of(model, tokens_for(3)).backward()
    optimizer.step()
    assert optimizer._overlap.pending
    for other in (copied, loaded):
        loss_of(other, tokens_for(4))
    assert optimizer._overlap.pending, "calling a copy waited for the original's step"
    optimizer.wait()
    reference = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    assert reference() is None, "a copy of the model (or its hooks) kept the optimizer alive"
    loss_of(loaded, tokens_for(5))


# ---------------------------------------------------------------- what the probe cannot see, and compile
class HiddenRead(torch.autograd.Function):
    """Reads the weight where no torch function mode can see it (as a Triton
    or raw-pointer kernel would)."""

    @staticmethod
    def forward(ctx, x, weight):
        with torch._C.DisableTorchFunction():
            ctx.save_for_backward(x, weight)
            return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).sum((0, 1))


class HiddenScale(SequentialBlocks):
    """Reads a scale (in a module of its own, registered last, never called)
    with HiddenRead, before the blocks."""

    def __init__(self):
        super().__init__()
        self.tail = Scale()

    def forward(self, tokens):
        x = HiddenRead.apply(self.embed(tokens), self.tail.weight)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("device", DEVICES)
def test_reads_the_probe_cannot_see_finish_inside_step(device):
    """A param whose grad appears although no read of it was seen is updated
    inside step() from then on, and the user is told which one."""
    plain = run(HiddenScale, False, device=device)
    with pytest.warns(RuntimeWarning, match=r"param\(s\) \d+ \(tail.weight\) got grads although the probe saw no read"):
        assert not differs(plain, run(HiddenScale, True, device=device))
    assert differs(plain, run(HiddenScale, True, knock_out=lambda m: index_of(m, m.tail.weight), device=device))


def test_compiling_the_model_in_place_after_an_overlapped_step_refuses_that_step():
    """model.compile() after overlapped steps: the compiled forward runs no
    eager hook, so the next step() refuses (its grads may have been computed
    from params read before their update), and later steps complete inside
    step(), bitwise like overlap off."""
    torch.manual_seed(0)
    model, plain_model = SequentialBlocks(), SequentialBlocks()
    plain_model.load_state_dict(model.state_dict())
    optimizer, plain = make_optimizer(model, True), make_optimizer(plain_model, False)
    for step in range(2):
        for m, opt in ((model, optimizer), (plain_model, plain)):
            opt.zero_grad()
            loss_of(m, tokens_for(step)).backward()
            opt.step()
    model.compile(backend="aot_eager")
    plain_model.compile(backend="aot_eager")
    optimizer.zero_grad()
    loss_of(model, tokens_for(2)).backward()
    with pytest.raises(RuntimeError, match=r"compiled in place .* this step is refused"):
        optimizer.step()
    for step in range(2, 5):
        for m, opt in ((model, optimizer), (plain_model, plain)):
            opt.zero_grad()
            loss_of(m, tokens_for(step)).backward()
            opt.step()
        assert not optimizer._overlap.pending  # completed inside step()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)


class UserMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("armed", [True, False])
def test_the_watch_leaves_the_mode_stack_as_it_found_it(armed, overlap_may_arm):
    """The watch sits at the bottom of the mode stack (above torch.device
    contexts) while a step is pending outside the model's calls, and is gone
    once the step is waited for; users' modes entered and left meanwhile, and
    a torch.device context around everything, keep working. A pass whose
    params watch themselves (armed) puts no mode on the stack at all."""
    stack_size = torch._C._len_torch_function_stack
    torch.manual_seed(0)
    model = SequentialBlocks()
    optimizer = make_optimizer(model, True)
    optimizer._overlap.set_test_hooks(mode_watch=not armed)
    watch = 0 if armed else 1
    with torch.device("cpu"):
        base = stack_size()
        for step in range(4):
            optimizer.zero_grad()
            with UserMode():
                loss = loss_of(model, tokens_for(step))
            loss.backward()
            optimizer.step()
            if step >= 1:  # overlapped: the watch is on until the next forward's calls have waited
                assert optimizer._overlap.pending and stack_size() == base + watch
                assert (optimizer._overlap._armed is not None) == armed
                with UserMode():
                    assert stack_size() == base + watch + 1
                assert stack_size() == base + watch
        optimizer.wait()
        assert stack_size() == base
    assert stack_size() == 0
    loss_of(model, tokens_for(9))  # the forward after a wait runs with no mode at all


def test_training_that_moves_to_another_thread():
    """Steps 0-2 on one thread, the rest on another (a loop restarted in a
    worker, say): the watch follows step() to its new thread, bitwise."""
    import threading

    def train_in_threads(overlap):
        torch.manual_seed(0)
        model = SequentialBlocks()
        optimizer = make_optimizer(model, overlap)
        logged = []

        def steps(first, last):
            for step in range(first, last):
                optimizer.zero_grad()
                loss = loss_of(model, tokens_for(step))
                loss.backward()
                logged.append(loss.detach())
                optimizer.step()
                logged.append(torch.stack([p.norm() for p in model.parameters()]))  # a read outside the forward
        for first, last in ((0, 3), (3, 6)):
            worker = threading.Thread(target=steps, args=(first, last))
            worker.start()
            worker.join()
        optimizer.wait()
        return logged, [p.detach().clone() for p in model.parameters()]
    assert not differs(train_in_threads(False), train_in_threads(True))


# ---------------------------------------------------------------- found by a review: each broke the promise once
def overlapped_pair(build=SequentialBlocks, delay_us=3000, **fields):
    """The same model and optimizer twice: plain, and overlapped with long
    copy and compute delays (reads that do not wait see old values)."""
    pair = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = build()
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        optimizer = so.SwapOptimizer(inner, swap_times=6, num_arenas=3, min_numel=0, **fields, **extra)
        if overlap:
            optimizer._set_test_hooks(copy_delay_us=delay_us, compute_delay_us=1000, seed=5)
        pair.append((model, optimizer))
    return pair


def train_step(model, optimizer, step):
    optimizer.zero_grad()
    loss = loss_of(model, tokens_for(step))
    loss.backward()
    optimizer.step()
    return loss.detach()


def assert_models_equal(pair):
    for _, optimizer in pair:
        optimizer.wait()
    (model_a, _), (model_b, _) = pair
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(p, q), f"{name} differs"


def test_assigning_data_right_after_step_keeps_the_new_tensor():
    """`p.data = t` (an EMA swapped in for evaluation) right after step():
    the pending update must land in the old storage, not in t."""
    for model, optimizer in overlapped_pair():
        for step in range(3):
            train_step(model, optimizer, step)
        replacement = torch.full(model.head.weight.shape, 7.0)  # full_like(param) would wait: an op on it
        trained = model.head.weight.data
        model.head.weight.data = replacement
        optimizer.wait()
        assert torch.equal(replacement, torch.full_like(replacement, 7.0))
        model.head.weight.data = trained


@pytest.mark.parametrize("change", ["extend_by_hand", "reassign"])
def test_param_groups_changed_between_overlapped_steps(change):
    """Params unfrozen by appending to param_groups by hand (Lightning's
    finetuning callbacks), or groups reassigned: the store is rebuilt, the
    next pass probes again, bitwise."""
    pair = overlapped_pair(lambda: SequentialBlocks(blocks=3))
    losses = []
    for model, optimizer in pair:
        head = list(model.head.parameters())
        optimizer.param_groups[0]["params"] = [p for p in model.parameters() if all(p is not q for q in head)]
        optimizer.param_groups[:] = list(optimizer.param_groups)
        logged = []
        for step in range(6):
            if change == "extend_by_hand" and step == 3:
                optimizer.param_groups[0]["params"].extend(head)
            if change == "reassign" and step == 3:
                optimizer.param_groups = [{**optimizer.param_groups[0], "params": list(model.parameters())}]
            logged.append(train_step(model, optimizer, step))
        losses.append(torch.stack(logged))
    assert torch.equal(*losses)
    assert_models_equal(pair)


class HeadFirst(SequentialBlocks):
    """The head's weight read as the input embedding, inside the model's call:
    a read only the probe can place."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.extra = nn.Parameter(torch.zeros(()))

    def forward(self, tokens):
        x = nn.functional.embedding(tokens, self.head.weight)
        for block in self.blocks:
            x = block(x)
        return self.head(x) + self.extra


def test_groups_reordered_and_added_while_the_probe_records():
    """The probe records reads by param index; groups reordered and a group
    added during its pass rebuild the store, so that record is dropped and
    the next pass probes again: bitwise."""
    losses = []
    pair = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = HeadFirst()
        rest = [p for name, p in model.named_parameters() if not name.startswith("head") and name != "extra"]
        inner = torch.optim.AdamW([{"params": [model.head.weight], "lr": 1e-2}, {"params": rest}], lr=3e-3)
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        optimizer = so.SwapOptimizer(inner, swap_times=6, num_arenas=3, min_numel=0, **extra)
        if overlap:
            optimizer._set_test_hooks(copy_delay_us=3000, compute_delay_us=1000, seed=5)
        logged = []
        for step in range(6):
            logged.append(train_step(model, optimizer, step))
            if step == 0:
                optimizer.param_groups = [optimizer.param_groups[1], optimizer.param_groups[0]]
                optimizer.add_param_group({"params": [model.extra]})
            if overlap and step == 1:  # the record of the old layout was dropped: this pass probes anew
                assert optimizer._overlap.probing and not optimizer._overlap.pending
        losses.append(torch.stack(logged))
        pair.append((model, optimizer))
    assert torch.equal(*losses)
    assert_models_equal(pair)


def test_ctrl_c_in_the_forward_lets_a_checkpoint_see_the_update():
    """A real Ctrl-C (SIGINT) landing in the forward, where nothing else
    would wait: the handler waits for the step before KeyboardInterrupt is
    raised, so a checkpoint taken in `except KeyboardInterrupt` is current."""
    import signal

    class Interruptible(SequentialBlocks):
        interrupt = False

        def forward(self, tokens):
            x = self.embed(tokens)
            if self.interrupt:
                signal.raise_signal(signal.SIGINT)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    checkpoints = []
    for model, optimizer in overlapped_pair(Interruptible):
        for step in range(3):
            train_step(model, optimizer, step)
        model.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            loss_of(model, tokens_for(3))
        checkpoints.append({name: t.clone() for name, t in model.state_dict().items()})
    for name in checkpoints[0]:
        assert torch.equal(checkpoints[0][name], checkpoints[1][name]), name


def test_ctrl_c_during_a_forward_wait_keeps_the_rest_waiting():
    """A Ctrl-C while a module call waits (raised from the update thread, as a
    signal may land on any thread): the state saved in `except` is current,
    and the run resumed after it trains bitwise like the plain one."""
    pair = overlapped_pair()
    plain_model, plain = pair[0]
    model, optimizer = pair[1]
    for step in range(3):
        train_step(plain_model, plain, step)
        train_step(model, optimizer, step)
    optimizer._set_test_hooks(fault="interrupt", fault_batch=3, copy_delay_us=3000, seed=1)
    optimizer.zero_grad()
    plain.zero_grad()
    loss_of(model, tokens_for(3)).backward()
    loss_of(plain_model, tokens_for(3)).backward()
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()
        loss_of(model, tokens_for(4))
    plain.step()
    saved = {name: t.clone() for name, t in model.state_dict().items()}
    plain.wait()
    for name, value in plain_model.state_dict().items():
        assert torch.equal(saved[name], value), name
    optimizer._set_test_hooks(copy_delay_us=3000, seed=2)
    for step in range(4, 7):
        train_step(plain_model, plain, step)
        train_step(model, optimizer, step)
    assert_models_equal(pair)


def test_a_preemption_handler_saving_mid_forward_sees_the_update():
    """A SIGUSR1 handler (a cluster's preemption notice) installed after the
    optimizer was made saves the model while the forward runs: it waits first."""
    import signal
    saved = []

    class Preempted(SequentialBlocks):
        preempt = False

        def forward(self, tokens):
            x = self.embed(tokens)
            if self.preempt:
                signal.raise_signal(signal.SIGUSR1)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    previous = signal.getsignal(signal.SIGUSR1)
    try:
        for model, optimizer in overlapped_pair(Preempted):
            signal.signal(signal.SIGUSR1, lambda signum, frame: saved.append(
                {name: t.clone() for name, t in model.state_dict().items()}))
            for step in range(3):
                train_step(model, optimizer, step)
            model.preempt = True
            loss_of(model, tokens_for(3))
            optimizer.wait()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    for name in saved[0]:
        assert torch.equal(saved[0][name], saved[1][name]), name


@pytest.mark.parametrize("landing", [("call", "after_step"), ("return", "_reset_pass")])
def test_a_signal_while_step_returns_waits_for_the_step_just_enqueued(landing):
    """A preemption signal whose handler saves the model lands after the
    runtime enqueued the deferred step but before its pass began: as the pass
    starts, or once the old pass is reset (a real signal may land at any
    bytecode; a profile hook lands it there each time): the handler still
    waits, and saves the stepped model."""
    import signal
    import sys
    saved = []
    armed = [False]

    def signal_at_pass_start(frame, event, arg):
        if (event, frame.f_code.co_name) == landing and armed[0]:
            armed[0] = False
            signal.raise_signal(signal.SIGUSR1)

    previous = signal.getsignal(signal.SIGUSR1)
    try:
        for model, optimizer in overlapped_pair():
            signal.signal(signal.SIGUSR1, lambda signum, frame: saved.append(
                {name: t.clone() for name, t in model.state_dict().items()}))
            for step in range(3):
                train_step(model, optimizer, step)
            armed[0] = True
            before = len(saved)
            sys.setprofile(signal_at_pass_start)
            try:
                train_step(model, optimizer, 3)
            finally:
                sys.setprofile(None)
            if len(saved) == before:  # the plain optimizer has no pass: the signal lands right after its step
                signal.raise_signal(signal.SIGUSR1)
            optimizer.wait()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert len(saved) == 2
    for name in saved[0]:
        assert torch.equal(saved[0][name], saved[1][name]), name


def test_signal_handlers_are_wrapped_once_however_many_steps_run():
    """Each overlapped step holds signals while it updates, and wraps their
    handlers so that they wait for the pending step: the wrapper goes around
    the user's handler once, not once more a step (a thousand steps nested a
    thousand wrappers, and Ctrl-C raised RecursionError), and dropping the
    optimizer gives the user's handler back."""
    import gc
    import signal

    def depth(handler):
        layers = 0
        while hasattr(handler, "handler"):
            handler, layers = handler.handler, layers + 1
        return layers, handler

    def users_handler(signum, frame):
        return None

    previous = signal.getsignal(signal.SIGUSR1)
    try:
        signal.signal(signal.SIGUSR1, users_handler)
        model, optimizer = overlapped_pair(delay_us=0)[1]
        for step in range(6):
            train_step(model, optimizer, step)
            # (the first step is the probe's, run whole: nothing is pending after it, nothing wrapped)
            assert depth(signal.getsignal(signal.SIGUSR1)) == (int(step > 0), users_handler), f"step {step}"
        optimizer.wait()
        del optimizer
        gc.collect()
        assert signal.getsignal(signal.SIGUSR1) is users_handler
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_signal_inside_another_handlers_wait_waits_too():
    """A second signal (a checkpoint-on-signal handler) lands while the first
    one's wrapper is about to wait for the pending step: the second waits as
    well, and saves the stepped model."""
    import signal
    import sys
    saved = []
    armed = [False]

    def nested_signal_at_the_wait(frame, event, arg):
        if armed[0] and event == "c_call" and getattr(arg, "__name__", "") == "wait_step" \
                and frame.f_code.co_name == "finish_for_signal":
            armed[0] = False
            signal.raise_signal(signal.SIGUSR2)

    previous = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    try:
        signal.signal(signal.SIGUSR1, lambda signum, frame: None)
        for model, optimizer in overlapped_pair():
            signal.signal(signal.SIGUSR2, lambda signum, frame: saved.append(
                {name: t.clone() for name, t in model.state_dict().items()}))
            for step in range(3):
                train_step(model, optimizer, step)
            before = len(saved)
            armed[0] = True
            sys.setprofile(nested_signal_at_the_wait)
            try:
                signal.raise_signal(signal.SIGUSR1)
            finally:
                sys.setprofile(None)
            if len(saved) == before:  # the plain optimizer: nothing pending, no wait to land in
                signal.raise_signal(signal.SIGUSR2)
            optimizer.wait()
    finally:
        signal.signal(signal.SIGUSR1, previous[0])
        signal.signal(signal.SIGUSR2, previous[1])
    assert len(saved) == 2
    for name in saved[0]:
        assert torch.equal(saved[0][name], saved[1][name]), name


def test_ctrl_c_while_the_watch_is_pushed_leaves_no_watch_behind():
    """A Ctrl-C caught by the user (a notebook) lands just as step() puts the
    watch on the mode stack: the watch still comes off at the next wait, and
    training goes on bitwise."""
    import signal
    import sys
    armed = [False]

    def interrupt_after_the_insert(frame, event, arg):
        if armed[0] and event == "return" and frame.f_code.co_name == "_insert_mode" \
                and frame.f_back.f_code.co_name == "_push_watch":
            armed[0] = False
            signal.raise_signal(signal.SIGINT)

    pair = overlapped_pair()
    for model, optimizer in pair:
        for step in range(3):
            train_step(model, optimizer, step)
        armed[0] = optimizer._overlap is not None
        sys.setprofile(interrupt_after_the_insert)
        try:
            train_step(model, optimizer, 3)
        except KeyboardInterrupt:
            assert optimizer._overlap is not None
        finally:
            sys.setprofile(None)
        optimizer.wait()
        assert torch._C._len_torch_function_stack() == 0
        for step in range(4, 6):
            train_step(model, optimizer, step)
    assert_models_equal(pair)


def test_a_param_outside_the_model_is_refused_before_the_state_changes():
    """A param the model does not hold, appended to param_groups mid-run:
    step() refuses it before building anything, so once it is removed the
    state (step counts, moments) goes on exactly as without it."""
    states = []
    for model, optimizer in overlapped_pair():
        for step in range(3):
            train_step(model, optimizer, step)
        optimizer.zero_grad()
        loss_of(model, tokens_for(3)).backward()
        if optimizer._overlap is not None:
            foreign = nn.Parameter(torch.ones(3))
            foreign.grad = torch.ones(3)
            optimizer.param_groups[0]["params"].append(foreign)
            with pytest.raises(ValueError, match="not in the model"):
                optimizer.step()
            optimizer.param_groups[0]["params"].pop()
        for step in range(4, 7):
            train_step(model, optimizer, step)
        optimizer.wait()
        states.append(optimizer.state_dict()["state"])
    for index, entry in states[0].items():
        for key, value in entry.items():
            assert torch.equal(value, states[1][index][key]), (index, key)


def test_step_inside_a_device_context():
    """`with torch.device(...)` around the loop (its exit pops the top of the
    mode stack): the watch sits below it, so norms logged after the block are
    current, and nothing is left behind."""
    norms = []
    for model, optimizer in overlapped_pair():
        for step in range(4):
            with torch.device("cpu"):
                train_step(model, optimizer, step)
            norms.append(torch.stack([p.norm() for p in model.parameters()]))
    assert torch.equal(torch.stack(norms[:4]), torch.stack(norms[4:]))


def test_forward_on_another_thread_than_step():
    """The forward and backward on a worker thread, step() and norm logging on
    the main one: the probe sees no read inside the model's calls, so the
    steps complete inside step() (with a warning), bitwise."""
    import threading

    class TiedInput(SequentialBlocks):
        """The head's weight read as the input embedding, inside the model's call."""

        def forward(self, tokens):
            x = nn.functional.embedding(tokens, self.head.weight)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    logged = []
    for model, optimizer in overlapped_pair(TiedInput):
        run_logged = []
        for step in range(5):
            box = {}

            def forward_backward():
                optimizer.zero_grad()
                box["loss"] = loss_of(model, tokens_for(step))
                box["loss"].backward()
            worker = threading.Thread(target=forward_backward)
            worker.start()
            worker.join()
            with warnings.catch_warnings():  # the probe's note that it saw no read
                warnings.simplefilter("ignore")
                optimizer.step()
            run_logged.append(box["loss"].detach())
            if step == 0:  # norms logged in the probe's pass: reads, but not inside the model's calls
                run_logged.append(torch.stack([p.norm() for p in model.parameters()]))
        logged.append(run_logged)
    assert all(torch.equal(a, b) for a, b in zip(*logged))


def test_weights_tied_after_the_probe():
    """Tying the embedding to the head after the probe (a late tie_weights()):
    the params the modules hold changed, so the next pass waits for the whole
    step at its first call and probes again."""
    class Untied(SequentialBlocks):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    pair = overlapped_pair(Untied)
    for model, optimizer in pair:
        for step in range(6):
            if step == 3:
                model.embed.weight = model.head.weight
            train_step(model, optimizer, step)
    assert_models_equal(pair)


def test_printing_a_param_right_after_step_shows_the_update():
    texts = []
    for model, optimizer in overlapped_pair():
        for step in range(3):
            train_step(model, optimizer, step)
        texts.append((repr(model.head.weight), f"{model.head.bias[0]:.6f}"))
    assert texts[0] == texts[1]


def test_steps_moved_to_a_worker_thread_leave_nothing_on_the_first():
    """Steps on the main thread, then on a worker: the watch left on the main
    thread's stack is taken off by the main thread's next module call."""
    import threading
    pair = overlapped_pair()
    for model, optimizer in pair:
        for step in range(3):
            train_step(model, optimizer, step)
        norms = torch.stack([p.norm() for p in model.parameters()])  # the pass ends inside the watch's call
        worker = threading.Thread(target=lambda: [train_step(model, optimizer, step) for step in range(3, 5)])
        worker.start()
        worker.join()
        optimizer.wait()
        loss_of(model, tokens_for(9))  # a module call on the main thread
        assert torch._C._len_torch_function_stack() == 0
        assert norms.isfinite().all()
    assert_models_equal(pair)
