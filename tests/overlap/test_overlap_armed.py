"""overlap_forward=True with an armed pass: while a deferred step is pending,
its params and the grads it reads watch themselves (PendingParameter,
PendingTensor), with no global hook and no read watch. What the rest of
tests/overlap checks under both watches (bitwise training, each wait needed)
is not repeated here: these are the armed pass's own rules. On the host
backend; delayed updates make a missed wait change bits."""

import copy
import io
import pickle
import threading

import pytest
import torch
from torch import nn

import swap_optimizer as so
from swap_optimizer.overlap.armed import PendingParameter, PendingTensor
from test_overlap import overlap_hooks_on

WIDTH = 32
pytestmark = pytest.mark.usefixtures("overlap_may_arm")


class Blocks(nn.Module):
    def __init__(self, blocks=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def make(overlap=True, delay_us=3000, **fields):
    torch.manual_seed(0)
    model = Blocks()
    extra = dict(model=model, overlap_forward=True) if overlap else {}
    optimizer = so.SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), swap_times=8, num_arenas=2,
                                 min_numel=0, **fields, **extra)
    if overlap:  # the updates lag far behind the ops that read params
        optimizer._set_test_hooks(copy_delay_us=delay_us, compute_delay_us=delay_us, seed=3)
    return model, optimizer


def inputs(step):
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))


def train_step(model, optimizer, step):
    optimizer.zero_grad()
    loss = model(inputs(step)).square().mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def plain_and_pending():
    """A run without overlap after two steps, then an overlapped one whose
    second step is pending, its updates about 0.8 s long (the plain one
    first: any backward waits for every armed step)."""
    plain_model, plain = make(overlap=False)
    for step in range(2):
        train_step(plain_model, plain, step)
    model, optimizer = make()
    for step in range(2):
        if step == 1:
            optimizer._set_test_hooks(compute_delay_us=200_000, seed=3)
        train_step(model, optimizer, step)
    return plain_model, plain, model, optimizer


def params_after(model, optimizer):
    optimizer.wait()
    return [p.detach().clone() for p in model.parameters()]


def positions(optimizer):
    """Per param, the pipeline position that holds its last piece."""
    return optimizer._overlap._param_positions


def test_another_models_forward_leaves_the_pass_armed_and_its_own_gives_back_in_order():
    """While a step is pending its params are PendingParameters and its grads
    PendingTensors; hooks are off and no mode is on the stack. Another
    model's forward touches none of them: the pass stays armed. An op on a
    param waits for its position and gives back every tensor up to it, no
    further; the own forward gives back the rest and ends the pass. Bitwise
    like overlap off."""
    model, optimizer = make()
    plain_model, plain = make(overlap=False)
    other = Blocks()
    for step in range(2):  # (first: any backward waits for every armed step, another model's too)
        train_step(plain_model, plain, step)
    for step in range(2):
        if step == 1:  # about 0.8 s of updates: the step is still in flight at the reads below
            optimizer._set_test_hooks(compute_delay_us=200_000, seed=3)
        train_step(model, optimizer, step)
    params = list(model.parameters())
    assert optimizer._overlap.pending and optimizer._overlap._armed is not None
    assert all(type(p) is PendingParameter for p in params) and all(type(p.grad) is PendingTensor for p in params)
    assert overlap_hooks_on() == (False, False) and torch._C._len_torch_function_stack() == 0
    with torch.no_grad():
        other(inputs(7))
    assert all(type(p) is PendingParameter for p in params)
    middle = max(range(len(params)), key=lambda i: (positions(optimizer)[i] < max(positions(optimizer)),
                                                  positions(optimizer)[i]))
    reached = positions(optimizer)[middle]
    assert 0 < reached < max(positions(optimizer))
    read = params[middle].sum()  # waits for `reached`, gives back through it
    assert [type(p) is nn.Parameter for p in params] == [positions(optimizer)[i] <= reached
                                                         for i in range(len(params))]
    assert optimizer._overlap.pending
    with torch.no_grad():
        out = model(inputs(8))
    assert not optimizer._overlap.pending and all(type(p) is nn.Parameter for p in params)
    assert all(type(p.grad) is torch.Tensor for p in params)
    with torch.no_grad():
        assert torch.equal(read, plain_model.get_parameter(
            [name for name, p in model.named_parameters()][middle]).sum())
        assert torch.equal(out, plain_model(inputs(8)))
    assert all(torch.equal(a, b) for a, b in zip(params_after(model, optimizer), params_after(plain_model, plain)))


