"""Hardening: inputs and call paths that real trainers and adversarial users
produce. Each is either handled as torch.optim handles it, or refused with a
clear error before anything changes (params, states, steps, hyper-parameters).
Tolerance against the plain optimizer: rtol 1e-5, atol 1e-6 (fp32)."""

import pytest
import torch
from torch.testing import assert_close

import swap_optimizer as so
from conftest import DEVICES, PACKED_KERNEL, TESTS, requires_cuda
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
    # Column slices of one buffer interleave in memory but share no element: fine.
    grid = torch.randn(100, 128)
    so.SwapOptimizer(torch.optim.AdamW([torch.nn.Parameter(grid[:, :64]), torch.nn.Parameter(grid[:, 64:])]))
    with pytest.raises(ValueError, match="params 0 and 1 share memory"):
        so.SwapOptimizer(torch.optim.AdamW([torch.nn.Parameter(grid[:, :65]), torch.nn.Parameter(grid[:, 64:])]))
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
@pytest.mark.parametrize("inner_fused, unscale_in_step, advertised, fields", [
    (False, None, False, {}), (True, None, True, {}), (True, False, False, {}),
    (False, True, True, PACKED_KERNEL), (False, None, False, PACKED_KERNEL)])
def test_in_step_unscaling_follows_the_wrapped_optimizer(inner_fused, unscale_in_step, advertised, fields):
    """GradScaler hands step() its scale only when the wrapped optimizer would
    take it (fused=True) or unscale_in_step says so; the packed kernel takes
    it fused or not (a plain AdamW with fp32 states is then accepted where
    frameworks refuse in-step unscaling: Lightning's bf16-mixed with gradient
    clipping). torch's own update takes it only fused: refused otherwise."""
    model = build_model("mlp", "cpu")
    fields = dict(fields, **({} if unscale_in_step is None else dict(unscale_in_step=unscale_in_step)))
    optimizer = so.SwapOptimizer(torch.optim.AdamW(model.parameters(), fused=inner_fused or None), **fields)
    assert optimizer._step_supports_amp_scaling is advertised
    with pytest.raises(ValueError, match="takes GradScaler's scale and inf flag only in torch's fused Adam, AdamW"):
        so.SwapOptimizer(torch.optim.AdamW(build_model("mlp", "cpu").parameters()), unscale_in_step=True)


# ------------------------------------------------------------ item 10
@pytest.mark.slow  # inductor compiles the model for about 35 s on 2 cores
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
def test_a_state_edited_right_after_a_step_reaches_the_store_on_cuda():
    """An entry of `state` replaced through a reference taken before the step
    (no wait for its copies out) is written into the host store only after the
    step's copies out have landed, which would otherwise bring the old one back."""
    param = torch.nn.Parameter(torch.randn(1 << 25, device="cuda"))
    optimizer = so.SwapOptimizer(torch.optim.AdamW([param], lr=1e-3), swap_times=2)
    state = optimizer.state  # the dict itself: edits through it do not wait
    for _ in range(3):
        param.grad = torch.ones_like(param)
        optimizer.step()
        edited = torch.full((1 << 25,), 0.5)
        entry = dict(state[param])
        entry["exp_avg"] = edited  # at once, while the step's copies may still be in flight
        state[param] = entry
        param.grad = None
        optimizer.step()  # no grad: the param is skipped; the edit is written into the store
        assert torch.equal(optimizer.state[param]["exp_avg"], edited)


