"""The global module hooks of overlap_forward, on only while some overlap is
busy, the signal handlers wrapped while overlaps live, and the exit hook that
lets pending steps land before the interpreter finalizes."""

from __future__ import annotations

import atexit
import contextlib
import signal
import threading
import warnings
from typing import Protocol

import torch
from torch import nn

from ..step_guards import HANDLED_SIGNALS
from .guard import _ReadWatch, _remove_mode


class Overlap(Protocol):
    """What the hooks, the wrapped signal handlers and the exit hook use of
    an overlap (waits.ForwardOverlap): nothing else."""

    pending: bool
    probing: bool
    orphaned: bool

    def busy(self) -> bool: ...
    def on_call(self, module: nn.Module) -> None: ...
    def on_return(self, module: nn.Module) -> None: ...
    def finish_for_signal(self) -> None: ...
    def complete_pending_step(self) -> bool: ...
    def orphan(self) -> None: ...
    def finish_orphaned_step(self) -> None: ...
    def finish_pass(self) -> None: ...
    def drop_watch(self) -> None: ...

class _WaitFirst:
    """A Python signal handler, wrapped while overlapping optimizers live: it
    first waits for every pending step (a Ctrl-C or a preemption handler may
    read params, also in the middle of the forward, where nothing else would
    wait), then runs the handler it wraps."""

    def __init__(self, handler):
        self.handler = handler

    def __call__(self, signum, frame):
        for overlap in _Watch.overlaps:
            overlap.finish_for_signal()
        return self.handler(signum, frame)


class _Watch:
    """The global module hooks, installed while any overlap is busy (a pass
    pending, a probe, a watch left on a stack, CUDA's watch for captures; they
    do nothing for modules of no overlapping optimizer's model) and taken off
    once all are idle, so an idle module call costs nothing: any global hook
    sends every nn.Module call in the process down torch's slow path (1.2x on
    a model of tiny ops, with hooks that do nothing). Also the signal handlers
    wrapped while overlaps live, and watches left on a stack they could not
    be taken off yet (strays, removed by their thread at its next chance)."""

    # Held until their optimizer goes (its finalizer unregisters them); an
    # overlap keeps only a weak reference to its optimizer.
    overlaps: tuple[Overlap, ...] = ()
    handles: list = []
    strays: list[_ReadWatch] = []
    quiet_filter = None
    # Per orphaned pass, set once its thread has waited for the step and let
    # the runtime go (finish_before_exit waits for each).
    orphans_finished: list[threading.Event] = []
    # Held while the hooks go on or off. An overlap becomes busy before it
    # arms them (after_step), and disarm checks every overlap under this lock,
    # so a pass that begins meanwhile always finds them on.
    arming = threading.RLock()  # (reentrant: a collection inside arm() may finalize an optimizer, which disarms)

    @classmethod
    def register(cls, overlap: Overlap) -> None:
        if overlap not in cls.overlaps:
            cls.overlaps += (overlap,)
        if overlap.busy():
            cls.arm()

    @classmethod
    def arm(cls) -> None:
        """Puts the global hooks on, if they are off."""
        with cls.arming:
            if cls.handles:
                return
            register = nn.modules.module
            cls.handles = [register.register_module_forward_pre_hook(_before_call),
                           register.register_module_forward_hook(_after_call, always_call=True)]
            if cls.quiet_filter not in warnings.filters:
                # torch warns on each OptimizedModule call while global hooks
                # exist ("hooks fire an extra time"): ours expect that call.
                warnings.filterwarnings("ignore",
                                        message=r"Using `torch.compile\(module\)` when there are global hooks")
                cls.quiet_filter = warnings.filters[0]

    @classmethod
    def disarm_if_idle(cls) -> None:
        """Takes the global hooks off once no overlap is busy and no stray
        waits for its thread. torch copies the hooks before it calls them, so
        taking them off inside a pre-hook is safe; never from the always-called
        post hook, which torch's error path calls while it iterates the live
        dict. (Another thread's forward in that error path at the same moment
        would see the dict change: torch then raises its own RuntimeError,
        chained to the error being raised.)"""
        with cls.arming:
            if not cls.handles or cls.strays or any(overlap.busy() for overlap in cls.overlaps):
                return
            for handle in cls.handles:
                handle.remove()
            cls.handles = []

    @classmethod
    def unregister(cls, overlap: Overlap) -> None:
        if not overlap.complete_pending_step():
            # Collected on the thread that runs its pending step's update (a
            # garbage collection inside the rule's Python code), which cannot
            # wait for it: the pass goes on, orphaned, its hooks and watch
            # waiting as before; a thread of its own waits for the step and
            # lets the runtime go, and the stepping thread's next module call
            # (or the pass's end) unregisters it.
            overlap.orphan()
            finished = threading.Event()
            cls.orphans_finished = [e for e in cls.orphans_finished if not e.is_set()] + [finished]

            def finish():
                try:
                    overlap.finish_orphaned_step()
                finally:
                    finished.set()
            threading.Thread(target=finish, name="swap_optimizer orphaned step", daemon=True).start()
            return
        overlap.finish_pass()
        overlap.drop_watch()  # an optimizer dropped mid-pass leaves no watch behind
        cls.overlaps = tuple(o for o in cls.overlaps if o is not overlap)
        cls.sweep()
        cls.disarm_if_idle()
        if cls.overlaps:
            return
        if cls.quiet_filter in warnings.filters:
            warnings.filters.remove(cls.quiet_filter)
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED_SIGNALS:
                handler = signal.getsignal(signum)
                if isinstance(handler, _WaitFirst):
                    signal.signal(signum, handler.handler)

    @classmethod
    def wrap_signal_handlers(cls) -> None:
        """Wraps each Python handler of the usual signals (the default Ctrl-C
        one included) not wrapped yet: one installed after the last step is
        wrapped at the next. Only the main thread may set handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in HANDLED_SIGNALS:
            handler = signal.getsignal(signum)
            if callable(handler) and not isinstance(handler, _WaitFirst):
                signal.signal(signum, _WaitFirst(handler))

    @classmethod
    def sweep(cls) -> None:
        """Takes this thread's strays off its stack."""
        if not cls.strays:
            return
        here = threading.get_ident()
        for watch in list(cls.strays):
            if watch.thread == here and not watch.running_here():
                _remove_mode(watch)
                cls.strays.remove(watch)


