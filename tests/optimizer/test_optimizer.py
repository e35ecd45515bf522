"""SwapOptimizer trains exactly as the optimizer it wraps.

Tolerances, fp32, 50 training steps, against the plain wrapped optimizer
(torch's single-tensor path on CPU, its default on CUDA): params, states and
losses within rtol 1e-5, atol 1e-6. Per step the fused op agrees with torch to
rtol 1e-5 / atol 1e-7 (tests/kernels/test_fused_adam_op.py); training feeds those
differences back through the loss, hence the looser atol.
Across swap_times and num_arenas the results are bitwise identical.
"""

import functools
import itertools

import pytest
import torch
from torch.testing import assert_close

from conftest import DEVICES
from swap_training import arena_bytes, build_model, params_of, plain_optimizer, state_tensors, swap_optimizer, train

STEPS = 50
TRAIN_TOL = dict(rtol=1e-5, atol=1e-6)
CASES = list(itertools.product(["mlp", "transformer"], ["adamw", "adam"], [False, True]))


def case_id(case):
    kind, name, amsgrad = case
    return f"{kind}-{name}-ams{int(amsgrad)}"


@functools.lru_cache(maxsize=None)
def plain_run(kind, name, amsgrad, device):
    model = build_model(kind, device)
    optimizer = plain_optimizer(name, model.parameters(), amsgrad)
    losses = train(kind, model, optimizer, STEPS, device)
    return losses, params_of(model), state_tensors(optimizer, model)


@functools.lru_cache(maxsize=None)
def swap_run(kind, name, amsgrad, device, swap_times, num_arenas):
    model = build_model(kind, device)
    optimizer = swap_optimizer(name, model.parameters(), amsgrad, swap_times=swap_times, num_arenas=num_arenas)
    losses = train(kind, model, optimizer, STEPS, device)
    return losses, params_of(model), state_tensors(optimizer, model), optimizer.memory_stats()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_arenas", [2, 3])
@pytest.mark.parametrize("swap_times", [1, 2, 3, 8])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_training_matches_wrapped_optimizer(case, swap_times, num_arenas, device):
    kind, name, amsgrad = case
    losses, params, states, stats = swap_run(kind, name, amsgrad, device, swap_times, num_arenas)
    ref_losses, ref_params, ref_states = plain_run(kind, name, amsgrad, device)
    assert stats["batches"] == min(swap_times, stats["batches"]) and stats["batches"] >= 1
    assert_close(losses, ref_losses, **TRAIN_TOL)
    for i, (p, r) in enumerate(zip(params, ref_params)):
        assert_close(p, r, **TRAIN_TOL, msg=lambda m: f"param {i}: {m}")
    assert states.keys() == ref_states.keys()
    for key in states:
        assert_close(states[key], ref_states[key].to(states[key].dtype), **TRAIN_TOL,
                     msg=lambda m: f"state {key}: {m}")

    # The batching never changes a bit.
    base_losses, base_params, base_states, _ = swap_run(kind, name, amsgrad, device, 1, 2)
    assert torch.equal(losses, base_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, base_params))
    assert all(torch.equal(states[k], base_states[k]) for k in states)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("swap_times", [2, 3, 4])
