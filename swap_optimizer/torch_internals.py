"""The private torch APIs overlap_forward relies on, one wrapper each, so a
torch release that moves one fails here, naming it, and is mended in one
place. Each was checked here on torch 2.13 and 2.14, and against torch's
source, where all of them exist from 2.4 on; tests/overlap (which exercises
each: test_the_private_torch_apis_overlap_uses_work_on_this_torch) runs on
2.14 in CI and on the GPU machine's torch 2.11 in scripts/gpu_check.sh:

- the torch function mode stack (torch/csrc/utils/python_arg_parser and
  torch/overrides.py use it to enter and leave modes): a mode pushed at the
  bottom, so that modes entered later pop their own;
- the mode torch.set_default_device installs (torch/utils/_device.py), which
  must stay at the very bottom of that stack;
- nn.Module.compile()'s compiled call (a module compiled in place) and
  torch.compile's OptimizedModule wrapper (the module it runs);
- a module's own params (`_parameters`, what named_parameters walks) and its
  children (`_modules`), which module_structure reads in C++, with the
  compiled call above (csrc/bindings/overlap_checks.cpp);
- a storage's use count (`torch._C._storage_Use_Count`, which torch's own
  tests use): whether a param or grad shares its storage with another tensor;
- `torch.autograd._engine_run_backward`, through which Tensor.backward,
  torch.autograd.backward and torch.autograd.grad run the engine: a wrapper
  there waits for armed steps before any backward;
- torch._dynamo's frame counters: whether torch.compile has compiled
  anything in this process.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
from torch import nn

from . import _C

_MODE_STACK = ("_len_torch_function_stack", "_get_function_stack_at", "_pop_torch_function_stack",
               "_push_on_torch_function_stack")


def _mode_stack_call(name: str):
    function = getattr(torch._C, name, None)
    if function is None:
        raise RuntimeError(f"SwapOptimizer(overlap_forward=True): torch {torch.__version__} has no torch._C.{name}, "
                           "which overlap_forward needs (checked on torch 2.11 to 2.14); use overlap_forward=False "
                           "with this torch, or a torch version it was checked on")
    return function


def mode_stack_length() -> int:
    """How many torch function modes this thread's stack holds (2.11-2.14)."""
    return _mode_stack_call("_len_torch_function_stack")()


def mode_at(index: int):
    """The mode at `index` of this thread's stack, 0 the bottom (2.11-2.14)."""
    return _mode_stack_call("_get_function_stack_at")(index)


def pop_mode():
    """Takes the top mode off this thread's stack and returns it (2.11-2.14)."""
    return _mode_stack_call("_pop_torch_function_stack")()


def push_mode(mode) -> None:
    """Puts `mode` on top of this thread's stack, not entering it (2.11-2.14)."""
    _mode_stack_call("_push_on_torch_function_stack")(mode)


def default_device_mode():
    """The mode torch.set_default_device keeps on the stack, or None
    (torch.utils._device's thread-local, 2.11-2.14)."""
    return getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)


def compiled_in_place(module: nn.Module) -> bool:
    """module.compile(): its calls go straight into compiled code (the
    instance's `_compiled_call_impl`, 2.11-2.14)."""
    return module.__dict__.get("_compiled_call_impl") is not None


def compiled_wrapper_inner(module: nn.Module) -> Optional[nn.Module]:
    """The module a torch.compile wrapper (OptimizedModule) runs, if `module`
    is one (its `_orig_mod` child, 2.11-2.14)."""
    inner = module.__dict__.get("_modules", {}).get("_orig_mod")
    return inner if isinstance(inner, nn.Module) else None


def module_structure(model: nn.Module) -> bytes:
    """The model's modules (each once, as modules() visits them: `_modules`),
    whether each is compiled in place (`_compiled_call_impl`) and the params it
    holds itself (`_parameters`), by identity, 2.11-2.14: equal bytes while
    none of it changed. In C++, a walk of the dicts: in Python it cost about
    3 µs a module at every pass of overlap_forward."""
    return _C.module_structure(model)


def check_mode_stack() -> None:
    """Raises now, naming what is missing, where this torch lacks the mode
    stack's functions (overlap_forward checks at construction)."""
    for name in _MODE_STACK:
        _mode_stack_call(name)


_ALONE_COUNTS: dict[str, int] = {}  # device type -> a storage's count when one tensor alone holds it


def storage_is_shared(tensor: torch.Tensor) -> Optional[bool]:
    """Whether another tensor (a view, an alias) or a storage object holds
    `tensor`'s storage; None where this torch cannot say. Compared with a
    fresh tensor's count, not a constant: whether the storage object asked
    for counts itself may differ between versions (checked on 2.14: it
    does)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    kind = tensor.device.type
    if kind not in _ALONE_COUNTS:
        alone = torch.empty(1, device=tensor.device)  # (held: a freed storage's address counts garbage)
        _ALONE_COUNTS[kind] = use_count(alone.untyped_storage()._cdata)
    return use_count(tensor.untyped_storage()._cdata) > _ALONE_COUNTS[kind]


def call_before_every_backward(before: Callable[[], None]) -> bool:
    """Makes every backward (Tensor.backward, torch.autograd.backward and
    grad) call `before()` first, once per process; False where this torch
    runs its engine otherwise (they all call torch.autograd's
    `_engine_run_backward` on 2.11-2.14)."""
    run = getattr(torch.autograd, "_engine_run_backward", None)
    if run is None:
        return False
    if getattr(run, "swap_optimizer_before", None) is before:
        return True

    def run_after_before(*args, **kwargs):
        before()
        return run(*args, **kwargs)

    run_after_before.swap_optimizer_before = before
    torch.autograd._engine_run_backward = run_after_before
    return True


def compiled_anything() -> bool:
    """Whether torch.compile has compiled a frame in this process (torch._dynamo's frame counters, 2.11-2.14)."""
    if "torch._dynamo" not in sys.modules:  # (never imported: nothing compiled, and no import inside step())
        return False
    from torch._dynamo.utils import counters

    return bool(counters["frames"]["total"])
