"""Hardening: inputs and call paths that real trainers and adversarial users
produce. Each is either handled as torch.optim handles it, or refused with a
clear error before anything changes (params, states, steps, hyper-parameters).
Tolerance against the plain optimizer: rtol 1e-5, atol 1e-6 (fp32)."""

import pytest
import torch
from torch.testing import assert_close

import swap_optimizer as so
from conftest import DEVICES, requires_cuda
from swap_training import build_model, params_of, plain_optimizer, round_trip, state_tensors, swap_optimizer, train

TRAIN_TOL = dict(rtol=1e-5, atol=1e-6)


def trained(device="cpu", **fields):
    model = build_model("mlp", device)
    optimizer = swap_optimizer("adamw", model.parameters(), **fields)
    train("mlp", model, optimizer, 2, device)
    return model, optimizer


def unchanged(model, optimizer):
    """A check that nothing about the pair changes from now on."""
    params, states = params_of(model), state_tensors(optimizer, model)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

    def check():
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
        now = state_tensors(optimizer, model)
        assert now.keys() == states.keys() and all(torch.equal(now[k], states[k]) for k in states)
        assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == groups
    return check


# ------------------------------------------------------------ item 4
@pytest.mark.parametrize("bad", ["meta", "sparse"])
def test_load_state_dict_with_a_tensor_without_data_changes_nothing(bad):
    model, optimizer = trained()
    state_dict = round_trip(optimizer.state_dict())
    state_dict["param_groups"][0]["lr"] = 0.5
    last = max(state_dict["state"])
    value = state_dict["state"][last]["exp_avg_sq"]
    state_dict["state"][last]["exp_avg_sq"] = value.to("meta") if bad == "meta" else value.to_sparse()
    check = unchanged(model, optimizer)
    with pytest.raises(ValueError, match="'exp_avg_sq' is (a meta tensor|torch.sparse_coo)"):
        optimizer.load_state_dict(state_dict)
    check()


def test_load_state_dict_with_a_meta_step_changes_nothing():
    model, optimizer = trained()
    state_dict = round_trip(optimizer.state_dict())
    state_dict["state"][0]["step"] = torch.tensor(5.0, device="meta")
    check = unchanged(model, optimizer)
    with pytest.raises(ValueError, match="'step' is a meta tensor"):
        optimizer.load_state_dict(state_dict)
    check()


# ------------------------------------------------------------ item 5
def test_a_param_listed_twice_is_refused_at_wrap_time_naming_both():
    a, b, c = (torch.nn.Parameter(torch.randn(2000)) for _ in range(3))
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch's own warning
        inner = torch.optim.AdamW([a, b, c, b])
    with pytest.raises(ValueError, match="param 3 is the same tensor as param 1"):
        so.SwapOptimizer(inner)


def test_overlapping_params_are_refused_and_disjoint_views_accepted():
    buffer = torch.randn(5000)
    with pytest.raises(ValueError, match="params 0 and 1 share memory"):
        so.SwapOptimizer(torch.optim.AdamW([torch.nn.Parameter(buffer[:3000]), torch.nn.Parameter(buffer[2000:])]))
    # vector_to_parameters: disjoint views of one buffer are fine and train like separate tensors.
    model, twin = build_model("mlp", "cpu"), build_model("mlp", "cpu")
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    for p, view in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()])):
        p.data = view.view_as(p)
    ours, plain = swap_optimizer("adamw", model.parameters(), min_numel=0), plain_optimizer("adamw", twin.parameters())
    for first in (0, 3):
        train("mlp", model, ours, 3, "cpu", first)
        train("mlp", twin, plain, 3, "cpu", first)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close(p, q, **TRAIN_TOL)


def test_add_param_group_with_a_param_already_held_is_refused_before_anything():
    model, optimizer = trained()
    first = next(model.parameters())
    extra = torch.nn.Parameter(torch.randn(3000))
    check = unchanged(model, optimizer)
    with pytest.raises(ValueError, match="param 9 is the same tensor as param 8"):
        optimizer.add_param_group({"params": [extra, extra]})
    with pytest.raises(ValueError, match="share memory"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(first.data.view(-1)[:10])]})
    assert len(optimizer.param_groups) == 1
    check()


def test_data_replaced_to_alias_another_param_is_refused_at_step_time():
    model, optimizer = trained()
    params = list(model.parameters())
    params[2].data = params[0].data.view(-1)[:params[2].numel()].view_as(params[2])
    check = unchanged(model, optimizer)
    with pytest.raises(ValueError, match="params 0 and 2 share memory"):
        optimizer.step()
    check()


# ------------------------------------------------------------ item 6
def test_the_wrapped_optimizers_state_dict_calls_reach_the_store():
    model, optimizer = trained()
    donor_model = build_model("mlp", "cpu", seed=3)
    donor = plain_optimizer("adamw", donor_model.parameters())
    train("mlp", donor_model, donor, 4, "cpu")
    saved = round_trip(donor.state_dict())
    optimizer.optimizer.load_state_dict(saved)  # what a framework holding the inner optimizer does
    for p, q in zip(model.parameters(), donor_model.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], donor.state[q][key])
    inner = optimizer.optimizer.state_dict()
    assert inner["state"][0]["exp_avg"].data_ptr() == optimizer.state[next(model.parameters())]["exp_avg"].data_ptr()


# ------------------------------------------------------------ item 11
@requires_cuda
def test_step_inside_cuda_graph_capture_is_refused_at_once():
    model, optimizer = trained("cuda")
    loss = model(torch.randn(16, 24, device="cuda")).sum()
    loss.backward()
    check = unchanged(model, optimizer)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(graph, stream=stream):
            optimizer.step()
    check()


