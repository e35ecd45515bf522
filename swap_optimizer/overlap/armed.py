"""The armed pass: while a deferred step is pending, its params and the grads
it reads watch themselves (docs/design.md, "Params that watch themselves: the
armed pass"). Each one's class becomes PendingParameter or PendingTensor, whose
`__torch_function__` waits for the tensor's pipeline position and gives back
the class of every armed tensor up to it. nn.Parameter and Tensor dispatch
without Python, so only ops that touch a pending tensor reach Python: no
global module hook and no torch function mode, and another model's forward
runs as if no step were pending.

A pass is armed only where this sees every read the mode would: every param
exactly an nn.Parameter or Tensor, every grad a Tensor, no alias of any of
them (their storage held by no other tensor), nothing compiled by
torch.compile in the process, no test hook that needs today's watch
(ForwardOverlap._may_arm). Else the pass keeps the global hooks and the read
watch."""

from __future__ import annotations

import threading
from typing import Optional, Protocol

import torch
from torch import nn

from .. import torch_internals
from .guard import _ATTRIBUTE_ACCESS, _METADATA_METHODS

# Attributes whose get or set neither reads a tensor's data nor hands out an
# alias of it (p.data, p.T and the like do: they wait).
_PLAIN_ATTRIBUTES = frozenset({
    "grad", "_grad", "shape", "dtype", "device", "layout", "requires_grad", "is_leaf", "grad_fn", "ndim",
    "names", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "itemsize",
    "nbytes", "_version", "output_nr", "_backward_hooks", "_post_accumulate_grad_hooks", "__dict__",
})


class ArmedWaiter(Protocol):
    """What an armed tensor's op calls (waits.ForwardOverlap)."""

    def wait_armed(self, position: int) -> None: ...


def _waits(func) -> bool:
    """Whether an op on a pending tensor must wait for its update."""
    name = getattr(func, "__name__", "")
    if name in _ATTRIBUTE_ACCESS:
        return getattr(getattr(func, "__self__", None), "__name__", "") not in _PLAIN_ATTRIBUTES
    return name not in _METADATA_METHODS


# Tests only: the armed pass's rules that OverlapTestHooks.knocked_out_rules
# may switch off, one at a time, each caught by its own case in
# tests/overlap/test_overlap_mutations.py (the pass still arms).
ARMED_RULES = {
    "armed_ops": "an op on an armed tensor gives its class back without waiting",
    "armed_lists": "armed tensors inside an op's lists and tuples (foreach ops, torch.cat) are not looked at",
    "armed_grads": "the grads the step reads are not armed",
    "armed_backward": "backward() and autograd.grad() do not wait for armed steps",
}


# The passes armed now (one per overlapping optimizer with a step pending).
_PASSES: list["ArmedPass"] = []


def _op_items(args, kwargs):
    """Where torch looks for __torch_function__ in an op: each argument, and
    the items of list and tuple arguments, with whether it came from one."""
    for value in (*args, *(kwargs or {}).values()):
        listed = isinstance(value, (list, tuple))
        for item in value if listed else (value,):
            yield item, listed


def _armed_in(args, kwargs) -> list[tuple["ArmedPass", int]]:
    """The tensors of armed passes in an op, each with its pass and position
    (given back already or not)."""
    found = []
    for item, listed in _op_items(args, kwargs):
        for armed in _PASSES:
            entry = armed.entries.get(id(item))
            if entry is not None and entry[0] is item and not (listed and "armed_lists" in armed.rules_off):
                found.append((armed, entry[1]))
    return found


def _any_pending(args, kwargs) -> bool:
    return any(type(item) is PendingParameter or type(item) is PendingTensor for item, _ in _op_items(args, kwargs))


def _pending_torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    found = _armed_in(args, kwargs)
    if found and _waits(func):  # (on the update thread wait_armed returns at once: _any_pending below stays true)
        furthest: dict = {}  # per pass, the last position the op needs (a wait covers the ones before)
        for armed, position in found:
            furthest[armed] = max(position, furthest.get(armed, position))
        for armed, position in furthest.items():
            armed.waiter.wait_armed(position)
        if not _any_pending(args, kwargs):
            return func(*args, **kwargs)  # every tensor of the op has its class back: the usual dispatch
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _pending_deepcopy(self, memo):
    # nn.Parameter's own __deepcopy__ builds the copy as type(self) before any
    # op on self; every other copy (a Tensor's deepcopy, pickle, torch.save)
    # starts with an op that waits here and goes on as the original class.
    for armed, position in _armed_in((self,), {}):
        armed.waiter.wait_armed(position)  # (gives its class back)
    if type(self) is PendingParameter:  # (the update thread, which never waits for its own step)
        raise RuntimeError("SwapOptimizer(overlap_forward=True): a copy of a param whose update is pending, made on "
                           "the thread that runs that update; copy it before step() or after optimizer.wait()")
    return self.__deepcopy__(memo)


