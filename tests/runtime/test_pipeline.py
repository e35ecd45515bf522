"""The pipeline's ordering and failure rules, and its memory accounting.

- Random delays injected into every copy and before every update change no bit.
- A failure at any batch (copy in, update, Ctrl-C between batches) leaves each
  param with its state wholly old or wholly new; the next steps match a plain
  AdamW loaded from that state (rtol 1e-5, atol 1e-6).
- Staging and host memory follow the formula of docs/design.md and stay flat.
"""

import pytest
import torch

from conftest import DEVICES, PACKED_KERNEL
from swap_training import (arena_bytes, assert_train_alike, build_model, params_of, plain_twin, state_tensors,
                           swap_optimizer, train)

TRAIN_TOL = dict(rtol=1e-5, atol=1e-6)


# copies: every copy first waits a random time on its queue (a worker's sleep
# on the host backend; a host function on the CUDA copy stream). updates: the
# compute queue also waits before each batch's update (a sleep of the thread
# running it; a host function on the CUDA compute stream), so a copy out that
# did not wait for its update would take old states to the host; on the host
# backend the update runs inline before its copy out is enqueued, so only the
# CUDA variant can catch that one.
DELAYS = {"copies": dict(copy_delay_us=300), "updates": dict(copy_delay_us=100, compute_delay_us=300)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_arenas", [2, 3, 4])
@pytest.mark.parametrize("delayed_queues", DELAYS)
def test_random_delays_change_nothing(delayed_queues, num_arenas, device):
    """Random delays on the queues: any missing wait would change bits."""
    delayed_model, model = build_model("mlp", device), build_model("mlp", device)
    delayed = swap_optimizer("adamw", delayed_model.parameters(), swap_times=8, num_arenas=num_arenas, min_numel=0)
    steady = swap_optimizer("adamw", model.parameters(), swap_times=8, num_arenas=num_arenas, min_numel=0)
    delayed._set_test_hooks(seed=num_arenas, **DELAYS[delayed_queues])
    assert delayed.memory_stats()["batches"] == 8
    # (the host backend's steps cost milliseconds: fewer there, each still 8 batches through the delays)
    steps = (200 if delayed_queues == "copies" else 100) // (1 if device == "cuda" else 4)
    losses = train("mlp", delayed_model, delayed, steps, device)
    assert torch.equal(losses, train("mlp", model, steady, steps, device))
    for p, q in zip(delayed_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(delayed, delayed_model).values(),
                                                  state_tensors(steady, model).values()))