# ------------------------------------------------------------ item 20
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_foreach_and_fused_are_accepted_and_change_nothing(flag, device):
    model, twin = build_model("mlp", device), build_model("mlp", device)
    ours = so.SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, **{flag: True}),
                            swap_times=2)
    plain = plain_optimizer("adamw", twin.parameters())
    ours.param_groups[0]["betas"] = plain.param_groups[0]["betas"]
    train("mlp", model, ours, 4, device)
    train("mlp", twin, plain, 4, device)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close(p, q, **TRAIN_TOL)


# ------------------------------------------------------------ item 9
@pytest.mark.parametrize("inner_fused, unscale_in_step, advertised", [
    (False, None, False), (True, None, True), (False, True, True), (True, False, False)])
def test_in_step_unscaling_follows_the_wrapped_optimizer(inner_fused, unscale_in_step, advertised):
    """GradScaler hands step() its scale only when the wrapped optimizer would
    take it (fused=True) or unscale_in_step says so: a plain AdamW is then
    accepted where frameworks refuse in-step unscaling (Lightning's bf16-mixed
    with gradient clipping)."""
    model = build_model("mlp", "cpu")
    fields = {} if unscale_in_step is None else dict(unscale_in_step=unscale_in_step)
    optimizer = so.SwapOptimizer(torch.optim.AdamW(model.parameters(), fused=inner_fused or None), **fields)
    assert optimizer._step_supports_amp_scaling is advertised


# ------------------------------------------------------------ item 10
def test_compiled_step_and_compiled_model_train_like_the_plain_optimizer():
    """torch.compile(opt.step), a documented torch recipe, runs the step eagerly
    (no capturable=True forced on the groups), fullgraph included; a compiled
    model trains as an eager one does."""
    model, twin = build_model("mlp", "cpu"), build_model("mlp", "cpu")
    ours, plain = swap_optimizer("adamw", model.parameters(), swap_times=2), plain_optimizer("adamw", twin.parameters())
    compiled_model = torch.compile(model)
    for step_fn in (torch.compile(ours.step), torch.compile(ours.step, fullgraph=True)):
        for step in range(2):
            for m, o, fn in ((compiled_model, ours, step_fn), (twin, plain, plain.step)):
                o.zero_grad()
                x = torch.randn(16, 24, generator=torch.Generator().manual_seed(step))
                m(x).square().mean().backward()
                fn()
    assert not ours.param_groups[0]["capturable"]
    assert ours.state[next(model.parameters())]["step"].item() == 4
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close(p, q, **TRAIN_TOL)


# ------------------------------------------------------------ item 19
@pytest.mark.parametrize("device", DEVICES)
def test_frozen_params_show_no_state_until_their_first_grad(device):
    model, twin = build_model("mlp", device), build_model("mlp", device)
    ours, plain = swap_optimizer("adamw", model.parameters(), swap_times=2), plain_optimizer("adamw", twin.parameters())
    frozen = [0, 5]
    for m in (model, twin):
        for i, p in enumerate(m.parameters()):
            p.requires_grad_(i not in frozen)

    def keys(optimizer, m):
        return [i for i, p in enumerate(m.parameters()) if p in optimizer.state]
    train("mlp", model, ours, 3, device)
    train("mlp", twin, plain, 3, device)
    assert keys(ours, model) == keys(plain, twin) == [i for i in range(8) if i not in frozen]
    assert sorted(ours.state_dict()["state"]) == sorted(plain.state_dict()["state"])
    # Unfrozen: the state appears at its first step, from zero, as torch makes it.
    for m in (model, twin):
        list(m.parameters())[0].requires_grad_(True)
    train("mlp", model, ours, 2, device, first_step=3)
    train("mlp", twin, plain, 2, device, first_step=3)
    assert keys(ours, model) == keys(plain, twin)
    assert ours.state[next(model.parameters())]["step"].item() == 2
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close(p, q, **TRAIN_TOL)
    # A state dict without them loads as in torch: no entry until a grad.
    ours.load_state_dict(round_trip(plain.state_dict()))
    assert keys(ours, model) == keys(plain, twin)
    ours.state.clear()
    plain.state.clear()
    train("mlp", model, ours, 1, device, first_step=5)
    train("mlp", twin, plain, 1, device, first_step=5)
    assert keys(ours, model) == keys(plain, twin)
    assert all(ours.state[p]["step"].item() == 1 for p in model.parameters() if p in ours.state)


# ------------------------------------------------------------ item 14
@requires_cuda
def test_a_param_written_right_after_a_step_reaches_its_master_on_cuda():
    """The master copy follows a param written outside step(); on CUDA the
    write into the host store waits for the last step's copies out, which would
    otherwise land after it and bring the stale master back."""
    param = torch.nn.Parameter(torch.randn(1 << 26, device="cuda", dtype=torch.bfloat16))
    optimizer = so.SwapOptimizer(torch.optim.AdamW([param], lr=0.0, weight_decay=0.0), master_weights=True,
                                 state_dtype=torch.float32, swap_times=2)
    new = torch.randn_like(param)
    for _ in range(3):
        param.grad = torch.ones_like(param)
        optimizer.step()
        with torch.no_grad():
            param.copy_(new)  # at once, while the step's copies may still be in flight
        optimizer.step()  # lr 0: the param stays the rounding of its master
        assert torch.equal(param, new)
        new = torch.randn_like(param)