def test_batches_are_contiguous_and_optimally_balanced(device, swap_times):
    model = build_model("transformer", device)
    optimizer = swap_optimizer("adamw", model.parameters(), swap_times=swap_times)
    plan = optimizer._batch_layout()
    numels = [p.numel() for p in model.parameters()]
    resident = [b for b in plan if b["resident"]]
    rotating = [b for b in plan if not b["resident"]]
    assert plan[0] is resident[0] and resident[0]["params"] == [i for i, n in enumerate(numels) if n < 1024]
    swapped = [i for i, n in enumerate(numels) if n >= 1024]
    assert [i for b in rotating for i in b["params"]] == swapped
    assert len(rotating) == swap_times
    for b in rotating:
        assert b["pieces"] == [(i, 0, numels[i]) for i in b["params"]]  # small states: no param is split
        assert b["arena_bytes"] == b["host_bytes"] == arena_bytes([numels[i] for i in b["params"]])
        assert b["host_copies"] == 1
    # No split of the swapped params into swap_times contiguous runs has a smaller largest arena.
    best = min(max(arena_bytes([numels[i] for i in swapped[a:b]]) for a, b in zip((0,) + cut, cut + (len(swapped),)))
               for cut in itertools.combinations(range(1, len(swapped)), swap_times - 1))
    assert max(b["arena_bytes"] for b in rotating) == best


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_track_fp32_reference(device, dtype):
    """16-bit params with fp32 master copies and fp32 states: the master and the
    states follow an fp32 AdamW fed the same grads (rtol 1e-5, atol 1e-7), and
    the param is the rounded master."""
    torch.manual_seed(3)
    fp32 = [torch.randn(n, device=device) for n in (3000, 2048, 100, 1500)]
    low = [p.to(dtype) for p in fp32]
    reference = [p.to(dtype).float().requires_grad_() for p in fp32]
    ours = swap_optimizer("adamw", [p.requires_grad_() for p in low], swap_times=2, master_weights=True,
                          state_dtype=torch.float32)
    plain = plain_optimizer("adamw", reference)
    for step in range(30):
        grads = [torch.randn(p.shape, device=device).to(dtype) for p in low]
        for p, r, g in zip(low, reference, grads):
            p.grad, r.grad = g, g.float()
        ours.step()
        plain.step()
    for p, r in zip(low, reference):
        master = ours.state[p]["master_param"]
        assert master.dtype == torch.float32
        assert_close(master.to(device), r.detach(), rtol=1e-5, atol=1e-7)
        assert torch.equal(p.detach(), master.to(device).to(dtype))
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(ours.state[p][key].to(device), plain.state[r][key], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_states_for_bf16_params(device):
    torch.manual_seed(4)
    params = [torch.randn(n, device=device, dtype=torch.bfloat16, requires_grad=True) for n in (2000, 4096)]
    ours = swap_optimizer("adamw", params, swap_times=2, state_dtype=torch.float32)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        ours.step()
    for p in params:
        assert ours.state[p]["exp_avg"].dtype == torch.float32
        assert ours.state[p]["exp_avg"].abs().sum() > 0
        assert "master_param" not in ours.state[p]


@pytest.mark.parametrize("device", DEVICES)
def test_state_lives_in_host_memory_between_steps(device):
    model = build_model("mlp", device)
    optimizer = swap_optimizer("adamw", model.parameters(), swap_times=2)
    train("mlp", model, optimizer, 3, device)
    for p in model.parameters():
        state = optimizer.state[p]
        assert state["step"].device.type == "cpu" and state["step"].dim() == 0 and state["step"].item() == 3
        where = "cpu" if p.numel() >= 1024 else device
        assert state["exp_avg"].device.type == where and state["exp_avg_sq"].device.type == where
        assert state["exp_avg"].shape == p.shape
    stats = optimizer.memory_stats()
    assert stats["staging_bytes"] == 0
    assert stats["pinned"] == (device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_state_keys_keep_the_rest_resident(device):
    """Only exp_avg goes to the host; exp_avg_sq stays on the device. Same bits."""
    model, twin = build_model("mlp", device), build_model("mlp", device)
    partial = swap_optimizer("adamw", model.parameters(), swap_times=3, state_keys=("exp_avg",))
    full = swap_optimizer("adamw", twin.parameters(), swap_times=3)
    losses = train("mlp", model, partial, 10, device)
    assert torch.equal(losses, train("mlp", twin, full, 10, device))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        if p.numel() >= 1024:
            assert partial.state[p]["exp_avg"].device.type == "cpu"
            assert partial.state[p]["exp_avg_sq"].device.type == torch.device(device).type
    assert partial.memory_stats()["resident_state_bytes"] > full.memory_stats()["resident_state_bytes"]


@pytest.mark.parametrize("device", DEVICES)
def test_strided_params_stay_resident_and_views_are_swapped(device):
    torch.manual_seed(5)
    strided = torch.randn(48, 64, device=device).t().requires_grad_()  # non-contiguous, 3072 elements
    flat = torch.randn(4096, device=device)
    rest = flat[2048:].clone()
    view = flat[:2048].detach().requires_grad_()  # a view, like an FSDP2 shard of a padded buffer
    plain_params = [strided.detach().clone().requires_grad_(), view.detach().clone().requires_grad_()]
    ours = swap_optimizer("adamw", [strided, view], swap_times=2)
    plain = plain_optimizer("adamw", plain_params)
    plan = ours._batch_layout()
    assert [b["params"] for b in plan if b["resident"]] == [[0]]
    assert [b["params"] for b in plan if not b["resident"]] == [[1]]
    for step in range(5):
        for p, q in zip([strided, view], plain_params):
            g = torch.randn(p.shape, device=device)
            p.grad, q.grad = g, g.clone()
        ours.step()
        plain.step()
    assert not strided.is_contiguous()
    for p, q in zip([strided, view], plain_params):
        assert_close(p, q, rtol=1e-5, atol=1e-7)
    assert torch.equal(flat[:2048], view.detach()) and torch.equal(flat[2048:], rest)
