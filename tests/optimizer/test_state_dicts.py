"""state_dict / load_state_dict: the wrapped optimizer's format, both ways.

- Save, load into a fresh model and SwapOptimizer, continue: bitwise equal to
  an uninterrupted run.
- Interop with plain AdamW either way: rtol 1e-5, atol 1e-6 after training on.
- Bad state dicts are refused before anything changes.
"""

import copy

import pytest
import torch
from torch.testing import assert_close

import swap_optimizer as so
from conftest import DEVICES, PACKED_KERNEL
from swap_training import (assert_train_alike, build_model, plain_optimizer, plain_twin, round_trip, side_by_side,
                           state_tensors, swap_optimizer, train)

TRAIN_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_round_trip_equals_uninterrupted_run(amsgrad, device):
    straight_model = build_model("transformer", device)
    straight = swap_optimizer("adamw", straight_model.parameters(), amsgrad, swap_times=3)
    straight_losses = train("transformer", straight_model, straight, 40, device)

    model = build_model("transformer", device)
    optimizer = swap_optimizer("adamw", model.parameters(), amsgrad, swap_times=3)
    losses = train("transformer", model, optimizer, 20, device)
    saved_model, saved_optimizer = round_trip(model.state_dict()), round_trip(optimizer.state_dict())
    del model, optimizer

    resumed_model = build_model("transformer", device, seed=99)
    resumed_model.load_state_dict(saved_model)
    resumed = swap_optimizer("adamw", resumed_model.parameters(), amsgrad, swap_times=5)  # another batching
    resumed.load_state_dict(saved_optimizer)
    losses = torch.cat([losses, train("transformer", resumed_model, resumed, 20, device, first_step=20)])
    assert torch.equal(losses, straight_losses)
    for p, q in zip(resumed_model.parameters(), straight_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_format_is_the_wrapped_optimizers(device):
    model, twin = build_model("mlp", device), build_model("mlp", device)
    ours = swap_optimizer("adamw", model.parameters(), swap_times=2)
    plain = plain_optimizer("adamw", twin.parameters())
    train("mlp", model, ours, 3, device)
    train("mlp", twin, plain, 3, device)
    saved, reference = ours.state_dict(), plain.state_dict()
    assert saved["param_groups"] == reference["param_groups"]
    assert saved["state"].keys() == reference["state"].keys()
    for index, entry in saved["state"].items():
        assert entry.keys() == reference["state"][index].keys()
        assert entry["step"].dtype == torch.float32 and entry["step"].device.type == "cpu" and entry["step"].dim() == 0
        for key, value in entry.items():
            assert value.shape == reference["state"][index][key].shape and value.dtype == reference["state"][index][key].dtype
    # Saving hands out the host store itself: no copies.
    p = next(p for p in model.parameters() if p.numel() >= 1024)
    index = list(model.parameters()).index(p)
    assert saved["state"][index]["exp_avg"].data_ptr() == ours.state[p]["exp_avg"].data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_plain_adamw_state_dict_loads_into_swap_optimizer(device):
    plain_model = build_model("transformer", device)
    plain = plain_optimizer("adamw", plain_model.parameters())
    train("transformer", plain_model, plain, 15, device)
    model = build_model("transformer", device)
    model.load_state_dict(plain_model.state_dict())
    ours = swap_optimizer("adamw", model.parameters(), swap_times=4)
    ours.load_state_dict(round_trip(plain.state_dict()))
    assert_train_alike("transformer", (model, ours), (plain_model, plain), 15, 15, device, **TRAIN_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_swap_optimizer_state_dict_loads_into_plain_adamw(device):
    model = build_model("transformer", device)
    ours = swap_optimizer("adamw", model.parameters(), swap_times=4)
    train("transformer", model, ours, 15, device)
    twin = plain_twin("transformer", model, ours, device)
    assert_train_alike("transformer", twin, (model, ours), 15, 15, device, **TRAIN_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_wrapping_an_optimizer_that_already_stepped_keeps_its_state(device):
    model, twin = build_model("mlp", device), build_model("mlp", device)
    inner, plain = plain_optimizer("adamw", model.parameters()), plain_optimizer("adamw", twin.parameters())
    train("mlp", model, inner, 5, device)
    train("mlp", twin, plain, 5, device)
    ours = so.SwapOptimizer(inner, swap_times=2)
    assert_close(train("mlp", model, ours, 10, device, first_step=5),
                 train("mlp", twin, plain, 10, device, first_step=5), **TRAIN_TOL)
    for key, value in state_tensors(ours, model).items():
        assert_close(value, state_tensors(plain, twin)[key], **TRAIN_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_master_param_is_saved_and_initialised_when_missing(device):
    torch.manual_seed(1)
    params = [torch.randn(2048, device=device, dtype=torch.bfloat16, requires_grad=True)]
    start = params[0].detach().clone()
    ours = swap_optimizer("adamw", params, master_weights=True, state_dtype=torch.float32)
    params[0].grad = torch.randn_like(params[0])
    ours.step()
    fp32 = [start.float().requires_grad_()]  # the master follows fp32 AdamW from the same start
    fp32[0].grad = params[0].grad.float()
    plain_optimizer("adamw", fp32).step()
    saved = round_trip(ours.state_dict())
    assert saved["state"][0]["master_param"].dtype == torch.float32
    assert_close(saved["state"][0]["master_param"].to(device), fp32[0].detach(), rtol=1e-5, atol=1e-7)
    assert torch.equal(saved["state"][0]["master_param"].to(device).to(torch.bfloat16), params[0].detach())
    assert not torch.equal(params[0].detach(), start)
    # A state dict without master copies (from a plain AdamW) starts them from the params.
    del saved["state"][0]["master_param"]
    with torch.no_grad():
        params[0].add_(1.0)
    ours.load_state_dict(saved)
    assert torch.equal(ours.state[params[0]]["master_param"].to(device), params[0].detach().float())


def bad_state_dicts(saved):
    def edit(change):
        out = copy.deepcopy(saved)
        change(out)
        return out

    first = next(iter(saved["state"]))
    return {
        "not a state dict": ({"weights": 1}, "expected an optimizer state dict"),
        "group count": (edit(lambda s: s["param_groups"].append(dict(s["param_groups"][0], params=[]))),
                        "has 2 param groups but this optimizer has 1"),
        "group size": (edit(lambda s: s["param_groups"][0]["params"].pop()), "params in the state dict but"),
        "amsgrad": (edit(lambda s: s["param_groups"][0].update(amsgrad=True)), "saved with amsgrad=True"),
        "shape": (edit(lambda s: s["state"][first].update(exp_avg=torch.zeros(3))), "has shape \\(3,\\)"),
        "unknown key": (edit(lambda s: s["state"][first].update(momentum_buffer=torch.zeros(3))),
                        "unknown state key\\(s\\) \\['momentum_buffer'\\]"),
        "missing key": (edit(lambda s: s["state"][first].pop("exp_avg_sq")), "missing \\['exp_avg_sq'\\]"),
        "stray param id": (edit(lambda s: s["state"].update({99: s["state"][first]})), "param id 99"),
        "integer state": (edit(lambda s: s["state"][first].update(exp_avg=s["state"][first]["exp_avg"].long())),
                          "must be a floating-point tensor"),
        "entry not a dict": (edit(lambda s: s["state"].update({first: None})),
                             "the state of param id 0 is a NoneType, not a dict of its states"),
    }


# torch's update loads through torch's own load_state_dict (its checks and
# casts, as the plain optimizer: an integer state is cast, as there), then
# checks each entry against the states the group keeps.
TORCH_UPDATE_MESSAGES = {
    "not a state dict": "expected an optimizer state dict",
    "group count": "different number of parameter groups",
    "group size": "doesn't match the size of optimizer's group",
    "amsgrad": "under its group's settings it keeps \\['step', 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'\\]",
    "shape": "has shape \\(3,\\)",
    "unknown key": "has keys \\['exp_avg', 'exp_avg_sq', 'momentum_buffer', 'step'\\]",
    "missing key": "has keys \\['exp_avg', 'step'\\]",
    "stray param id": "param id\\(s\\) \\[99\\]",
    "entry not a dict": "the state of param id 0 is a NoneType, not a dict of its states",
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fields", [{}, PACKED_KERNEL], ids=["torch-update", "packed-kernel"])
@pytest.mark.parametrize("case", ["not a state dict", "group count", "group size", "amsgrad", "shape", "unknown key",
                                  "missing key", "stray param id", "integer state", "entry not a dict"])
def test_bad_state_dicts_are_refused_and_change_nothing(case, fields, device):
    if not fields and case not in TORCH_UPDATE_MESSAGES:
        pytest.skip("torch's own load takes it, as the plain optimizer's does")
    model = build_model("mlp", device)
    ours = swap_optimizer("adamw", model.parameters(), swap_times=2, **fields)
    train("mlp", model, ours, 2, device)
    saved = round_trip(ours.state_dict())
    before = state_tensors(ours, model)
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in ours.param_groups])
    bad, message = bad_state_dicts(saved)[case]
    message = message if fields else TORCH_UPDATE_MESSAGES[case]
    with pytest.raises(ValueError, match=message):
        ours.load_state_dict(bad)
    after = state_tensors(ours, model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [{k: v for k, v in g.items() if k != "params"} for g in ours.param_groups] == groups_before


@pytest.mark.parametrize("device", DEVICES)
def test_load_keeps_hyper_parameters_and_hooks_run(device):
    model = build_model("mlp", device)
    ours = swap_optimizer("adamw", model.parameters(), swap_times=2)
    train("mlp", model, ours, 2, device)
    saved = round_trip(ours.state_dict())
    saved["param_groups"][0]["lr"] = 0.125
    calls = []
    ours.register_load_state_dict_pre_hook(lambda opt, sd: calls.append("pre"))
    ours.register_load_state_dict_post_hook(lambda opt: calls.append("post"))
    ours.register_state_dict_post_hook(lambda opt, sd: calls.append("saved"))
    ours.load_state_dict(saved)
    assert calls == ["pre", "post"]
    assert ours.param_groups[0]["lr"] == 0.125 and ours.optimizer.param_groups[0]["lr"] == 0.125
    ours.state_dict()
    assert calls[-1] == "saved"


def test_adam_state_dict_into_adamw_stays_decoupled_and_groups_are_copied():
    model = build_model("mlp", "cpu")
    adam = plain_optimizer("adam", model.parameters())
    train("mlp", model, adam, 2, "cpu")
    saved = round_trip(adam.state_dict())
    saved["param_groups"][0]["lr"] = torch.tensor(0.01)
    ours = swap_optimizer("adamw", build_model("mlp", "cpu").parameters())
    ours.load_state_dict(saved)
    assert ours.param_groups[0]["decoupled_weight_decay"] is True  # as AdamW.load_state_dict has it
    assert ours.param_groups[0]["lr"] is not saved["param_groups"][0]["lr"]  # a copy, as torch makes


def test_state_edits_and_resets_reach_the_store():
    """Like torch.optim: state.clear() starts the state anew, an edited entry is used."""
    (model, ours), (twin, plain) = side_by_side("mlp", "adamw", "cpu", swap_times=2)
    train("mlp", model, ours, 3, "cpu")
    train("mlp", twin, plain, 3, "cpu")
    ours.state.clear()
    plain.state.clear()
    first = next(p for p in model.parameters() if p.numel() >= 1024)
    first_twin = list(twin.parameters())[list(model.parameters()).index(first)]
    train("mlp", model, ours, 2, "cpu", first_step=3)
    train("mlp", twin, plain, 2, "cpu", first_step=3)
    assert ours.state[first]["step"].item() == 2 and len(ours.state_dict()["state"]) == len(list(model.parameters()))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6)
    ours.state[first]["step"] = torch.tensor(100.0)
    plain.state[first_twin]["step"] = torch.tensor(100.0)
    train("mlp", model, ours, 1, "cpu", first_step=5)
    train("mlp", twin, plain, 1, "cpu", first_step=5)
    assert ours.state_dict()["state"][list(model.parameters()).index(first)]["step"].item() == 101
    assert_close(first, first_twin, rtol=1e-5, atol=1e-6)


def test_master_copies_follow_params_written_outside_step():
    torch.manual_seed(2)
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    ours = swap_optimizer("adamw", model.parameters(), min_numel=16, master_weights=True, state_dtype=torch.float32)
    loaded = {k: (0.5 + torch.rand_like(v.float())).bfloat16() for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)  # resume order: the optimizer exists before the weights are loaded
    model(torch.randn(4, 64, dtype=torch.bfloat16)).sum().backward()
    ours.step()
    # One step of fp32 AdamW from the loaded weights, not from the old ones.
    fp32 = [loaded[name].float().requires_grad_() for name, _ in model.named_parameters()]
    for q, p in zip(fp32, model.parameters()):
        q.grad = p.grad.float()
    plain_optimizer("adamw", fp32).step()
    for p, q in zip(model.parameters(), fp32):
        master = ours.state[p]["master_param"]
        assert_close(master, q.detach(), rtol=1e-5, atol=1e-7)
        assert torch.equal(master.to(torch.bfloat16), p.detach())
    assert not torch.equal(model.weight.detach(), loaded["weight"])