class PendingParameter(nn.Parameter):
    """A param whose update is pending (overlap_forward=True): the first op
    that reads it waits for its update, and it is an nn.Parameter again."""

    __torch_function__ = classmethod(_pending_torch_function)
    __deepcopy__ = _pending_deepcopy


class PendingTensor(torch.Tensor):
    """A grad that a pending step still reads (overlap_forward=True): the
    first op on it waits for that read, and it is a Tensor again."""

    __torch_function__ = classmethod(_pending_torch_function)


_PENDING_CLASS = {nn.Parameter: PendingParameter, torch.Tensor: PendingTensor}
_OWN_CLASSES = (*_PENDING_CLASS, *_PENDING_CLASS.values())  # (torch calls no handler for Tensor and Parameter)


def _wait_for_armed_steps(rule: str = "") -> None:
    """Waits for every armed step, whole (their tensors are then given back),
    but those whose test switched `rule` off."""
    for armed in list(_PASSES):
        if rule not in armed.rules_off:
            armed.waiter.wait_armed(armed.last_position)


def _before_backward() -> None:
    # A backward reads params that graphs made before step() saved, and
    # accumulates into grads the step reads, in C++: no armed tensor sees it.
    _wait_for_armed_steps("armed_backward")


def foreign_handler(args, kwargs) -> bool:
    """Whether an op holds a tensor whose class has a __torch_function__ of
    its own (a nested tensor, a user's subclass): torch may call that one
    first, and one that runs the op itself, without looking at the other
    types (torch's default returns NotImplemented then), runs it past an
    armed tensor's."""
    return any(isinstance(item, torch.Tensor) and type(item) not in _OWN_CLASSES and
               type(item).__torch_function__ is not torch._C._disabled_torch_function_impl
               for item, _ in _op_items(args, kwargs))


def armable(tensor: torch.Tensor) -> bool:
    """Whether a tensor may watch itself: exactly a Parameter or Tensor, and
    the only tensor of its storage (an alias would read it unwatched)."""
    return type(tensor) in _PENDING_CLASS and torch_internals.storage_is_shared(tensor) is False


class ArmedPass:
    """One pending step's armed tensors, given back batch by batch in
    position order."""

    def __init__(self, waiter: ArmedWaiter, tensors: list[tuple[torch.Tensor, int]],
                 rules_off: frozenset = frozenset()):
        self.waiter = waiter
        self.rules_off = rules_off & ARMED_RULES.keys()  # (tests only)
        self.entries = {id(tensor): (tensor, position) for tensor, position in tensors}  # what _armed_in finds
        self.last_position = max((position for _, position in tensors), default=-1)
        # per position, in order: its tensors and the class each gets back
        by_position: dict[int, list] = {}
        for tensor, position in tensors:
            by_position.setdefault(position, []).append((tensor, type(tensor)))
        self._batches = sorted(by_position.items())
        self._given_back = 0  # batches [0, _given_back) have their classes back
        self._lock = threading.RLock()  # (a signal handler or a finalizer may give back from inside the loop)

    @staticmethod
    def may_arm_in_this_process() -> bool:
        """Whether every backward waits for armed steps on this torch, and
        torch.compile has compiled nothing: a compiled frame's guards on the
        params' class would compile it again at every armed pass. (A first
        compile while a pass is armed reads the params through ops that
        wait, as it builds its inputs: bitwise, tested on torch 2.14.)"""
        return torch_internals.call_before_every_backward(_before_backward) and \
            not torch_internals.compiled_anything()

    def arm(self) -> None:
        _PASSES.append(self)  # (first: a give-back interrupted here still finds every tensor)
        for _, batch in self._batches:
            for tensor, original in batch:
                tensor.__class__ = _PENDING_CLASS[original]

    def give_back_through(self, position: Optional[int] = None) -> None:
        """Every tensor up to `position` (all where None) a Parameter or Tensor again."""
        with self._lock:
            while self._given_back < len(self._batches) and \
                    (position is None or self._batches[self._given_back][0] <= position):
                for tensor, original in self._batches[self._given_back][1]:
                    tensor.__class__ = original
                self._given_back += 1
            if self._given_back == len(self._batches) and self in _PASSES:
                _PASSES.remove(self)