def snapshot(optimizer, model):
    return params_of(model), state_tensors(optimizer, model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_arenas", [2, 3])
@pytest.mark.parametrize("fault", ["stage_in", "update", "interrupt"])
def test_fault_at_each_batch_loses_nothing(fault, num_arenas, device):
    model = build_model("mlp", device)
    # (the packed kernel's pipeline: a signal lands at a param boundary; torch's
    # update holds it until the step is done, tests/rules/test_rules.py)
    optimizer = swap_optimizer("adamw", model.parameters(), swap_times=3, num_arenas=num_arenas, min_numel=100,
                               **PACKED_KERNEL)
    plan = optimizer._batch_layout()
    assert plan[0]["resident"] and len(plan) == 4
    train("mlp", model, optimizer, 3, device)
    params = list(model.parameters())
    first_batch = 1 if fault == "interrupt" else 0  # interrupts are checked between batches
    for fault_batch in range(first_batch, len(plan)):
        before = snapshot(optimizer, model)
        # Where the step would have taken each param.
        twin, twin_optimizer = plain_twin("mlp", model, optimizer, device)
        train("mlp", twin, twin_optimizer, 1, device, first_step=100 + fault_batch)
        after = snapshot(twin_optimizer, twin)

        optimizer._set_test_hooks(fault=fault, fault_batch=fault_batch)
        expected = KeyboardInterrupt if fault == "interrupt" else RuntimeError
        with pytest.raises(expected):
            train("mlp", model, optimizer, 1, device, first_step=100 + fault_batch)
        optimizer._set_test_hooks()
        assert optimizer.memory_stats()["staging_bytes"] == 0

        now = snapshot(optimizer, model)
        new_params = []
        for i in range(len(params)):
            keys = [k for (j, k) in now[1] if j == i]
            old = torch.equal(now[0][i], before[0][i]) and all(torch.equal(now[1][(i, k)], before[1][(i, k)]) for k in keys)
            new = all(torch.equal(now[1][(i, k)].float(), after[1][(i, k)].float()) for k in ("step",)) and \
                all(torch.allclose(now[1][(i, k)], after[1][(i, k)].to(now[1][(i, k)].dtype), rtol=1e-5, atol=1e-7)
                    for k in keys if k != "step") and torch.allclose(now[0][i], after[0][i], rtol=1e-5, atol=1e-7)
            assert old != new, f"fault {fault} at batch {fault_batch}: param {i} is neither wholly old nor new"
            if new:
                new_params.append(i)
        # Update and interrupt faults stop at their batch: exactly the batches before it are new.
        if fault != "stage_in":
            assert new_params == sorted(i for b in plan[:fault_batch] for i in b["params"])

        # The next steps are right: they match a plain AdamW loaded from this state.
        assert_train_alike("mlp", (model, optimizer), plain_twin("mlp", model, optimizer, device), 2, 200, device,
                           **TRAIN_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_arenas", [2, 3])
def test_memory_follows_the_formula_and_stays_flat(num_arenas, device):
    model = build_model("transformer", device)
    # (the packed kernel's layout: its step table, no update temporaries)
    optimizer = swap_optimizer("adamw", model.parameters(), swap_times=4, num_arenas=num_arenas, **PACKED_KERNEL)
    plan = optimizer._batch_layout()
    rotating = [b for b in plan if not b["resident"]]
    largest = max(b["arena_bytes"] for b in rotating)
    params = list(model.parameters())
    # Nothing of the resident batch travels; a rotating batch's whole arena does, and the step table (4 bytes a param).
    assert all(b["pieces"] == [(i, 0, params[i].numel()) for i in b["params"]] for b in plan)  # nothing split
    expected_host = 4 * len(params) + sum(arena_bytes([params[i].numel() for i in b["params"]]) for b in rotating)
    state_bytes = sum(2 * p.numel() * 4 for p in params)
    resident_bytes = sum(2 * p.numel() * 4 for p in params if p.numel() < 1024)
    first = None
    for step in range(500 if device == "cuda" else 100):  # (the soak test runs 2,000 on the host backend)
        train("transformer", model, optimizer, 1, device, first_step=step)
        stats = optimizer.memory_stats()
        if first is None:
            first = stats
        assert stats == first, f"memory stats changed at step {step}"
    assert stats["step_table_bytes"] == -(-4 * len(params) // 256) * 256
    assert stats["peak_staging_bytes"] == min(num_arenas, len(rotating)) * largest + stats["step_table_bytes"]
    assert stats["staging_bytes"] == 0 and stats["num_arenas"] == min(num_arenas, len(rotating))
    assert stats["host_state_bytes"] == expected_host
    assert state_bytes - resident_bytes < expected_host < state_bytes - resident_bytes + 256 * 4 * len(params)
    assert stats["split_params"] == 0
    assert resident_bytes <= stats["resident_state_bytes"] < resident_bytes + 256 * 3 * len(params)
    assert stats["h2d_bytes"] == stats["d2h_bytes"] == expected_host
    assert stats["batches"] == 4


@pytest.mark.parametrize("device", DEVICES)
def test_keep_arenas_keeps_them_between_steps(device):
    model = build_model("mlp", device)
    optimizer = swap_optimizer("adamw", model.parameters(), swap_times=2, keep_arenas=True)
    train("mlp", model, optimizer, 2, device)
    stats = optimizer.memory_stats()
    assert stats["staging_bytes"] == stats["peak_staging_bytes"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_staging_budget_picks_the_smallest_swap_times_that_fits(device):
    model = build_model("transformer", device)
    sizes = {}
    for swap_times in range(1, 7):
        probe = swap_optimizer("adamw", model.parameters(), swap_times=swap_times, **PACKED_KERNEL)
        stats = probe.memory_stats()
        arenas = [b["arena_bytes"] for b in probe._batch_layout() if not b["resident"]]
        sizes[swap_times] = min(2, stats["batches"]) * max(arenas) + stats["step_table_bytes"]
    budget = sizes[4]
    fitted = swap_optimizer("adamw", model.parameters(), staging_budget_bytes=budget, **PACKED_KERNEL)
    chosen = fitted.memory_stats()["batches"]
    assert sizes[chosen] <= budget and all(sizes[k] > budget for k in range(1, chosen))
    train("transformer", model, fitted, 1, device)
    assert fitted.memory_stats()["peak_staging_bytes"] <= budget
    with pytest.raises(ValueError, match="staging_budget_bytes=1000 is too small"):
        swap_optimizer("adamw", model.parameters(), staging_budget_bytes=1000)


def test_gpu_peak_memory_is_model_grads_arenas_and_resident_state():
    pytest.importorskip("torch.cuda")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    device = "cuda"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(device)
    optimizer = swap_optimizer("adamw", model.parameters(), swap_times=8)
    x = torch.randn(64, 1024, device=device)
    model(x).sum().backward()  # grads exist before measuring
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # model + grads + input
    torch.cuda.reset_peak_memory_stats()
    for _ in range(5):
        optimizer.step()
    torch.cuda.synchronize()
    stats = optimizer.memory_stats()
    allowed = base + stats["peak_staging_bytes"] + stats["resident_state_bytes"] + (1 << 20)
    assert torch.cuda.max_memory_allocated() <= allowed
    # Between steps nothing of the swapped state is on the device.
    assert torch.cuda.memory_allocated() <= base + stats["resident_state_bytes"]
    assert stats["pinned"]
