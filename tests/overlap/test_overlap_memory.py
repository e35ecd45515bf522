"""What a deferred step (overlap_forward=True) holds, and when it lets go.

The step holds each param's grad until a wait covers the last batch that
reads it: runtime.wait_ready(position) drops the grads of every param whose
last batch is at that position or before (a param cut across batches after
its last piece), wait() the rest. memory_stats()["held_grad_bytes"] says how
many grad bytes it still holds, and "staging_bytes" counts the arenas until
the step is waited for. The waits here are called directly (the model's hooks
call the same ones). On the host backend the update thread runs the pipeline
while these waits release grads: random delays on the copies and before each
update make it lag, so a grad dropped while a later batch still needed it
would fail the step, and the results are compared bitwise with a run without
overlap. Host backend only: on CUDA the releases are stream ordered, which
the GPU check's peak-memory stage measures.
"""

import pytest
import torch
from torch import nn

import swap_optimizer as so

VOCAB, WIDTH = 512, 64


class Stack(nn.Module):
    """An embedding and a head large enough to be cut across batches, four
    blocks, and a frozen layer (no grad: nothing to hold)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(4))
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.frozen(x))


def build():
    torch.manual_seed(0)
    return Stack()


def loss_of(model, step):
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (8, 16), generator=generator)
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), torch.roll(tokens, -1, 1).reshape(-1))


def make_optimizer(model, overlap, watch_ops=False, **fields):
    """After a first step (with overlap, the probe, which runs whole), so that
    the next step is deferred. Unless watch_ops, ops outside the model's calls
    are not watched: these tests read grads' use counts while a step is
    pending, and call the runtime's waits themselves."""
    extra = dict(model=model, overlap_forward=True) if overlap else {}
    optimizer = so.SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), swap_times=6,
                                 num_arenas=3, min_numel=0, **fields, **extra)
    assert optimizer.memory_stats()["split_params"] == 2, "the embedding and the head are cut across batches"
    if overlap and not watch_ops:
        optimizer._overlap.set_test_hooks(unguarded={"ops"})
    loss_of(model, -1).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert not overlap or optimizer._overlap.schedule is None and optimizer._overlap.probing
    return optimizer


def last_positions(optimizer):
    """Param index -> the pipeline position of the last batch holding it."""
    last = {}
    for position, batch in enumerate(optimizer._batch_layout()):
        for index in batch["params"]:
            last[index] = position
    return last


def grad_bytes(model):
    return [0 if p.grad is None else p.grad.numel() * p.grad.element_size() for p in model.parameters()]


def test_a_wait_lets_go_of_the_grads_whose_last_batch_it_covers():
    model = build()
    optimizer = make_optimizer(model, overlap=True)
    runtime = optimizer._runtime
    params = list(model.parameters())
    head = next(i for i, p in enumerate(params) if p is model.head.weight)
    frozen = next(i for i, p in enumerate(params) if p is model.frozen.weight)
    loss_of(model, 0).backward()
    sizes = grad_bytes(model)
    assert sizes[frozen] == 0 and sizes[head] > 0
    grads = [p.grad for p in params]
    uses = [None if g is None else g._use_count() for g in grads]
    optimizer.step()
    # The step holds each grad (the update thread may hold one more while it reads it).
    assert all(g._use_count() >= u + 1 for g, u in zip(grads, uses) if g is not None)
    assert optimizer.memory_stats()["held_grad_bytes"] == sum(sizes)
    optimizer.zero_grad(set_to_none=True)  # from here only `grads` and the step hold them
    uses = [None if u is None else u - 1 for u in uses]

    last = last_positions(optimizer)
    # The head's weight is cut across batches, the first of which follows
    # others: waiting for it releases those, not the head's grad, which its
    # later pieces still read.
    pieces = [position for position, batch in enumerate(optimizer._batch_layout()) if head in batch["params"]]
    assert len(pieces) >= 2 and pieces[0] > 0
    middle = pieces[0]
    runtime.wait_ready(middle)
    held = sum(size for index, size in enumerate(sizes) if last[index] > middle)
    assert 0 < held < sum(sizes)
    assert optimizer.memory_stats()["held_grad_bytes"] == held
    for index, grad in enumerate(grads):
        if grad is None:
            continue
        if last[index] > middle:  # held (the update thread may hold one more while it reads it)
            assert grad._use_count() >= uses[index] + 1, f"param {index}"
        else:  # let go, and never touched again
            assert grad._use_count() == uses[index], f"param {index}"

    runtime.wait_ready(pieces[-1])
    assert grads[head]._use_count() == uses[head]
    runtime.wait_ready(max(last.values()))
    assert optimizer.memory_stats()["held_grad_bytes"] == 0
    assert all(g is None or g._use_count() == u for g, u in zip(grads, uses))
    optimizer.wait()
    assert optimizer.memory_stats()["held_grad_bytes"] == 0


@pytest.mark.parametrize("keep_arenas", [False, True])
def test_staging_is_counted_until_the_step_is_waited_for(keep_arenas):
    model = build()
    optimizer = make_optimizer(model, overlap=True, keep_arenas=keep_arenas)
    loss_of(model, 0).backward()
    optimizer.step()
    stats = optimizer.memory_stats()
    assert stats["staging_bytes"] == stats["peak_staging_bytes"] > 0
    optimizer._runtime.wait_ready(stats["batches"] - 1)  # every update has run; the copies out may not have
    assert optimizer.memory_stats()["staging_bytes"] == stats["peak_staging_bytes"]
    optimizer.wait()
    assert optimizer.memory_stats()["staging_bytes"] == (stats["peak_staging_bytes"] if keep_arenas else 0)
    assert optimizer.memory_stats()["held_grad_bytes"] == 0


def test_releasing_grads_while_the_update_thread_runs_changes_no_bit():
    """After each step, wait for every position in turn while the update thread
    lags behind (copy and compute delays): each wait releases grads while later
    batches are still being updated. The result is bitwise the plain run's."""
    runs = []
    for overlap in (False, True):
        model = build()
        optimizer = make_optimizer(model, overlap, watch_ops=True)
        optimizer._set_test_hooks(copy_delay_us=200, compute_delay_us=400, seed=3)
        positions = len(optimizer._batch_layout())
        for step in range(4):
            optimizer.zero_grad(set_to_none=True)
            loss_of(model, step).backward()
            optimizer.step()
            if overlap:
                held = optimizer.memory_stats()["held_grad_bytes"]
                for position in range(positions):
                    optimizer._runtime.wait_ready(position)
                    now = optimizer.memory_stats()["held_grad_bytes"]
                    assert now <= held
                    held = now
                assert held == 0
        optimizer.wait()
        runs.append(([p.detach().clone() for p in model.parameters()],
                     [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()
                      if p in optimizer.state]))
    (params_off, states_off), (params_on, states_on) = runs
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_on))
    assert len(states_off) == len(states_on)
    for a, b in zip(states_off, states_on):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_failed_deferred_step_holds_nothing_once_raised():
    model = build()
    optimizer = make_optimizer(model, overlap=True)
    positions = len(optimizer._batch_layout())
    optimizer._set_test_hooks(fault="update", fault_batch=positions // 2)
    loss_of(model, 0).backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="injected test fault"):
        optimizer._runtime.wait_ready(positions - 1)
    stats = optimizer.memory_stats()
    assert stats["held_grad_bytes"] == 0 and stats["staging_bytes"] == 0
