"""Every bad argument of fused_adam_packed is refused with a message naming the
fix, before any element is written. The faulty entry is always the last param,
so a kernel that validated lazily would already have updated the others."""

import pytest
import torch

import swap_optimizer as so
from conftest import requires_cuda
from packed_reference import random_grads, random_params


def make_call(device="cpu", dtype=torch.float32, amsgrad=False, sizes=(64, 100, 33)):
    params = random_params(list(sizes), dtype, device, seed=5)
    grads = random_grads(params, 5, 0)
    layout, nbytes = so.plan_packed_layout(params, amsgrad=amsgrad)
    arena = torch.rand((nbytes + 3) // 4, device=device).view(torch.uint8)[:nbytes]
    steps = torch.zeros(len(params), device=device)
    kwargs = dict(lr=1e-3, amsgrad=amsgrad)
    return dict(params=params, grads=grads, arena=arena, layout=layout, steps=steps, kwargs=kwargs)


def call(c):
    so.fused_adam_packed(c["params"], c["grads"], c["arena"], c["layout"], c["steps"], **c["kwargs"])


def set_last_row(column, value):
    def mutate(c):
        c["layout"] = c["layout"].clone()
        c["layout"][-1, column] = value
    return mutate


def overlap_previous(c):
    c["layout"] = c["layout"].clone()
    c["layout"][-1, 0] = c["layout"][-2, 1] + 8


def set_kwarg(**updates):
    def mutate(c):
        c["kwargs"].update(updates)
    return mutate


def replace_last(key, make):
    def mutate(c):
        c[key] = list(c[key])
        c[key][-1] = make(c[key][-1])
    return mutate


def set_value(key, make):
    def mutate(c):
        c[key] = make(c[key])
    return mutate


CASES = {
    "overlapping regions": (overlap_previous, ValueError, "overlaps param 1"),
    "offset past the arena": (set_last_row(1, 1 << 40), ValueError, "arena holds only"),
    "negative offset": (set_last_row(0, -8), ValueError, "must be a byte offset >= 0"),
    "offset not a multiple of the element size": (set_last_row(1, 4098), ValueError, "multiple of its element size"),
    "numel column wrong": (set_last_row(4, 34), ValueError, "layout row updates 34 of them"),
    "piece past the param's end": (set_last_row(5, 1), ValueError, "param_offset \\+ numel must not exceed"),
    "negative param offset": (set_last_row(5, -1), ValueError, "param_offset \\+ numel must not exceed"),
    "step index past the step table": (set_last_row(6, 3), ValueError, "step_index is 3 but steps has 3"),
    "step index shared by two rows": (set_last_row(6, 0), ValueError, "uses step_index 0 like an earlier param"),
    "advance_step neither 0 nor 1": (set_last_row(7, 2), ValueError, "advance_step is 2 but must be 0 or 1"),
    "max_exp_avg_sq without amsgrad": (set_last_row(2, 0), ValueError, "amsgrad is off"),
    "master copy for an fp32 param": (set_last_row(3, 0), ValueError, "needs no master copy"),
    "missing max_exp_avg_sq with amsgrad": (set_kwarg(amsgrad=True), ValueError, "max_exp_avg_sq offset is -1"),
    "grad dtype differs": (replace_last("grads", lambda g: g.double()), TypeError, "grads must have the param's dtype"),
    "unsupported param dtype": (lambda c: (replace_last("params", lambda p: p.double())(c), replace_last("grads", lambda g: g.double())(c)), TypeError, "supported are float32, bfloat16 and float16"),
    "non-contiguous param": (lambda c: (replace_last("params", lambda p: torch.randn(66)[::2])(c), replace_last("grads", lambda g: torch.randn(33))(c)), ValueError, "not contiguous"),
    "grad shape differs": (replace_last("grads", lambda g: g.reshape(3, 11)), ValueError, "its grad has shape"),
    "sparse grad": (replace_last("grads", lambda g: g.to_sparse()), ValueError, "sparse"),
    "fewer grads than params": (set_value("grads", lambda gs: gs[:-1]), ValueError, "one grad per param"),
    "layout rows differ": (set_value("layout", lambda l: l[:-1].contiguous()), ValueError, "rows but there are 3 params"),
    "layout not int64": (set_value("layout", lambda l: l.int()), ValueError, "CPU int64 tensor"),
    "layout wrong columns": (set_value("layout", lambda l: l[:, :5].contiguous()), ValueError, "CPU int64 tensor"),
    "layout not contiguous": (set_value("layout", lambda l: l.t().contiguous().t()), ValueError, "layout must be contiguous"),
    "arena not uint8": (set_value("arena", lambda a: a.view(torch.float32) if a.numel() % 4 == 0 else a.float()), ValueError, "uint8"),
    "steps not 1-D": (set_value("steps", lambda s: s.reshape(1, -1)), ValueError, "steps must be"),
    "steps wrong dtype": (set_value("steps", lambda s: s.double()), ValueError, "steps must be"),
    "duplicate param": (lambda c: (replace_last("params", lambda p: c["params"][0][:33])(c),), ValueError, "shares its storage"),
    "bad state dtype": (set_kwarg(state_dtype=torch.float64), ValueError, "state_dtype must be"),
    "beta out of range": (set_kwarg(betas=(0.9, 1.0)), ValueError, "0 <= beta1, beta2 < 1"),
    "negative lr": (set_kwarg(lr=-1.0), ValueError, "lr >= 0"),
    "grad_scale wrong shape": (set_kwarg(grad_scale=torch.ones(2)), ValueError, "grad_scale must be a float32 tensor with one element"),
    "found_inf wrong dtype": (set_kwarg(found_inf=torch.zeros(1, dtype=torch.int32)), ValueError, "found_inf must be a float32"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_call_is_refused_before_any_write(name):
    mutate, error, message = CASES[name]
    c = make_call()
    mutate(c)
    params_before = [p.clone() for p in c["params"]]
    arena_before = c["arena"].clone()
    steps_before = c["steps"].clone()
    with pytest.raises(error, match=message):
        call(c)
    assert all(torch.equal(a, b) for a, b in zip(params_before, c["params"]))
    assert torch.equal(arena_before, c["arena"])
    assert torch.equal(steps_before, c["steps"])


def test_state_dtype_must_be_param_dtype_fp32_or_bf16():
    c = make_call(dtype=torch.bfloat16)
    c["kwargs"]["state_dtype"] = torch.float16
    with pytest.raises(ValueError, match="BFloat16 so its states must be in its dtype, float32 or bfloat16"):
        call(c)


def test_error_message_names_the_fix_for_overlap():
    c = make_call()
    overlap_previous(c)
    with pytest.raises(ValueError) as info:
        call(c)
    assert "every state needs its own region of the arena" in str(info.value)


@requires_cuda
def test_cuda_device_mismatches_are_refused():
    c = make_call(device="cuda")
    c["steps"] = c["steps"].cpu()
    with pytest.raises(ValueError, match="steps must be"):
        call(c)
    c = make_call(device="cuda")
    c["grads"] = [g.cpu() if i == 2 else g for i, g in enumerate(c["grads"])]
    with pytest.raises(ValueError, match="keep params, grads and arena on one device"):
        call(c)
    c = make_call(device="cuda")
    c["kwargs"]["found_inf"] = torch.zeros(1)
    with pytest.raises(ValueError, match="found_inf is on cpu"):
        call(c)
