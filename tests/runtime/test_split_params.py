"""Params split across batches: a model whose largest param (an embedding) is
almost all of the state. The staging then follows swap_times, not the largest
tensor; results stay bitwise identical across swap_times, num_arenas and split
points, and within rtol 1e-5, atol 1e-6 of torch's AdamW (fp32, a few steps of
training); a fault inside a split param leaves every element with its states
either old or new; interrupts stop only at param boundaries.
"""

# The budget, GradScaler-in-step, fault and interrupt tests below run the
# packed kernel (PACKED_KERNEL): they pin its store layout, its step table and
# its signal timing; torch's update has its own (test_rules.py, the case table).

import functools
import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.testing import assert_close

import swap_optimizer as so
from conftest import PACKED_KERNEL, DEVICES
from swap_training import round_trip

TRAIN_TOL = dict(rtol=1e-5, atol=1e-6)
MIN_PIECE_BYTES = 64 << 10  # kMinPieceBytes in csrc/runtime/store_layout.h
GRANULE = 256               # pieces start at multiples of this many elements
STEPS = 5


class EmbeddingModel(nn.Module):
    """Params in order: pre (1536 + 48), embed (144,000: 96% of the swapped state; param 2), mid
    (3072 + 64), a LayerNorm, head (640 + 10). The embedding sits between
    swappable params, so batches hold its pieces beside whole params."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(32, 48)
        self.embed = nn.Embedding(3000, 48)
        self.mid = nn.Linear(48, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 10)

    def forward(self, tokens, x):
        h = self.embed(tokens).mean(1) + self.pre(x)
        return self.head(self.norm(torch.relu(self.mid(h))))


def build(device, dtype=torch.float32):
    torch.manual_seed(0)
    return EmbeddingModel().to(device=device, dtype=dtype)


def loss_of(model, step, device):
    rng = np.random.default_rng([11, step])
    tokens = torch.from_numpy(rng.integers(0, 3000, (32, 64))).to(device)  # touches most rows
    x = torch.from_numpy(rng.standard_normal((32, 32), dtype=np.float32)).to(device)
    y = torch.from_numpy(rng.integers(0, 10, 32)).to(device)
    dtype = next(model.parameters()).dtype
    return nn.functional.cross_entropy(model(tokens, x.to(dtype)).float(), y)


def train(model, optimizer, steps, device, first_step=0, twin=None):
    """Trains `steps` steps; a `twin` (model, optimizer) starting from the same
    params is stepped with the same grads, so the two differ only by the
    optimizers' rounding, not by training amplifying it."""
    for step in range(first_step, first_step + steps):
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, step, device).backward()
        optimizer.step()
        if twin is not None:
            for p, q in zip(model.parameters(), twin[0].parameters()):
                q.grad = p.grad.clone()
            twin[1].step()


def plain_twin(model, cls=None, **flags):
    """A copy of `model` with a plain torch optimizer (single-tensor path)."""
    twin = build(next(model.parameters()).device)
    twin.load_state_dict(model.state_dict())
    return twin, (cls or torch.optim.AdamW)(twin.parameters(), lr=3e-3, betas=(0.9, 0.99), foreach=False, **flags)


def adamw(params, **flags):
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1, **flags)