# ------------------------------------------------------------ items 2, 3
def test_torch_save_of_16_bit_master_and_mixed_states_saves_each_tensor_alone(tmp_path):
    """Each state tensor has a storage of its own over the store: torch.save
    accepts 16-bit states beside fp32 masters and steps (views of one slab in
    several dtypes), and saving one state writes its bytes, not its slab's."""
    model = build_model("mlp", "cpu", dtype=torch.bfloat16)
    extra = torch.nn.Parameter(torch.randn(4096))  # an fp32 param beside the bf16 ones
    optimizer = so.SwapOptimizer(torch.optim.AdamW(list(model.parameters()) + [extra], lr=1e-3),
                                 master_weights=True, swap_times=2)
    for step in range(2):
        for p in optimizer.param_groups[0]["params"]:
            p.grad = torch.randn_like(p)
        optimizer.step()
    path = tmp_path / "opt.pt"
    torch.save(optimizer.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    for index, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(loaded["state"][index][key], value)
    one = optimizer.state[extra]["exp_avg"]  # 16 KiB of a larger slab
    torch.save(one, tmp_path / "one.pt")
    assert (tmp_path / "one.pt").stat().st_size < one.numel() * one.element_size() + 4096


def written_outside_step(how, model):
    """Writes every param in a way that bumps no version counter."""
    params = list(model.parameters())
    if how == "data.clamp_":
        for p in params:
            p.data.clamp_(-0.05, 0.05)
    elif how == "data.copy_":
        for p in params:
            p.data.copy_(torch.full_like(p, 0.01))
    elif how == "data =":
        for p in params:
            p.data = torch.full_like(p, -0.02)
    else:  # vector_to_parameters
        flat = torch.nn.utils.parameters_to_vector(params).detach()
        torch.nn.utils.vector_to_parameters(flat * 0.5, params)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["data.clamp_", "data.copy_", "data =", "vector_to_parameters"])