@atexit.register
def finish_before_exit() -> None:
    """At exit, before the interpreter finalizes (and before the exit hooks
    registered before swap_optimizer was imported, which may save the model):
    pending steps land, those of live optimizers and of orphaned passes, and
    the runtimes dropped on their update threads are destroyed. A thread still
    at any of these would take the GIL from a finalizing interpreter, which
    ends it mid-destructor (std::terminate). A Ctrl-C meanwhile skips none of
    the waits: it is raised once they are all done."""
    from .. import _C

    waits = [overlap.complete_pending_step for overlap in _Watch.overlaps if not overlap.orphaned]
    # (an Event, not Thread.join: a join that a Ctrl-C interrupts marks the thread ended, bpo-45274)
    waits += [finished.wait for finished in _Watch.orphans_finished] + [_C.wait_for_dropped_runtimes]
    interrupted = None
    for wait in waits:
        while True:
            try:
                wait()
                break
            except KeyboardInterrupt as interrupt:  # waited for again: what it waits for still runs
                interrupted = interrupted or interrupt
    if interrupted is not None:
        raise interrupted


@contextlib.contextmanager
def hooks_suspended():
    """Benchmark only: the global hooks removed for a while (the forward as
    without any overlapping optimizer); nothing may be pending meanwhile."""
    if any(overlap.pending or overlap.probing or overlap.orphaned for overlap in _Watch.overlaps):
        raise RuntimeError("hooks_suspended(): a step is pending or a probe runs; wait() first")
    with _Watch.arming:
        handles, _Watch.handles = _Watch.handles, []
        for handle in handles:
            handle.remove()
    try:
        yield
    finally:
        if any(overlap.busy() for overlap in _Watch.overlaps):
            _Watch.arm()


def _before_call(module, args):
    if torch.compiler.is_compiling():  # traced into a compiled region: compiled calls wait at their entry
        return None
    if _Watch.strays:
        _Watch.sweep()
    busy = False
    for overlap in _Watch.overlaps:
        overlap.on_call(module)
        busy = busy or overlap.busy()
    if not busy:
        _Watch.disarm_if_idle()
    return None


def _after_call(module, args, output):
    if torch.compiler.is_compiling():
        return None
    for overlap in _Watch.overlaps:
        overlap.on_return(module)
    return None
