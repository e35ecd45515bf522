"""SwapOptimizer where torch.optim optimizers go: LR schedulers, GradScaler,
clip_grad_norm_, params without grads, hooks, add_param_group.
Tolerance against the plain wrapped optimizer: rtol 1e-5, atol 1e-6."""

import copy
import pickle

import pytest
import torch
from torch.testing import assert_close

from conftest import PACKED_KERNEL, DEVICES
from swap_training import build_model, loss_of, side_by_side, state_tensors, swap_optimizer, train

TRAIN_TOL = dict(rtol=1e-5, atol=1e-6)


def assert_same_training(model, ours, twin, plain):
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close(p, q, **TRAIN_TOL)
    theirs = state_tensors(plain, twin)
    for key, value in state_tensors(ours, model).items():
        assert_close(value, theirs[key], **TRAIN_TOL, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_lr_scheduler(device):
    (model, ours), (twin, plain) = side_by_side("mlp", "adamw", device, swap_times=2)
    assert isinstance(ours, torch.optim.Optimizer)
    schedulers = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=30) for o in (ours, plain)]
    for step in range(30):
        for m, o, s in ((model, ours, schedulers[0]), (twin, plain, schedulers[1])):
            train("mlp", m, o, 1, device, first_step=step)
            s.step()
        assert ours.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == ours.optimizer.param_groups[0]["lr"]
    assert_same_training(model, ours, twin, plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unscale_in_step", [False, True])
def test_grad_scaler_with_an_inf_step_and_clipping(unscale_in_step, device):
    """Both ways GradScaler can drive the step: unscaling and the inf check on
    the host (the default for a plain AdamW), or handed to step()."""
    # (handed to step(): the packed kernel's settings, as torch's AdamW takes the scale only fused)
    (model, ours), (twin, plain) = side_by_side("mlp", "adamw", device, swap_times=2, unscale_in_step=unscale_in_step,
                                                **(PACKED_KERNEL if unscale_in_step else {}))
    assert ours._step_supports_amp_scaling is unscale_in_step
    scalers = [torch.amp.GradScaler(device, init_scale=2.0 ** 12, growth_interval=3) for _ in range(2)]
    for step in range(12):
        for m, o, scaler in ((model, ours, scalers[0]), (twin, plain, scalers[1])):
            o.zero_grad()
            loss = loss_of("mlp", m, step, device)
            if step == 5:
                loss = loss * float("inf")  # this step must be skipped, step counts included
            scaler.scale(loss).backward()
            if step % 2:
                scaler.unscale_(o)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            scaler.step(o)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert scalers[0].get_scale() < 2.0 ** 12 * 2 ** 3  # the inf step backed off
    for p in model.parameters():
        assert ours.state[p]["step"].item() == 11
    assert_same_training(model, ours, twin, plain)


@pytest.mark.parametrize("device", DEVICES)
def test_params_without_grads_are_skipped_as_torch_skips_them(device):
    (model, ours), (twin, plain) = side_by_side("transformer", "adam", device, swap_times=3)

    def drop_some(step, m):
        for i, p in enumerate(m.parameters()):
            if (i + step) % 3 == 0:
                p.grad = None

    train("transformer", model, ours, 12, device, before_step=drop_some)
    train("transformer", twin, plain, 12, device, before_step=drop_some)
    steps = [ours.state[p]["step"].item() for p in model.parameters()]
    assert steps == [plain.state[p]["step"].item() for p in twin.parameters()]
    assert min(steps) < 12
    assert_same_training(model, ours, twin, plain)


@pytest.mark.parametrize("device", DEVICES)
def test_step_hooks_run(device):
    model = build_model("mlp", device)
    ours = swap_optimizer("adamw", model.parameters())
    calls = []
    ours.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    ours.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    train("mlp", model, ours, 2, device)
    assert calls == ["pre", "post", "pre", "post"]


@pytest.mark.parametrize("device", DEVICES)
def test_add_param_group(device):
    (model, ours), (twin, plain) = side_by_side("mlp", "adamw", device, swap_times=2)
    head, twin_head = torch.nn.Linear(10, 128).to(device), torch.nn.Linear(10, 128).to(device)
    twin_head.load_state_dict(head.state_dict())

    def run(m, h, o, steps, first):
        for step in range(first, first + steps):
            o.zero_grad()
            out = m(torch.randn(4, 24, generator=torch.Generator().manual_seed(step)).to(device))
            (out.square().mean() + h(out).square().mean()).backward()
            o.step()

    run(model, head, ours, 4, 0)
    run(twin, twin_head, plain, 4, 0)
    ours.add_param_group({"params": head.parameters(), "lr": 1e-3})
    plain.add_param_group({"params": twin_head.parameters(), "lr": 1e-3})
    assert len(ours.param_groups) == 2 and ours.param_groups is ours.optimizer.param_groups
    assert head.weight not in ours.state  # no state before its first step, as in torch
    run(model, head, ours, 6, 4)
    assert ours.state[head.weight]["exp_avg"].device.type == "cpu"  # 1280 elements: swapped
    run(twin, twin_head, plain, 6, 4)
    for p, q in zip(list(model.parameters()) + list(head.parameters()), list(twin.parameters()) + list(twin_head.parameters())):
        assert_close(p, q, **TRAIN_TOL)
    with pytest.raises(ValueError, match="capturable=True"):
        ours.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, device=device))], "capturable": True})
    assert len(ours.param_groups) == 2
    run(model, head, ours, 1, 10)


def test_cannot_be_pickled():
    model = build_model("mlp", "cpu")
    ours = swap_optimizer("adamw", model.parameters())
    with pytest.raises(TypeError, match="save state_dict"):
        pickle.dumps(ours)
    with pytest.raises(TypeError, match="save state_dict"):
        copy.deepcopy(ours)