def test_master_weights_take_writes_through_data(how, device):
    """With master_weights, a param written through .data is taken by its
    master at the next step (the kernel sees the param is no longer the
    master's rounding), exactly as a write that bumps the version (which the
    host follows): both runs stay bitwise equal."""
    def steps(model, optimizer, first, count):
        for step in range(first, first + count):
            generator = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=generator).to(device=p.device, dtype=p.dtype)
            optimizer.step()

    runs = []
    for through_data in (True, False):
        model = build_model("mlp", device, dtype=torch.bfloat16)
        optimizer = swap_optimizer("adamw", model.parameters(), master_weights=True, state_dtype=torch.float32,
                                   swap_times=2, min_numel=0)
        steps(model, optimizer, 0, 2)
        if through_data:
            written_outside_step(how, model)
        else:
            twin = build_model("mlp", device, dtype=torch.bfloat16)
            twin.load_state_dict(model.state_dict())
            written_outside_step(how, twin)
            with torch.no_grad():
                for p, q in zip(model.parameters(), twin.parameters()):
                    p.copy_(q)  # bumps the version: the host makes the master follow
        steps(model, optimizer, 2, 2)
        runs.append((params_of(model), state_tensors(optimizer, model)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


# ------------------------------------------------------------ item 8
class CopyingWrapper:
    """Lightning 1.x's LightningOptimizer: a copy of the optimizer's __dict__ in
    an instance of a subclass of the optimizer's class."""

    def __init__(self, optimizer):
        self.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k not in ("step", "__del__")}
        self.__class__ = type("Lightning" + optimizer.__class__.__name__, (self.__class__, optimizer.__class__), {})
        self._optimizer = optimizer


class ForwardingWrapper:
    """Lightning 2.x's: a subclass instance holding only the optimizer, other
    attributes forwarded by __getattr__."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.__class__ = type("Lightning" + optimizer.__class__.__name__, (self.__class__, optimizer.__class__), {})

    def __getattr__(self, item):
        return getattr(self._optimizer, item)


@pytest.mark.parametrize("wrapper", [CopyingWrapper, ForwardingWrapper])
def test_every_path_through_a_framework_wrapper_reaches_the_optimizer(wrapper):
    model, optimizer = trained()
    wrapped = wrapper(optimizer)
    assert isinstance(wrapped, so.SwapOptimizer)
    first = next(model.parameters())
    assert wrapped.state[first] is optimizer.state[first]
    saved = round_trip(wrapped.state_dict())
    assert saved["state"][0]["step"].item() == 2
    donor_model = build_model("mlp", "cpu", seed=4)
    donor = plain_optimizer("adamw", donor_model.parameters())
    train("mlp", donor_model, donor, 3, "cpu")
    wrapped.load_state_dict(round_trip(donor.state_dict()))
    for p, q in zip(model.parameters(), donor_model.parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg"], donor.state[q]["exp_avg"])
        assert optimizer.state[p]["step"].item() == 3
    wrapped.step()  # Lightning calls the inner step; the wrapper's works too
    assert optimizer.state[first]["step"].item() == 4
    assert wrapped.memory_stats() == optimizer.memory_stats()


# ------------------------------------------------------------ item 7
def test_reassigned_param_groups_then_load_state_dict_work_as_in_torch():
    """Lightning's finetuning callbacks reassign param_groups (resume with a
    backbone unfrozen): the store follows the new membership, states carried
    over by param, and loading a state dict saved with that grouping works;
    appending a param to a group by hand works too."""
    model, twin = build_model("mlp", "cpu"), build_model("mlp", "cpu")
    ours = swap_optimizer("adamw", list(model.parameters())[:4], swap_times=2, min_numel=0)
    plain = plain_optimizer("adamw", list(twin.parameters())[:4])
    train("mlp", model, ours, 2, "cpu")
    train("mlp", twin, plain, 2, "cpu")

    def regroup(optimizer, m):
        params = list(m.parameters())
        head = dict(optimizer.param_groups[0], params=params[:4])
        optimizer.param_groups = [head, dict(head, params=params[4:], lr=1e-3)]
    regroup(ours, model)
    regroup(plain, twin)
    assert ours.optimizer.param_groups is ours.param_groups
    train("mlp", model, ours, 2, "cpu", first_step=2)
    train("mlp", twin, plain, 2, "cpu", first_step=2)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close(p, q, **TRAIN_TOL)
    # A resume: regroup a fresh pair, then load the state dict saved with the new grouping.
    resumed_model = build_model("mlp", "cpu")
    resumed_model.load_state_dict(model.state_dict())
    resumed = swap_optimizer("adamw", list(resumed_model.parameters())[:4], swap_times=2, min_numel=0)
    regroup(resumed, resumed_model)
    resumed.load_state_dict(round_trip(ours.state_dict()))
    assert resumed.state[next(resumed_model.parameters())]["step"].item() == 4
    train("mlp", resumed_model, resumed, 2, "cpu", first_step=4)
    train("mlp", model, ours, 2, "cpu", first_step=4)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)
    # A param appended to a group by hand: its state starts at its first step, as in torch.
    extra = torch.nn.Parameter(torch.randn(300))
    ours.param_groups[1]["params"].append(extra)
    extra.grad = torch.ones_like(extra)
    ours.step()
    assert ours.state[extra]["step"].item() == 1


# ------------------------------------------------------------ item 1
def checkpoint_from_a_signal_handler(stop):
    """Run in a subprocess by the test below, so that a deadlock fails it by a
    timeout instead of hanging the suite."""
    import io
    import signal
    model = build_model("mlp", "cpu")
    # The packed kernel's step lets a handler run at a param boundary; torch's
    # update holds signals until the step is done (test_rules.py's interrupt tests).
    opt = swap_optimizer("adamw", model.parameters(), swap_times=4, min_numel=0, **PACKED_KERNEL)
    train("mlp", model, opt, 2, "cpu")
    params = list(model.parameters())
    before = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    saved, refused = [], []

    def on_sigint(signum, frame):  # a checkpoint from the Ctrl-C handler, as users write it
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        saved.append(buffer.getvalue())
        changes = {"load_state_dict": lambda: opt.load_state_dict(opt.state_dict()),
                   "add_param_group": lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(300))]}),
                   "step": opt.step}
        for name, change in changes.items():
            with pytest.raises(RuntimeError, match="while step\\(\\) runs"):
                change()
            refused.append(name)
        if stop:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    opt._set_test_hooks(fault="interrupt", fault_batch=2)
    try:
        train("mlp", model, opt, 1, "cpu", first_step=2)
    except KeyboardInterrupt:
        assert stop
    after = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    assert len(saved) == 1 and refused == ["load_state_dict", "add_param_group", "step"], refused
    assert len(opt.param_groups) == 1 and len(opt.state_dict()["state"]) == len(params)
    assert stop or all(s["step"].item() == 3 for s in after), "the step goes on after the handler"
    state = torch.load(io.BytesIO(saved[0]), weights_only=True)["state"]
    kinds = []
    for i in range(len(params)):
        old = all(torch.equal(state[i][k], before[i][k]) for k in before[i])
        new = all(torch.equal(state[i][k], after[i][k]) for k in after[i])
        assert old or new, f"param {i} is neither wholly old nor wholly new in the handler's checkpoint"
        kinds.append("old" if old else "new")
    assert kinds[0] == "new" and kinds[-1] == "old", kinds
    print("signal case passed", kinds)


@pytest.mark.parametrize("stop", [False, True])
def test_a_signal_handler_saves_a_consistent_checkpoint_during_a_step(stop):
    """A SIGINT handler calling state_dict() while step() runs is served at once
    (no deadlock on the step's lock): each param wholly old or wholly new;
    load_state_dict, add_param_group and step there are refused; the step
    goes on, or stops if the handler raises."""
    import os
    import subprocess
    import sys
    folders = [TESTS, os.path.dirname(os.path.abspath(__file__))]
    code = (f"import sys; sys.path[:0] = {folders!r}; "
            f"import test_hardening; test_hardening.{checkpoint_from_a_signal_handler.__name__}({stop})")
    # -P: the installed package, not a checkout's source folder in the current directory.
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "signal case passed" in out.stdout, out.stdout + out.stderr[-3000:]


# ------------------------------------------------------------ item 15
@requires_cuda
def test_writes_on_one_cuda_stream_then_a_step_on_another():
    """Resident states written at construction and by load_state_dict on one
    stream are ordered before a step on another stream."""
    results = []
    for streams in ((None, None), (torch.cuda.Stream(), torch.cuda.Stream())):
        model = build_model("mlp", "cuda")
        donor = build_model("mlp", "cuda", seed=5)
        plain = plain_optimizer("adamw", donor.parameters())
        train("mlp", donor, plain, 2, "cuda")
        with torch.cuda.stream(streams[0] or torch.cuda.current_stream()):
            if streams[0] is not None:
                torch.cuda._sleep(200_000_000)  # the writes below land late on this stream
            optimizer = swap_optimizer("adamw", model.parameters(), state_keys=("exp_avg",), swap_times=2)
            optimizer.load_state_dict(round_trip(plain.state_dict()))
        with torch.cuda.stream(streams[1] or torch.cuda.current_stream()):
            train("mlp", model, optimizer, 3, "cuda")
        torch.cuda.synchronize()
        results.append(params_of(model))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_optimizer_is_freed_by_reference_counting():
    """No reference cycle (a strong self-reference for wrappers, bound methods
    on the inner optimizer): the store goes when the last reference does."""
    import gc
    import weakref
    model = build_model("mlp", "cpu")
    optimizer = swap_optimizer("adamw", model.parameters())
    train("mlp", model, optimizer, 1, "cpu")
    gone = weakref.ref(optimizer)
    gc.disable()
    try:
        del optimizer
        assert gone() is None
    finally:
        gc.enable()


def test_grad_scaler_through_a_copying_wrapper_skips_an_inf_step():
    """GradScaler sets grad_scale / found_inf on the object it is given (a
    framework wrapper): the optimizer itself must see them, or an inf step
    would be applied."""
    model = build_model("mlp", "cpu")
    optimizer = so.SwapOptimizer(torch.optim.AdamW(model.parameters(), fused=True), unscale_in_step=True)
    wrapped = CopyingWrapper(optimizer)
    assert wrapped._step_supports_amp_scaling and ForwardingWrapper(optimizer)._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    train("mlp", model, optimizer, 1, "cpu")
    before = params_of(model)
    optimizer.zero_grad()
    scaler.scale(model(torch.randn(4, 24)).sum() * float("inf")).backward()
    scaler.step(wrapped)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert optimizer.state[next(model.parameters())]["step"].item() == 1