def snapshot(optimizer, model):
    params = [p.detach().clone() for p in model.parameters()]
    states = [{k: v.detach().clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    return params, states


def swapped_state_bytes(model, per_element=8):
    """The swapped params' states as their arenas hold them (each state aligned to 256 bytes)."""
    up = lambda n: -(-n // 256) * 256  # noqa: E731
    return sum(2 * up(p.numel() * per_element // 2) for p in model.parameters() if p.numel() >= 1024)


def check_pieces(plan, model):
    """Every param's elements appear once, in order, in pieces that start at
    multiples of the granule; each batch needs a few copies each way."""
    numels = [p.numel() for p in model.parameters()]
    seen = {}
    for batch in plan:
        assert batch["params"] == [piece[0] for piece in batch["pieces"]]
        assert batch["host_copies"] <= 5
        for param, offset, count in batch["pieces"]:
            assert offset == seen.get(param, 0) and offset % GRANULE == 0 and count > 0
            seen[param] = offset + count
    assert seen == dict(enumerate(numels))


@functools.lru_cache(maxsize=None)
def run(device, swap_times, num_arenas, **fields):
    model = build(device)
    optimizer = so.SwapOptimizer(adamw(model.parameters()), swap_times=swap_times, num_arenas=num_arenas, **fields)
    train(model, optimizer, STEPS, device)
    return snapshot(optimizer, model), optimizer.memory_stats(), optimizer._batch_layout()


@pytest.mark.parametrize("device", DEVICES)
def test_split_training_is_bitwise_across_splits_and_matches_torch(device):
    model = build(device)
    twin = plain_twin(model, weight_decay=0.1)
    train(model, so.SwapOptimizer(adamw(model.parameters()), swap_times=8), STEPS, device, twin=twin)
    (ref_params, ref_states) = snapshot(twin[1], twin[0])
    state_bytes = swapped_state_bytes(model)
    assert model.embed.weight.numel() * 8 > 0.9 * state_bytes
    first = None
    for swap_times in (1, 2, 4, 8, 16):
        for num_arenas in (2, 3):
            (params, states), stats, plan = run(device, swap_times, num_arenas)
            check_pieces(plan, model)
            rotating = [b for b in plan if not b["resident"]]
            # swap_times batches, or fewer where that balances better (here at 16, where a batch is near a piece).
            assert len(rotating) == swap_times if swap_times <= 8 else len(rotating) <= swap_times
            assert stats["split_params"] == (0 if swap_times == 1 else 1)
            # The bound: each arena within 2 pieces (+ a granule, alignment) of an even share.
            largest = max(b["arena_bytes"] for b in rotating)
            assert largest <= -(-state_bytes // swap_times) + 2 * MIN_PIECE_BYTES + 8192
            assert stats["peak_staging_bytes"] == min(num_arenas, swap_times) * largest + stats["step_table_bytes"]
            for p, q in zip(params, ref_params):
                assert_close(p, q, **TRAIN_TOL)
            for ours, theirs in zip(states, ref_states):
                assert ours.keys() == theirs.keys() and ours["step"].item() == theirs["step"].item() == STEPS
                for key in ("exp_avg", "exp_avg_sq"):
                    assert_close(ours[key], theirs[key], **TRAIN_TOL)
            if first is None:
                first = params, states
            assert all(torch.equal(a, b) for a, b in zip(params, first[0]))
            assert all(torch.equal(a[k], b[k]) for a, b in zip(states, first[1]) for k in a)


def test_staging_follows_swap_times_not_the_largest_param():
    model = build("cpu")
    embed = model.embed.weight.numel() * 8
    shares = {}
    for swap_times in (4, 8, 16):
        stats = run("cpu", swap_times, 2)[1]
        shares[swap_times] = stats["peak_staging_bytes"] / stats["host_state_bytes"]
        assert stats["peak_staging_bytes"] < embed  # two arenas hold less than the largest param's states
    assert shares[4] > shares[8] > shares[16]
    assert shares[16] < 2 / 16 + 0.06  # pieces of 64 KiB are a large share of this small model


@pytest.mark.parametrize("device", DEVICES)
def test_staging_budget_below_the_largest_param_is_met(device):
    model = build(device)
    budget = model.embed.weight.numel() * 8 // 3
    optimizer = so.SwapOptimizer(adamw(model.parameters()), staging_budget_bytes=budget, **PACKED_KERNEL)
    train(model, optimizer, 2, device)
    stats = optimizer.memory_stats()
    assert stats["split_params"] == 1 and stats["peak_staging_bytes"] <= budget
    # Below a few pieces no split fits: the error names the smallest budget that works.
    with pytest.raises(ValueError, match="staging_budget_bytes=100000 is too small: the smallest budget that works "
                                         "is (\\d+) bytes") as info:
        so.SwapOptimizer(adamw(model.parameters()), staging_budget_bytes=100_000, **PACKED_KERNEL)
    smallest = int(re.search("works is (\\d+) bytes", str(info.value)).group(1))
    assert 100_000 < smallest <= 2 * (2 * MIN_PIECE_BYTES + 8192) + 256  # two arenas of a few pieces
    fitted = so.SwapOptimizer(adamw(model.parameters()), staging_budget_bytes=smallest, **PACKED_KERNEL)
    train(model, fitted, 1, device)
    assert fitted.memory_stats()["peak_staging_bytes"] <= smallest


VARIANTS = {
    "amsgrad": dict(flags=dict(amsgrad=True)),
    "maximize": dict(flags=dict(maximize=True)),
    "adam": dict(cls=torch.optim.Adam, flags=dict(weight_decay=0.01)),
    "exp_avg kept on the device": dict(fields=dict(state_keys=("exp_avg_sq",))),
    "only exp_avg swapped, amsgrad": dict(fields=dict(state_keys=("exp_avg",)), flags=dict(amsgrad=True)),
    "bf16 with fp32 states and masters": dict(dtype=torch.bfloat16,
                                              fields=dict(master_weights=True, state_dtype=torch.float32)),
    "bf16 masters, masters swapped only": dict(dtype=torch.bfloat16,
                                               fields=dict(master_weights=True, state_keys=("master_param",))),
    "fp32 states for bf16 params": dict(dtype=torch.bfloat16, fields=dict(state_dtype=torch.float32)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_split_bitwise_like_unsplit(device, variant):
    """Each setting with the embedding split in pieces (swap_times 8, 3 arenas)
    gives the bits of the same setting unsplit (swap_times 1); fp32 settings
    also match torch.optim."""
    spec = VARIANTS[variant]
    cls, flags, fields = spec.get("cls", torch.optim.AdamW), spec.get("flags", {}), spec.get("fields", {})
    dtype = spec.get("dtype", torch.float32)
    results = []
    for swap_times, num_arenas in ((1, 2), (8, 3), (5, 2)):
        model = build(device, dtype)
        twin = plain_twin(model, cls, **flags) if dtype == torch.float32 else None
        optimizer = so.SwapOptimizer(cls(model.parameters(), lr=3e-3, betas=(0.9, 0.99), **flags),
                                     swap_times=swap_times, num_arenas=num_arenas, **fields)
        assert optimizer.memory_stats()["split_params"] == (swap_times > 1)
        train(model, optimizer, STEPS, device, twin=twin)
        results.append(snapshot(optimizer, model))
        if twin is not None:
            for p, q in zip(model.parameters(), twin[0].parameters()):
                assert_close(p, q, **TRAIN_TOL)
    for params, states in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0]))
        assert all(torch.equal(a[k], b[k]) for a, b in zip(states, results[0][1]) for k in a)


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_skip_step_with_split_params(device):
    """With unscale_in_step=True GradScaler hands grad_scale and found_inf to
    step() instead of unscaling itself: the scaled grads are divided in the
    step, and the inf step is skipped inside the runtime (no piece moves, the
    step count stays), split or not. A plain AdamW under GradScaler (which
    unscales the grads and skips the inf step itself) is the reference."""
    results = []
    for swap_times in (1, 8):
        model = build(device)
        twin = plain_twin(model, weight_decay=0.1)
        optimizer = so.SwapOptimizer(adamw(model.parameters()), swap_times=swap_times, unscale_in_step=True,
                                     **PACKED_KERNEL)
        scalers = [torch.amp.GradScaler(device, init_scale=2.0 ** 10) for _ in range(2)]
        for step in range(4):
            before = snapshot(optimizer, model)
            for (m, o), scaler in zip(((model, optimizer), twin), scalers):
                o.zero_grad()
                loss = loss_of(m, step, device) * (float("inf") if step == 2 else 1.0)
                scaler.scale(loss).backward()
                scaler.step(o)
                scaler.update()
            if step == 2:  # skipped
                after = snapshot(optimizer, model)
                assert all(torch.equal(a, b) for a, b in zip(after[0], before[0]))
                assert all(torch.equal(a[k], b[k]) for a, b in zip(after[1], before[1]) for k in a)
        assert optimizer.state[model.embed.weight]["step"].item() == 3
        for p, q in zip(model.parameters(), twin[0].parameters()):
            assert_close(p, q, **TRAIN_TOL)
        results.append(snapshot(optimizer, model))
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(results[0][1], results[1][1]) for k in a)


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_of_split_params_round_trips(device):
    """The state dict holds one tensor per state of the split param (views of the
    host store), loads into another split and into a plain AdamW, and resuming
    is bitwise equal to not stopping."""
    model = build(device)
    optimizer = so.SwapOptimizer(adamw(model.parameters()), swap_times=8)
    train(model, optimizer, 3, device)
    state = optimizer.state_dict()
    embed_state = state["state"][2]
    assert embed_state["exp_avg"].shape == model.embed.weight.shape and embed_state["step"].item() == 3
    assert embed_state["exp_avg"].device.type == "cpu"
    # Zero copy: the entry is the store's own memory.
    assert embed_state["exp_avg"].data_ptr() == optimizer.state[model.embed.weight]["exp_avg"].data_ptr()

    resumed_model = build(device)
    resumed_model.load_state_dict(model.state_dict())
    resumed = so.SwapOptimizer(adamw(resumed_model.parameters()), swap_times=3, num_arenas=3)
    resumed.load_state_dict(state)
    plain_model = build(device)
    plain_model.load_state_dict(model.state_dict())
    plain = adamw(plain_model.parameters(), foreach=False)
    plain.load_state_dict({"state": {k: {n: t.clone() for n, t in v.items()} for k, v in state["state"].items()},
                           "param_groups": state["param_groups"]})
    train(model, optimizer, 3, device, first_step=3)
    train(resumed_model, resumed, 3, device, first_step=3)
    train(plain_model, plain, 3, device, first_step=3)
    for p, q, r in zip(model.parameters(), resumed_model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)
        assert_close(p, r, **TRAIN_TOL)


def element_status(now, before, after, i):
    """Per element of param i: whether the param and every state are all old, and
    whether they are all new (the plain optimizer's step, within tolerance)."""
    (p_now, s_now), (p_old, s_old), (p_new, s_new) = now, before, after
    old = (p_now[i] == p_old[i]).flatten()
    new = torch.isclose(p_now[i], p_new[i], rtol=1e-5, atol=1e-7).flatten()
    for key in s_old[i]:
        if key == "step":
            continue
        old &= (s_now[i][key] == s_old[i][key]).flatten()
        new &= torch.isclose(s_now[i][key], s_new[i][key].to(s_now[i][key].dtype), rtol=1e-5, atol=1e-7).flatten()
    return old, new


def two_groups(model):
    """pre and the embedding in one group, the rest in another: a batch holding
    the embedding's tail and mid's weight makes two op calls."""
    params = list(model.parameters())
    return [{"params": params[:3]}, {"params": params[3:]}]


FAULT_SETUPS = {
    "all swapped": {},
    "exp_avg kept on the device": dict(state_keys=("exp_avg_sq",)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setup", list(FAULT_SETUPS))
@pytest.mark.parametrize("num_arenas", [2, 3])
@pytest.mark.parametrize("fault", ["stage_in", "update", "update_last_call"])
def test_fault_inside_and_outside_a_split_param_keeps_every_element_consistent(fault, num_arenas, setup, device):
    model = build(device)
    optimizer = so.SwapOptimizer(adamw(two_groups(model)), swap_times=6, num_arenas=num_arenas, **PACKED_KERNEL,
                                 **FAULT_SETUPS[setup])
    plan = optimizer._batch_layout()
    assert plan[0]["resident"]
    numels = [p.numel() for p in model.parameters()]
    embed = 2  # the split param's index (pre.weight, pre.bias, embed.weight, ...)
    embed_batches = [b for b, batch in enumerate(plan) if embed in batch["params"]]
    assert len(embed_batches) >= 4
    train(model, optimizer, 2, device)
    torn_seen = 0
    for fault_batch in range(len(plan)):
        before = snapshot(optimizer, model)
        reference = build(device)
        reference.load_state_dict(model.state_dict())
        plain = adamw(two_groups(reference), foreach=False)
        plain.load_state_dict(round_trip(optimizer.state_dict()))  # its own copy, not our store
        train(reference, plain, 1, device, first_step=100 + fault_batch)
        after = snapshot(plain, reference)

        optimizer._set_test_hooks(fault=fault, fault_batch=fault_batch)
        with pytest.raises(RuntimeError, match=f"injected test fault at the .* of batch {fault_batch}") as info:
            train(model, optimizer, 1, device, first_step=100 + fault_batch)
        optimizer._set_test_hooks()
        assert optimizer.memory_stats()["staging_bytes"] == 0
        now = snapshot(optimizer, model)

        # Each element is old or new together with all its states; the new ones are
        # exactly the pieces of a prefix of the rows in pipeline order; a param's step
        # count is new exactly when its last piece is.
        first_old = None  # (batch, row) of the first piece left old
        last_piece_new, any_piece_new = {}, set()
        for b, batch in enumerate(plan):
            for r, (i, offset, count) in enumerate(batch["pieces"]):
                old, new = element_status(now, before, after, i)
                assert bool((old | new).all()), f"fault at batch {fault_batch}: param {i} mixes old and new"
                piece_old = bool(old[offset:offset + count].all())
                assert piece_old or bool(new[offset:offset + count].all())
                if piece_old and first_old is None:
                    first_old = (b, r)
                assert piece_old == (first_old is not None), "updated pieces are a prefix of the rows"
                if not piece_old:
                    any_piece_new.add(i)
                if offset + count == numels[i]:
                    last_piece_new[i] = not piece_old
        for i, (state_now, state_before) in enumerate(zip(now[1], before[1])):
            assert state_now["step"].item() == state_before["step"].item() + last_piece_new[i], f"param {i}'s step"
        if fault == "update":
            assert first_old == (fault_batch, 0)
        elif fault == "update_last_call":
            assert first_old[0] == fault_batch
        if embed in any_piece_new and not last_piece_new[embed]:  # torn
            torn_seen += 1
            assert "param 2 (shape [3000, 48]) was partly updated" in str(info.value)
            assert optimizer._runtime.torn_params() == [embed]
            with pytest.raises(RuntimeError, match="left param\\(s\\) 2 partly updated; step\\(\\) refuses"):
                optimizer.step(closure=lambda: pytest.fail("a refused step must not run its closure"))
            with pytest.raises(RuntimeError, match="left param\\(s\\) 2 partly updated; add_param_group\\(\\) refuses"):
                optimizer.add_param_group({"params": [torch.zeros(3, device=device, requires_grad=True)]})
            assert snapshot(optimizer, model)[1][embed]["step"] == now[1][embed]["step"]  # nothing moved
            optimizer.load_state_dict(optimizer.state_dict())  # a checkpoint: here, the consistent state itself
        else:
            assert "partly updated" not in str(info.value) and optimizer._runtime.torn_params() == []
        # The next steps are right: they match a plain AdamW loaded from this state.
        reference = build(device)
        reference.load_state_dict(model.state_dict())
        plain = adamw(two_groups(reference), foreach=False)
        plain.load_state_dict(round_trip(optimizer.state_dict()))
        train(model, optimizer, 2, device, first_step=200)
        train(reference, plain, 2, device, first_step=200)
        for p, q in zip(model.parameters(), reference.parameters()):
            assert_close(p, q, **TRAIN_TOL)
    assert torn_seen >= 2


@pytest.mark.parametrize("device", DEVICES)
def test_fault_in_a_step_grad_scaler_skips_tears_nothing(device):
    """With found_inf set the step writes nothing, so a fault inside the split
    param leaves nothing partly updated and marks nothing torn."""
    model = build(device)
    optimizer = so.SwapOptimizer(adamw(model.parameters()), swap_times=6, **PACKED_KERNEL)
    train(model, optimizer, 2, device)
    middle_of_embedding = [b for b, batch in enumerate(optimizer._batch_layout()) if 2 in batch["params"]][2]
    before = snapshot(optimizer, model)
    loss_of(model, 7, device).backward()
    optimizer.grad_scale = torch.ones(1, device=device)
    optimizer.found_inf = torch.ones(1, device=device)  # as GradScaler hands them over after an inf
    optimizer._set_test_hooks(fault="update", fault_batch=middle_of_embedding)
    with pytest.raises(RuntimeError, match="injected test fault") as info:
        optimizer.step()
    del optimizer.grad_scale, optimizer.found_inf
    optimizer._set_test_hooks()
    assert "partly updated" not in str(info.value) and optimizer._runtime.torn_params() == []
    now = snapshot(optimizer, model)
    assert all(torch.equal(a, b) for a, b in zip(now[0], before[0]))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(now[1], before[1]) for k in a)
    train(model, optimizer, 1, device, first_step=8)
    assert optimizer.state[model.embed.weight]["step"].item() == 3


@pytest.mark.parametrize("device", DEVICES)
def test_empty_params_beside_split_params(device):
    """A param of 0 elements keeps (empty) states and a step count when the
    plan splits others, and a plain AdamW loaded from the state dict takes
    the same next step."""
    generator = torch.Generator().manual_seed(12)

    def random(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    params = [random(200_000).requires_grad_(), random(0, 4).requires_grad_(), random(3000).requires_grad_()]
    optimizer = so.SwapOptimizer(adamw(params), swap_times=8, min_numel=0)
    assert optimizer.memory_stats()["split_params"] == 1
    for _ in range(2):
        for p in params:
            p.grad = random(*p.shape)
        optimizer.step()
    state = optimizer.state_dict()["state"]
    assert state[1]["step"].item() == 2 and state[1]["exp_avg"].shape == (0, 4)
    plain_params = [p.detach().clone().requires_grad_() for p in params]
    plain = adamw(plain_params, foreach=False)
    plain.load_state_dict(round_trip(optimizer.state_dict()))
    for p, q in zip(params, plain_params):
        p.grad = random(*p.shape)
        q.grad = p.grad.clone()
    optimizer.step()
    plain.step()
    for p, q in zip(params, plain_params):
        assert_close(p, q, **TRAIN_TOL)
        assert_close(optimizer.state[p]["exp_avg_sq"], plain.state[q]["exp_avg_sq"], **TRAIN_TOL)
    assert optimizer.state[params[1]]["step"].item() == plain.state[plain_params[1]]["step"].item() == 3


@pytest.mark.parametrize("num_arenas", [2, 3])
def test_interrupt_at_every_batch_leaves_whole_params(num_arenas):
    model = build("cpu")
    optimizer = so.SwapOptimizer(adamw(model.parameters()), swap_times=6, num_arenas=num_arenas, **PACKED_KERNEL)
    plan = optimizer._batch_layout()
    train(model, optimizer, 2, "cpu")
    for fault_batch in range(1, len(plan)):
        before = snapshot(optimizer, model)
        optimizer._set_test_hooks(fault="interrupt", fault_batch=fault_batch)
        with pytest.raises(KeyboardInterrupt):
            train(model, optimizer, 1, "cpu", first_step=100 + fault_batch)
        optimizer._set_test_hooks()
        now = snapshot(optimizer, model)
        changed = [not torch.equal(a, b) for a, b in zip(now[0], before[0])]
        steps = [s["step"].item() - b["step"].item() for s, b in zip(now[1], before[1])]
        for i, (p_now, p_before) in enumerate(zip(now[0], before[0])):
            # Wholly old or wholly new: the step count says which, every element agrees.
            if steps[i] == 1:
                assert changed[i]
            else:
                assert steps[i] == 0 and not changed[i], f"param {i} changed without its step count"
        # The interrupt lands at the first batch at or after fault_batch that starts a param.
        stop = next((b for b in range(fault_batch, len(plan)) if plan[b]["pieces"][0][1] == 0), len(plan))
        expected_new = sorted({i for batch in plan[:stop] for i, offset, count in batch["pieces"]
                               if offset + count == model_numel(model, i)})
        assert [i for i, s in enumerate(steps) if s == 1] == expected_new
        assert optimizer._runtime.torn_params() == []


def model_numel(model, index):
    return list(model.parameters())[index].numel()
