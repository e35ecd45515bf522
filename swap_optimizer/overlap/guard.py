"""The read watch of overlap_forward: a TorchFunctionMode put at the bottom
of the stepping thread's mode stack, which records the probe's reads and, while
a step is pending, makes ops outside the model's calls wait for the params
(and grads) they touch, looked up by the byte spans of their storage (in C++:
swap_optimizer._C.SpanIndex, csrc/bindings/overlap_checks.cpp)."""

from __future__ import annotations

import threading
import weakref
from typing import Optional, Protocol

import torch
from torch.overrides import TorchFunctionMode

from .. import torch_internals


class OpWatcher(Protocol):
    """What the watch calls for each op that needs data (waits.ForwardOverlap)."""

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
        self._running = threading.local()

    def running_here(self) -> bool:
        """Its own call runs on this thread: torch holds it off the stack until
        that call returns, so it can be neither taken off nor pushed again."""
        return getattr(self._running, "depth", 0) > 0

    def retire(self) -> None:
        """Inert from now on (left on a stack it cannot be taken off yet)."""
        self._overlap = lambda: None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        overlap = self._overlap()
        # Under torch.compile this is traced, not run: compiled regions are
        # outside what the watch can see (docs/design.md, limits).
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        self._running.depth = getattr(self._running, "depth", 0) + 1
        try:
            if overlap is not None and _needs_data(func):
                overlap.on_op(func, args, kwargs)
            return func(*args, **kwargs)
        finally:
            self._running.depth -= 1