@pytest.mark.parametrize("alias", ["data", "T", "detach"])
def test_metadata_reads_wait_for_nothing_and_aliases_wait(alias):
    """Shapes, dtypes, p.grad and setting p.grad = None read no data: the
    pass stays armed. An attribute or method that hands out an alias of the
    data (p.data, p.T, p.detach()) waits: the alias is a plain tensor whose
    reads nothing would see."""
    plain_model, plain, model, optimizer = plain_and_pending()
    p = next(model.parameters())
    assert p.shape == (WIDTH, WIDTH) and p.dtype == torch.float32 and p.dim() == 2 and p.numel() == WIDTH * WIDTH
    assert p.grad is not None and p.requires_grad and p.is_leaf
    p.grad = None
    assert type(p) is PendingParameter and optimizer._overlap.pending
    got = p.data if alias == "data" else p.T.T if alias == "T" else p.detach()
    assert type(p) is nn.Parameter and type(got) is torch.Tensor
    assert torch.equal(got, next(plain_model.parameters()))
    optimizer.wait()


class Tagged(torch.Tensor):
    """A tensor subclass with a handler of its own: it runs every op itself,
    subclasses' handlers off (torch's default handler would return
    NotImplemented for an op that holds a PendingParameter)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["alias", "view_of_grads", "param_subclass", "subclass_inputs", "unseen_read"])
def test_a_pass_that_could_miss_a_read_keeps_the_hooks_and_the_read_watch(kind):
    """A pass is armed only where every read reaches an armed tensor: not
    with an alias of a param kept from before the step (its reads would not),
    grads that share one storage, a param of another class, where the probe
    saw an op on a param beside a tensor subclass with a handler of its own
    (torch calls the input's handler first, which runs the op past the
    param's), or a param first read (as the probe saw) after its module's
    call began, which read it where no handler sees (only the static rule
    waits there). Those passes keep the hooks and the read watch, bitwise."""
    class OwnParameter(nn.Parameter):
        pass

    def run(overlap):
        model, optimizer = make(overlap=overlap)
        if kind == "unseen_read":
            model.blocks[0][0].forward = UnseenRead(model.blocks[0][0], model.blocks[1][1])
        if kind == "param_subclass":
            block = model.blocks[1][0]
            block.weight = OwnParameter(block.weight.detach().clone())
            model, optimizer = model, so.SwapOptimizer(
                torch.optim.AdamW(model.parameters(), lr=1e-2), swap_times=8, num_arenas=2, min_numel=0,
                **(dict(model=model, overlap_forward=True) if overlap else {}))
            if overlap:
                optimizer._set_test_hooks(copy_delay_us=3000, compute_delay_us=3000, seed=3)
        kept = [p.detach() for p in model.parameters()] if kind == "alias" else None
        flat = torch.zeros(sum(p.numel() for p in model.parameters())) if kind == "view_of_grads" else None
        logged = []
        for step in range(4):
            optimizer.zero_grad()
            x = inputs(step).as_subclass(Tagged) if kind == "subclass_inputs" else inputs(step)
            model(x).square().mean().backward()
            if flat is not None:  # every grad a view of one buffer (as DDP's bucket views are)
                offset = 0
                for p in model.parameters():
                    flat[offset:offset + p.numel()].copy_(p.grad.flatten())
                    p.grad = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
            optimizer.step()
            if overlap and step >= 1:
                assert optimizer._overlap.pending and optimizer._overlap._armed is None
                assert overlap_hooks_on() == (True, True)
            if kept is not None:
                logged.append(torch.stack([k.sum() for k in kept]))  # reads through the aliases wait
        return logged + params_after(model, optimizer)

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False), strict=True))


class UnseenRead:
    """A Linear's forward that reads its params where no handler or mode
    sees (as a C++ extension handed the tensors would), then once more
    visibly, after a call of another module of the model."""

    def __init__(self, linear, after):
        self.linear, self.after = linear, after

    def __call__(self, x):
        with torch._C.DisableTorchFunction():
            y = nn.functional.linear(x, self.linear.weight, self.linear.bias)
        return self.after(y) + 0 * (self.linear.weight.sum() + self.linear.bias.sum())


def test_copies_and_pickles_of_armed_tensors_wait_and_are_plain():
    """copy.deepcopy, pickle and torch.save of a pending param or grad wait
    for its update and give an nn.Parameter (a Tensor), never a
    PendingParameter; a deepcopy of the whole model too. (Each on a later
    position than the last: a wait gives back every tensor up to its own.)"""
    plain_model, plain, model, optimizer = plain_and_pending()
    params, expected = list(model.parameters()), list(plain_model.parameters())
    by_position = sorted(range(len(params)), key=lambda i: positions(optimizer)[i])
    assert len(set(positions(optimizer))) == len(params)  # (one param a batch)

    def saved(tensor):
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    copies = [("pickle", lambda t: pickle.loads(pickle.dumps(t))), ("deepcopy", copy.deepcopy), ("save", saved)]
    for (how, make_copy), i in zip(copies, by_position):
        grad = params[i].grad
        assert type(grad) is PendingTensor, how
        copied = make_copy(grad)
        assert type(copied) is torch.Tensor, how
    for (how, make_copy), i in zip(copies, by_position[len(copies):]):
        assert type(params[i]) is PendingParameter, how
        copied = make_copy(params[i])
        assert type(copied) is nn.Parameter and torch.equal(copied, expected[i]), how
    assert optimizer._overlap.pending
    twin = copy.deepcopy(model)
    assert all(type(p) is nn.Parameter for p in twin.parameters())
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), plain_model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(params_after(model, optimizer), params_after(plain_model, plain)))


def test_an_op_on_another_thread_waits_too():
    """The class is the tensor's, so a read on any thread waits (the read
    watch sees only the stepping thread's ops)."""
    plain_model, plain, model, optimizer = plain_and_pending()
    assert optimizer._overlap.pending and optimizer._overlap._armed is not None
    seen = []
    reader = threading.Thread(target=lambda: seen.append([p.detach().clone() for p in model.parameters()]))
    reader.start()
    reader.join()
    assert all(torch.equal(a, b) for a, b in zip(seen[0], plain_model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params_after(model, optimizer), params_after(plain_model, plain)))


@pytest.mark.slow
def test_a_model_compiled_while_a_pass_is_armed_waits_and_arms_no_more():
    """torch.compile(model) made after the probe, while a pass is armed: its
    first compile reads the params through ops that wait as it builds its
    inputs (step 1's updates outlast the trace), and no later pass arms (a
    compiled frame's guards on their class would compile it again at every
    pass). Bitwise like the same loop without overlap."""
    def run(overlap):
        model, optimizer = make(overlap=overlap)
        compiled, armed = None, []
        for step in range(5):
            if overlap and step in (1, 2):  # step 1's updates (about 4 s) outlast the trace at step 2
                optimizer._set_test_hooks(compute_delay_us=1_000_000 if step == 1 else 3000, seed=3)
            if step == 2:
                compiled = torch.compile(model)
            optimizer.zero_grad()
            (model if compiled is None else compiled)(inputs(step)).square().mean().backward()
            optimizer.step()
            armed.append(overlap and optimizer._overlap._armed is not None)
        return armed, params_after(model, optimizer)

    armed, overlapped = run(True)  # (first: nothing compiled in this process yet)
    assert armed == [False, True, False, False, False]
    _, plain = run(False)
    assert all(torch.equal(a, b) for a, b in zip(overlapped, plain, strict=True))
