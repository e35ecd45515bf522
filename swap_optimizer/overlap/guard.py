"""The read watch of overlap_forward: a TorchFunctionMode put at the bottom
of the stepping thread's mode stack, which records the probe's reads and, while
a step is pending, makes ops outside the model's calls wait for the params
(and grads) they touch, looked up by the byte spans of their storage. Which
ops need a look at all is decided in C++ (swap_optimizer._C.PassChecks and
WatchCalls, csrc/bindings/overlap_checks.cpp): the rest run without Python."""

from __future__ import annotations

import weakref
from typing import Optional, Protocol

import torch
from torch.overrides import TorchFunctionMode

from .. import _C, torch_internals


class OpWatcher(Protocol):
    """What the watch calls for each op that needs data (waits.ForwardOverlap)."""

    checks: _C.PassChecks  # which ops need on_op

    def on_op(self, func, args, kwargs) -> None: ...

# Methods that read only metadata: they never need a param's update. Attribute
# getters and setters (p.grad, p.data, p.shape, p.grad = None) are left out by
# kind: an alias they return is caught when it is used (lookups are by storage).
_METADATA_METHODS = frozenset({
    "size", "stride", "dim", "ndimension", "numel", "nelement", "storage_offset", "is_contiguous",
    "element_size", "is_floating_point", "is_complex", "is_signed", "get_device", "__len__", "__hash__",
    "requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook", "_is_view",
    "is_pinned", "is_shared", "_set_grad_enabled",
})
_ATTRIBUTE_ACCESS = frozenset({"__get__", "__set__", "__delete__"})
# Attribute accesses that do touch data: `p.data = t` points the param's
# tensor (which a pending update writes) at t's storage; CUDA's array interface
# hands a raw pointer to CuPy or Numba.
_DATA_ATTRIBUTES = frozenset({("__set__", "data"), ("__get__", "__cuda_array_interface__")})
_BACKWARD_FUNCTIONS = frozenset({"backward", "grad"})  # Tensor.backward, torch.autograd.backward / grad
# Ops whose check only the Python side decides (_needs_data, ForwardOverlap.on_op), whatever they touch.
_CHECKED_IN_PYTHON = _ATTRIBUTE_ACCESS | _BACKWARD_FUNCTIONS


def pass_checks() -> _C.PassChecks:
    """What a ForwardOverlap's passes check of each op (its spans and runtime
    are set per pass): every other op runs at once."""
    return _C.PassChecks(_METADATA_METHODS, _CHECKED_IN_PYTHON)


def _needs_data(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in _ATTRIBUTE_ACCESS:
        return (name, getattr(getattr(func, "__self__", None), "__name__", "")) in _DATA_ATTRIBUTES
    return name not in _METADATA_METHODS


def _insert_mode(mode: TorchFunctionMode) -> None:
    """Pushes `mode` at the bottom of this thread's torch function mode stack,
    so that modes entered before it, which leave by popping the top (user
    modes, `with torch.device(...)`), pop their own: only the default device
    of torch.set_default_device stays below it, as its exit requires."""
    default = torch_internals.default_device_mode()
    above = []
    try:
        while torch_internals.mode_stack_length() > 0:
            entry = torch_internals.mode_at(torch_internals.mode_stack_length() - 1)
            if torch_internals.mode_stack_length() == 1 and entry is default:
                break
            above.append(torch_internals.pop_mode())
        torch_internals.push_mode(mode)
    finally:  # also if a signal interrupts: the user's modes go back, in order
        for entry in reversed(above):
            torch_internals.push_mode(entry)


def _remove_mode(mode: TorchFunctionMode) -> bool:
    """Takes `mode` out of this thread's stack, wherever it is; whether it was there."""
    above, found = [], False
    try:
        for _ in range(torch_internals.mode_stack_length()):
            entry = torch_internals.pop_mode()
            if entry is mode:
                found = True
                break
            above.append(entry)
    finally:
        for entry in reversed(above):
            torch_internals.push_mode(entry)
    return found


class _ReadWatch(TorchFunctionMode):
    """Sees every torch op on the thread whose mode stack holds it (the one
    that stepped): records reads during the probe, and makes ops outside the
    model's calls wait while a step is pending."""

    def __init__(self, overlap: OpWatcher):
        super().__init__()
        self._overlap = weakref.ref(overlap)
        self.thread: Optional[int] = None  # whose stack holds it
        self._calls = _C.WatchCalls(overlap.checks)

    def running_here(self) -> bool:
        """Its own call runs on this thread: torch holds it off the stack until
        that call returns, so it can be neither taken off nor pushed again."""
        return self._calls.running_here()

    def retire(self) -> None:
        """Inert from now on (left on a stack it cannot be taken off yet)."""
        self._overlap = lambda: None
        self._calls.retire()

    def _check_op(self, func, args, kwargs) -> None:
        overlap = self._overlap()
        if overlap is not None and _needs_data(func):
            overlap.on_op(func, args, kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Under torch.compile this is traced, not run: compiled regions are
        # outside what the watch can see (docs/design.md, limits).
        if torch.compiler.is_compiling():
            return func(*args, **(kwargs or {}))
        return self._calls.call(func, args, kwargs, self._check_op)
