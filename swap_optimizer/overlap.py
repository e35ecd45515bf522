"""Overlapping a deferred step with the next forward: where each read of a
param waits for that param's update (docs/design.md, "Overlap with the
forward").

A deferred step's updates bump no version counter, so a read that does not
wait would be silent. The waits follow what the model does, not how it is
built:

- The probe. The first overlapped step after construction or a rebuild runs
  whole, inside step(). Until the next step(), a TorchFunctionMode records
  which params are read or written (by storage: reads through .data,
  .detach(), a view or an alias made earlier count, under no_grad too) and,
  through global module hooks, which modules of `model` are called, in order.
- The wait schedule. Each param waits at the last module call before its first read
  inside a module call. Two static rules add to that: a call of a block
  (children of ModuleLists and plain nn.Sequentials) waits for its whole
  subtree, and a call of any module waits for its direct params. Batches are
  ordered by where they are first needed; params whose grads appeared
  although no read of them was seen finish inside step(). The last call of
  the probe's sequence waits for the rest.
- Every overlapped pass. The calls are compared with the probe's sequence;
  at the first difference (layer drop, routing, an eval path) the whole step
  is waited for there. Nothing read before was stale, as the prefix matched.
- Outside the model's calls (depth 0 on the thread that called step()), the
  same TorchFunctionMode guards every op while the step is pending: an op
  that touches a param, or a grad the step reads, waits for its position;
  backward() waits for the whole step (it may write grads the step reads).
  EMA updates, norm logging, copy.deepcopy(model) and torch.save(model) wait
  by themselves.
- Compiled models: a torch.compile wrapper's call, or a model with a module
  compiled in place, waits for the whole step at its first call; a model
  compiled in place at its root runs no eager hook at all, so its steps
  complete inside step(). A CUDA graph capture of the forward switches
  overlap off for later steps (replays run no hooks).

Nothing is attached to the model: the hooks are global and the model stays
picklable; a deepcopy or a pickled copy has other params and modules, so it
never waits for this optimizer's step or keeps it alive.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import signal
import threading
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import torch_internals
from .step_guards import HANDLED_SIGNALS, capturing

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


def _tensors_in(args, kwargs, lists: bool = True) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments, also inside lists and tuples
    (foreach ops, torch.cat, RNNs' flat weights). lists=False: tests only,
    the rule "lists" knocked out."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif lists and isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item


def _byte_span(tensor: torch.Tensor) -> Optional[tuple[int, int]]:
    """[first, last + 1) bytes a tensor's elements occupy; None when it has
    no storage to read (meta, sparse, empty, tensor subclasses without one)."""
    if tensor.layout != torch.strided or tensor.is_meta or tensor.numel() == 0:
        return None
    try:
        begin = tensor.data_ptr()
    except RuntimeError:
        return None
    extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    return begin, begin + extent * tensor.element_size()


class _SpanIndex:
    """Which of some tensors (by bytes, on one device) another tensor touches."""

    def __init__(self, tagged: list[tuple[torch.Tensor, int]], device: torch.device):
        spans = sorted((*span, tag) for tensor, tag in tagged if (span := _byte_span(tensor)) is not None)
        self._device_type = device.type
        self._begins = [begin for begin, _, _ in spans]
        self._ends = [end for _, end, _ in spans]
        self._tags = [tag for _, _, tag in spans]
        self._reach = []  # the greatest end among spans[0..i]
        for end in self._ends:
            self._reach.append(max(end, self._reach[-1]) if self._reach else end)

    def touched(self, tensor: torch.Tensor) -> list[int]:
        if not self._begins or tensor.device.type != self._device_type:
            return []
        span = _byte_span(tensor)
        if span is None:
            return []
        begin, end = span
        tags = []
        i = bisect.bisect_left(self._begins, end) - 1
        while i >= 0 and self._reach[i] > begin:
            if self._ends[i] > begin:
                tags.append(self._tags[i])
            i -= 1
        return tags


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

    def __init__(self, overlap: "ForwardOverlap"):
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


def _is_plain_sequential(module: nn.Module, expand: bool = True) -> bool:
    """nn.Sequential or a subclass that keeps its forward: it calls its
    children in order, and a forward may iterate it without calling it.
    expand=False: tests only, the rule "sequential" knocked out."""
    return expand and isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _is_container(module: nn.Module, expand: bool = True) -> bool:
    """A module whose children are the blocks: ModuleList, ModuleDict, a plain
    nn.Sequential, or a holder whose forward is Module's own (never called)."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) or _is_plain_sequential(module, expand) or \
        type(module).forward is nn.Module.forward


def _called_blocks(module: nn.Module, expand: bool = True) -> list[nn.Module]:
    """module, or, when it is a container, the blocks below it."""
    if not _is_container(module, expand):
        return [module]
    return [block for child in module.children() for block in _called_blocks(child, expand)]


def find_blocks(model: nn.Module, expand_sequential: bool = True) -> list[nn.Module]:
    """The children of the model's outermost ModuleLists and plain
    nn.Sequentials, in order (containers among them give their blocks); else
    the model's top-level children. A block's call waits for its whole
    subtree's params (MultiheadAttention reads out_proj.weight itself).
    expand_sequential=False: tests only, the rule "sequential" knocked out."""
    expand = expand_sequential
    root = model
    while isinstance(root, nn.parallel.DistributedDataParallel):  # a wrapper of one module
        root = root.module
    blocks: list[nn.Module] = []
    if isinstance(root, nn.ModuleList) or _is_plain_sequential(root, expand):
        blocks = _called_blocks(root, expand)

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList) or _is_plain_sequential(child, expand):
                blocks.extend(block for item in child.children() for block in _called_blocks(item, expand))
            else:
                visit(child)

    if not blocks:
        visit(root)
    if not blocks:
        blocks = [block for child in root.children() for block in _called_blocks(child, expand)]
    seen, unique = set(), []
    for block in blocks:  # a block listed twice is one block
        if id(block) not in seen:
            seen.add(id(block))
            unique.append(block)
    return unique


_compiled_in_place = torch_internals.compiled_in_place
_wrapped_module = torch_internals.compiled_wrapper_inner


def check_model(model: nn.Module) -> None:
    """Refuses wrappers that read every param before any of its calls."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"SwapOptimizer(overlap_forward=True): model must be the torch.nn.Module whose forward "
                        f"uses the params, got {type(model).__name__}")
    for module in model.modules():
        if isinstance(module, nn.DataParallel):
            raise ValueError("SwapOptimizer(overlap_forward=True): nn.DataParallel copies every param to its devices "
                             "before any block runs, which would read them before their update; use "
                             "DistributedDataParallel, or overlap_forward=False")
        if type(module).__name__ == "FullyShardedDataParallel":
            raise ValueError("SwapOptimizer(overlap_forward=True) does not support FSDP (FullyShardedDataParallel "
                             "gathers params on its own stream ahead of the blocks that use them); use "
                             "overlap_forward=False with FSDP")


def _structure(model: nn.Module) -> list[tuple]:
    """The model's modules and the params each holds directly, by identity
    (a module replaced, a weight tied or untied), and which are compiled in place."""
    return [(id(m), _compiled_in_place(m), *map(id, torch_internals.own_params(m))) for m in model.modules()]


class _WaitSchedule:
    """Where an overlapped pass waits, from the probe: the expected sequence of
    module calls, and per call the pipeline position that must be ready."""

    def __init__(self, structure: list[tuple], sequence: list[nn.Module], wait_at: list[int],
                 step_position: int, compiled: bool):
        self.structure = structure  # the model as the probe saw it (its modules are held by the sequence)
        self.sequence = sequence
        self.wait_at = wait_at
        self.step_position = step_position
        self.compiled = compiled


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
    overlaps: tuple["ForwardOverlap", ...] = ()
    handles: list = []
    strays: list[_ReadWatch] = []
    quiet_filter = None
    # Per orphaned pass, set once its thread has waited for the step and let
    # the runtime go (finish_before_exit waits for each).
    orphans_finished: list[threading.Event] = []
    # Held while the hooks go on or off. An overlap becomes busy before it
    # arms them (after_step), and disarm checks every overlap under this lock,
    # so a pass that begins meanwhile always finds them on.
    arming = threading.Lock()

    @classmethod
    def register(cls, overlap: "ForwardOverlap") -> None:
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
        waits for its thread. (torch copies the hooks before it calls them:
        taking them off inside one is safe.)"""
        with cls.arming:
            if not cls.handles or cls.strays or any(overlap.busy() for overlap in cls.overlaps):
                return
            for handle in cls.handles:
                handle.remove()
            cls.handles = []

    @classmethod
    def unregister(cls, overlap: "ForwardOverlap") -> None:
        if not overlap.complete_pending_step():
            # Collected on the thread that runs its pending step's update (a
            # garbage collection inside the rule's Python code), which cannot
            # wait for it: the pass goes on, orphaned, its hooks and watch
            # waiting as before; a thread of its own waits for the step and
            # lets the runtime go, and the stepping thread's next module call
            # (or the pass's end) unregisters it.
            overlap.orphaned = True
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
    from . import _C

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
    if any(overlap.pending or overlap.probing for overlap in _Watch.overlaps):
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


_UNRANKED = 1 << 62


def _wait_for_dropped_step(runtime) -> None:
    """Waits for the step a dropped optimizer (or an exiting interpreter) left;
    a finalizer, an exit hook or the thread that finishes an orphaned pass
    cannot raise, so a failure is a warning that says what it left."""
    try:
        runtime.wait_step()
    except Exception as error:  # noqa: BLE001  (reported, not swallowed)
        warnings.warn(f"SwapOptimizer(overlap_forward=True) was dropped (or the interpreter exited) while its last "
                      f"step was still running, and that step failed: {error}. The params that step had not reached "
                      "keep their values from before it (a param cut into pieces may be partly updated); load the "
                      "last checkpoint into a new optimizer, or keep the optimizer and call optimizer.wait() after "
                      "the last step() to see such a failure raised", RuntimeWarning, stacklevel=3)

# Tests only: the rules OverlapTestHooks.knocked_out_rules may switch off, one at
# a time, each caught by its own test in tests/overlap/test_overlap_mutations.py.
KNOCKABLE_RULES = {
    "probe_rank_late": "a read the probe saw is placed one call after the call it was read in",
    "probe_ranks": "the probe's reads are ignored (only the static rules place waits)",
    "subtree": "a block's call waits for its direct params only, not its whole subtree",
    "sequential": "the children of a plain nn.Sequential are not blocks",
    "lists": "tensors inside an op's lists and tuples (foreach ops, torch.cat) are not looked at",
    "backward": "backward() and autograd.grad() outside the model's calls do not wait for the step",
    "grads": "the grads the step reads are left out of the watched spans",
    "unproven": "an overlapped step on CUDA is not marked unproven (a capture after a stream wait is taken)",
}


UNGUARDABLE = ("ops", "divergence", "compiled")


@dataclass(frozen=True)
class OverlapTestHooks:
    """Tests only, given through ForwardOverlap.set_test_hooks: negative
    controls and a simulation. knocked_out: params whose waits are left out;
    unguarded: waits switched off by kind, of UNGUARDABLE ("ops": outside the
    model's calls, "divergence": where calls differ from the probe's,
    "compiled": at a compiled model's first call); knocked_out_rules: single
    rules switched off, of KNOCKABLE_RULES; as_if_cuda: the capture rules as
    for params on a GPU (idle calls watched, an overlapped step unproven until
    synchronize()), for a CPU test with `capturing` simulated."""
    knocked_out: frozenset = frozenset()
    unguarded: frozenset = frozenset()
    knocked_out_rules: frozenset = frozenset()
    as_if_cuda: bool = False


class ForwardOverlap:
    """The waits of one SwapOptimizer(overlap_forward=True): its probe, wait schedule
    and the state of the pass in progress (from a step() to the next). The
    optimizer drives it through its methods (check_params, lay_out, may_defer,
    before_step, after_step, end_enqueuing, end_pass, synchronized, wait_all,
    busy); tests through set_test_hooks."""

    def __init__(self, optimizer, model: nn.Module, params: list[torch.Tensor]):
        torch_internals.check_mode_stack()
        check_model(model)
        self.model = model
        self._optimizer = weakref.ref(optimizer)  # the model never keeps the optimizer alive
        self._in_model = {id(p) for p in model.parameters()}
        self._check_in_model(params)
        self.params = list(params)
        self.device = params[0].device if params else torch.device("cpu")
        self.schedule: Optional[_WaitSchedule] = None
        self.graphed = False     # a CUDA graph captured a forward: later steps complete inside step()
        self.unproven = False    # CUDA: a deferred step no host sync has seen end
        self.watch_captures = self.device.type == "cuda"  # idle calls too: a graph captured before a step
        self.root_compiled = _compiled_in_place(model)
        self.test_hooks = OverlapTestHooks()
        self._param_positions: list[int] = []  # per param: the last pipeline position holding it
        # Per param, from the last probe: where the forward first needs it (_first_reads); None before one.
        self.first_reads: Optional[list[int]] = None
        self._last_step_deferred = False
        self.orphaned = False  # its optimizer is gone, its last step not yet waited for (_Watch.unregister)
        self._set_modules()
        self._lock = threading.RLock()
        self.enqueuing = False  # set by before_step(); step() clears it once after_step() has run
        self._reset_pass()
        self._watch = _ReadWatch(self)
        _Watch.register(self)
        self._finalizer = weakref.finalize(optimizer, _Watch.unregister, self)

    def set_test_hooks(self, **changes) -> None:
        """Tests only: changes fields of the OverlapTestHooks (the others stay)."""
        unknown_rules = set(changes.get("knocked_out_rules", ())) - set(KNOCKABLE_RULES)
        unknown_kinds = set(changes.get("unguarded", ())) - set(UNGUARDABLE)
        if unknown_rules or unknown_kinds:
            raise ValueError(f"set_test_hooks: unknown rules {sorted(unknown_rules)} or kinds {sorted(unknown_kinds)}; "
                             f"rules are {sorted(KNOCKABLE_RULES)}, kinds {list(UNGUARDABLE)}")
        sets = {key: frozenset(value) for key, value in changes.items() if key != "as_if_cuda"}
        self.test_hooks = replace(self.test_hooks, **{**changes, **sets})
        self.watch_captures = self._on_cuda()
        if self.busy():
            _Watch.arm()

    def _on_cuda(self) -> bool:
        """Whether the capture rules apply: params on a GPU (or a test's as_if_cuda)."""
        return self.device.type == "cuda" or self.test_hooks.as_if_cuda

    def end_enqueuing(self) -> None:
        """step() is done enqueuing (its pass has begun, or it raised)."""
        self.enqueuing = False

    def synchronized(self) -> None:
        """A host sync has seen the last step end (optimizer.synchronize())."""
        self.unproven = False

    def busy(self) -> bool:
        """Whether module calls need the global hooks (_Watch): a pass pending
        or probing, a watch still on a stack, an orphaned pass not yet
        unregistered, or on CUDA the watch for a graph captured between steps."""
        return self.pending or self.probing or self.watch_captures or self.orphaned or \
            self._watch.thread is not None

    def _reset_pass(self) -> None:
        self.pending = False        # positions of a deferred step may still be running
        # The runtime of the pending step, held by the pass itself: the optimizer
        # may be dropped before anything waits (complete_pending_step).
        self._pending_runtime = None
        self.probing = False
        self.owner = None           # the thread that called step()
        self._depth = 0             # open calls of the model's modules on that thread
        self._index = 0             # the next expected call of the schedule's sequence
        self._waited = -1           # every position up to this one is ready
        self._last_position = -1
        self._spans: Optional[_SpanIndex] = None
        self._positions: list[int] = []  # per span tag: the position it waits for

    # ---------------------------------------------------------- structure
    def _check_in_model(self, params: list[torch.Tensor]) -> None:
        missing = [i for i, p in enumerate(params) if id(p) not in self._in_model]
        if missing:
            raise ValueError(f"SwapOptimizer(overlap_forward=True): param(s) {missing} are not in the model's "
                             "parameters (as they were when the optimizer was made), so no forward hook would wait "
                             "for their update; pass the module whose forward uses every param as model=, or keep "
                             "those params in another optimizer")

    def check_params(self, params: list[torch.Tensor]) -> None:
        """Refuses params the model does not hold (before a store is built)."""
        self._in_model = {id(p) for p in self.model.parameters()}
        self._check_in_model(params)

    def lay_out(self, params: list[torch.Tensor]) -> None:
        """A rebuilt store (new params or groups): probe again before
        overlapping (a probe under way recorded the old param indices)."""
        self.check_params(params)
        with self._lock:
            if self.probing:
                self.finish_pass()
        if [id(p) for p in params] != [id(p) for p in self.params]:
            self.first_reads = None  # indices of other params
        self.params = list(params)
        self._set_modules()
        self.schedule = None

    def _set_modules(self) -> None:
        """The modules whose calls count: the model's (and torch.compile
        wrappers of them, added once seen)."""
        modules = list(self.model.modules())
        self._modules = {id(m) for m in modules}
        self._wrappers = {id(m) for m in modules if _wrapped_module(m) is not None}

    def _param_names(self, indices) -> str:
        names = {id(p): name for name, p in self.model.named_parameters(remove_duplicate=False)}
        return ", ".join(f"{i} ({names.get(id(self.params[i]), '?')})" for i in indices)

    # ------------------------------------------------------- step() side
    def end_pass(self) -> None:
        """Ends the pass (in step(), after its closure and wait): a probe's
        record becomes the wait schedule. Raises when the last deferred step's forward
        may have read params before their update."""
        with self._lock:
            probed = self.probing
            self.finish_pass()
            if probed:
                self._settle_probe()
            if _compiled_in_place(self.model) and not self.root_compiled:
                self.root_compiled = True
                if self._last_step_deferred:  # its forward ran no eager hook: nothing proves it waited
                    self._last_step_deferred = False
                    raise RuntimeError(
                        "SwapOptimizer(overlap_forward=True): the model was compiled in place (model.compile()) "
                        "after the optimizer was made, and its compiled forward ran no hook, so it may have read "
                        "params before the last step's update: this step is refused, as its grads may be wrong. "
                        "Zero the grads and run the forward and backward again; from now on this model's steps "
                        "complete inside step(). To overlap with a compiled model, compile it with "
                        "torch.compile(model) and call that (its call waits at entry)")

    def may_defer(self) -> bool:
        """Whether this step may overlap the next forward (else the pass after
        it is a probe, or nothing)."""
        return self.schedule is not None and not self.graphed and not self.root_compiled

    def before_step(self, deferred: bool) -> None:
        """Just before step() runs: a deferred step is in the runtime from
        when it is enqueued, before after_step() marks it pending, so signal
        handlers wait for it from here on (the runtime runs no handler while
        it enqueues)."""
        if deferred:
            _Watch.wrap_signal_handlers()
            self.enqueuing = True

    def after_step(self, deferred: bool, runtime, grads: list[Optional[torch.Tensor]]) -> None:
        """Starts the pass that runs until the next step(): overlapped, or the
        probe after a whole step."""
        with self._lock:
            self._last_step_deferred = deferred
            _Watch.sweep()
            self.drop_watch()  # also when step() now runs on another thread than the last
            self._reset_pass()
            self.owner = threading.get_ident()
            if deferred:
                self._begin_overlapped(runtime, grads)
                self._knock_out_pass_rules()
            elif self.schedule is None and not self.graphed and not self.root_compiled:
                self._begin_probe()
            if self.busy():  # (after the pass is set: disarm_if_idle sees it busy from here on)
                _Watch.arm()

    def _knock_out_pass_rules(self) -> None:
        """Tests only: the rules of an overlapped pass's start switched off
        (knocked_out_rules), as if _begin_overlapped lacked them."""
        if "grads" in self.test_hooks.knocked_out_rules and self._spans is not None:
            self._spans = None  # the watch is on: the ops below, on params, must not wait for them
            self._spans = _SpanIndex([(p, i) for i, p in enumerate(self.params)
                                      if i not in self.test_hooks.knocked_out], self.device)
        if "unproven" in self.test_hooks.knocked_out_rules:
            self.unproven = False

    def _begin_overlapped(self, runtime, grads) -> None:
        schedule = self.schedule
        self.pending = True
        self._pending_runtime = runtime
        self.unproven = self._on_cuda()
        last = self._param_positions
        self._last_position = max(last, default=-1)
        knocked_out = self.test_hooks.knocked_out
        tagged = [(p, i) for i, p in enumerate(self.params) if i not in knocked_out]
        tagged += [(g, i) for i, g in enumerate(grads) if g is not None and i not in knocked_out]
        self._spans = _SpanIndex(tagged, self.device)
        self._positions = last
        if schedule.step_position >= 0:
            self._wait_until(schedule.step_position, runtime)
        if self.pending:
            self._push_watch()

    def _begin_probe(self) -> None:
        self.probing = True
        self._set_modules()  # as the probe sees them
        self._probe_calls: list[nn.Module] = []
        self._probe_first_inside: dict[int, int] = {}
        self._probe_compiled = any(_compiled_in_place(m) for m in self.model.modules())
        self._spans = _SpanIndex([(p, i) for i, p in enumerate(self.params)], self.device)
        self._push_watch()

    def _settle_probe(self) -> None:
        """Turns what the probe saw into the wait schedule: batch order and waits."""
        optimizer = self._optimizer()
        runtime = optimizer._runtime
        calls = self._probe_calls
        count = len(self.params)
        index_of = {id(p): i for i, p in enumerate(self.params)}
        rank = [_UNRANKED] * count
        rules_off = self.test_hooks.knocked_out_rules
        for i, call in self._probe_first_inside.items():
            if "probe_ranks" not in rules_off:
                rank[i] = min(rank[i], call + ("probe_rank_late" in rules_off))
        # Static rules: a call of a module waits for its direct params, a call
        # of a block for its whole subtree (reads that a probe may not see).
        blocks = {id(b) for b in find_blocks(self.model, expand_sequential="sequential" not in rules_off)}
        for call, module in enumerate(calls):
            whole = id(module) in blocks and "subtree" not in rules_off
            subtree = module.parameters() if whole else module.parameters(recurse=False)
            for p in subtree:
                i = index_of.get(id(p))
                if i is not None:
                    rank[i] = min(rank[i], call)
        # Reads inside a compiled region are not seen, and need not be: a
        # compiled model waits for the whole step at its first call.
        # A grad comes from a read; one inside the model's calls that the probe
        # did not see (another thread, a raw pointer) must finish in step().
        unseen = [] if self._probe_compiled else \
            [i for i, p in enumerate(self.params)
             if p.grad is not None and i not in self._probe_first_inside and i not in self.test_hooks.knocked_out]
        for i in unseen:
            rank[i] = -1
        for i in self.test_hooks.knocked_out:
            rank[i] = _UNRANKED
        self.first_reads = self._first_reads(rank, calls)
        runtime.set_batch_order(rank)
        position_of = {batch: position for position, batch in enumerate(runtime.pipeline_order())}
        last = [-1] * count
        for batch, plan in enumerate(runtime.batch_layout()):
            for i in plan["params"]:
                last[i] = max(last[i], position_of[batch])
        self._param_positions = last
        everything = max(last, default=-1)
        wait_at = [-1] * len(calls)
        for i in range(count):
            if 0 <= rank[i] < len(calls):
                wait_at[rank[i]] = max(wait_at[rank[i]], last[i])
        for call in range(1, len(calls)):
            wait_at[call] = max(wait_at[call], wait_at[call - 1])
        if calls and not self.test_hooks.knocked_out:
            wait_at[-1] = everything  # the pass ends with the step done
        step_position = max((last[i] for i in unseen), default=-1)
        self.schedule = _WaitSchedule(_structure(self.model), calls, wait_at, step_position, self._probe_compiled)
        if unseen:
            warnings.warn(f"SwapOptimizer(overlap_forward=True): param(s) {self._param_names(unseen)} got grads "
                          "although the probe saw no read of them inside a call of the model (the model run on "
                          "another thread than step(), or a Triton or raw-pointer kernel?); their updates now "
                          "complete inside step(), before it returns",
                          RuntimeWarning, stacklevel=4)

    def _first_reads(self, rank: list[int], calls: list[nn.Module]) -> list[int]:
        """Per param, where the forward first needs it, counted in calls: for a
        read inside a block, that block's first call, so that a block's params
        share one rank (and, kept resident, one resident batch); -1 for params
        that must be done inside step(), _UNRANKED for those never read."""
        block_start = {}
        first_call_of = {}
        for call, module in enumerate(calls):
            first_call_of.setdefault(id(module), call)
        blocks = find_blocks(self.model, expand_sequential="sequential" not in self.test_hooks.knocked_out_rules)
        # A module shared between blocks keeps its own first call: it would tie later blocks to the first.
        owners = Counter(id(m) for block in blocks for m in block.modules())
        for block in blocks:
            own = [m for m in block.modules() if owners[id(m)] == 1]
            start = min((first_call_of[id(m)] for m in own if id(m) in first_call_of), default=None)
            if start is not None:
                block_start.update((id(m), start) for m in own)
        return [r if r < 0 or r >= len(calls) else block_start.get(id(calls[r]), r) for r in rank]

    # --------------------------------------------------------- the pass
    def _runtime(self):
        if self._pending_runtime is not None:  # the pending step's, also once its optimizer is gone
            return self._pending_runtime
        optimizer = self._optimizer()
        return None if optimizer is None else optimizer.__dict__.get("_runtime")

    def _refuse_capture(self) -> None:
        if self.unproven:
            raise RuntimeError("SwapOptimizer(overlap_forward=True): a CUDA graph is being captured while the last "
                               "overlapped step may still be running (no host synchronisation has seen it end), and a "
                               "capture cannot wait for it; call optimizer.synchronize() before capturing")

    def _note_capture(self) -> None:
        if not self.graphed:
            self.graphed = True
            warnings.warn("SwapOptimizer(overlap_forward=True): the model's forward is being captured in a CUDA "
                          "graph; its replays run no hooks, so from now on step() completes each step before it "
                          "returns (no overlap for this optimizer). Use overlap_forward=False to keep this quiet",
                          RuntimeWarning, stacklevel=4)

    def _wait_until(self, position: int, runtime=None) -> None:
        if position <= self._waited:
            return
        runtime = runtime if runtime is not None else self._runtime()
        if runtime is None:
            return self.finish_pass()
        if capturing(self.device):
            self._refuse_capture()
        try:
            if position >= self._last_position:
                runtime.wait_step()
            else:
                runtime.wait_ready(position)
        except BaseException:
            # The step stopped (the error says why): nothing more to wait for.
            # Else the wait returned and a signal handler raised after it.
            if not runtime.has_deferred_step():
                self.finish_pass()
            elif self.pending:
                self._waited = position
            raise
        self._waited = position
        if position >= self._last_position:
            self.finish_pass()

    def wait_all(self) -> None:
        with self._lock:
            if self.pending:
                self._wait_until(self._last_position)
            _Watch.sweep()
            self._tidy()
        _Watch.disarm_if_idle()

    def finish_pass(self) -> None:
        """No position is pending any more (or the probe ended)."""
        self.pending = False
        self._pending_runtime = None
        if self.orphaned:  # its optimizer is gone, and the step it left is done now
            self.orphaned = False
            _Watch.unregister(self)
        self.probing = False
        self._spans = None
        self._pop_watch()  # inside the watch's own call: the next module call or wait takes it off

    def _push_watch(self) -> None:
        """Puts the watch on the stepping thread's stack (ops outside the
        model's calls, or the probe's record)."""
        watch = self._watch
        if watch.thread is None and threading.get_ident() == self.owner and not watch.running_here():
            # Marked first: an interrupt in or after the insert leaves a watch
            # that _pop_watch still takes off (removing an absent one is a no-op).
            watch.thread = self.owner
            _insert_mode(watch)

    def _pop_watch(self) -> None:
        """Takes the watch off its stack, from its thread; not while its own
        call runs (then _tidy does it at the next module call or wait)."""
        watch = self._watch
        if watch.thread is not None and threading.get_ident() == watch.thread and not watch.running_here():
            _remove_mode(watch)
            watch.thread = None

    def _tidy(self) -> None:
        if self.orphaned and not self.pending and threading.get_ident() == self.owner:
            self.orphaned = False  # its step is done (finish_orphaned_step): nothing left to wait for
            _Watch.unregister(self)
        elif self._watch.thread is not None and not (self.pending or self.probing):
            self._pop_watch()

    def drop_watch(self) -> None:
        """Takes the watch off, or, from another thread or inside its own
        call, leaves it inert to its thread's next sweep and uses a new one."""
        self._pop_watch()
        old = self._watch
        if old.thread is not None:
            # The new watch first: an interrupt anywhere here leaves self._watch live.
            self._watch = _ReadWatch(self)
            _Watch.strays.append(old)
            old.retire()

    def finish_for_signal(self) -> None:
        """From a signal handler, which may run between any two bytecodes of
        this class: waits for the whole step, then only marks the pass done
        (the stack is tidied at the next module call or wait)."""
        if not (self.pending or self.enqueuing):
            return
        runtime = self._runtime()
        if runtime is not None:  # first: a nested signal meanwhile still finds the step pending, and waits too
            runtime.wait_step()  # a failure of the step is raised here, once
        self.pending = False
        self._pending_runtime = None
        self._spans = None

    def complete_pending_step(self) -> bool:
        """The optimizer was collected (del opt, or a train() that returns only
        the model), or the interpreter exits, while its last step is pending:
        that step still completes (its runtime, held by the pass, and its
        update rule hold what it needs), and the caller's stream waits for it
        here, as the next forward would have. A finalizer or an exit hook
        cannot raise, so a failure is a warning that says what it left. False
        where this thread cannot wait: the one running the step's update."""
        runtime = self._pending_runtime
        if not self.pending or runtime is None:
            return True
        if runtime.on_update_thread():
            return False
        _wait_for_dropped_step(runtime)
        return True

    def finish_orphaned_step(self) -> None:
        """On a thread of its own (see _Watch.unregister): waits for the step an
        orphaned pass holds and lets its runtime, the pinned store, go then,
        whether or not the model is ever called again."""
        with self._lock:
            runtime = self._pending_runtime
            if not (self.orphaned and self.pending) or runtime is None:
                return  # the stepping thread's waits got there first
            _wait_for_dropped_step(runtime)
            self.pending = False
            self._pending_runtime = None
            self._spans = None

    def on_call(self, module: nn.Module) -> None:
        """A module call anywhere (the global pre-hook)."""
        self._tidy()
        if not (self.pending or self.probing or self.watch_captures):
            return  # idle on the CPU: nothing to do
        if id(module) not in self._modules:
            wrapped = _wrapped_module(module)
            if wrapped is None or id(wrapped) not in self._modules:
                return
            self._modules.add(id(module))  # its return is counted too
            self._wrappers.add(id(module))
        wrapper = id(module) in self._wrappers
        if not (self.pending or self.probing):  # CUDA, idle: only a capture is watched for, with no lock
            if capturing(self.device):
                self._refuse_capture()  # after wait(): a stream wait proves nothing here
                self._note_capture()
            return
        with self._lock:
            if not (self.pending or self.probing):
                return
            owner = threading.get_ident() == self.owner
            if owner:
                self._depth += 1
            if self.probing:
                self._probe_compiled |= wrapper
                self._probe_calls.append(module)
                if capturing(self.device):
                    self._note_capture()
                return
            if owner and self._depth == 1:
                self._pop_watch()
            if capturing(self.device):
                self._refuse_capture()
                self._note_capture()
            schedule = self.schedule
            if wrapper or schedule.compiled:
                if "compiled" not in self.test_hooks.unguarded:
                    self._wait_until(self._last_position)
                return
            if self._index == 0 and self._structure_changed():
                return self._wait_until(self._last_position)
            if self._index < len(schedule.sequence) and schedule.sequence[self._index] is module:
                position = schedule.wait_at[self._index]
                self._index += 1
                self._wait_until(position)
            elif "divergence" not in self.test_hooks.unguarded:  # not the probe's sequence: wait for everything here
                self._index = len(schedule.sequence)
                self._wait_until(self._last_position)

    def _structure_changed(self) -> bool:
        """The model's modules, or the params they hold, are not those the
        probe saw, or a module was compiled in place since: the schedule no longer
        says where reads are (probe again at the next step)."""
        structure = _structure(self.model)
        if structure == self.schedule.structure:
            return False
        self.schedule = None
        self._set_modules()
        return True

    def on_return(self, module: nn.Module) -> None:
        """A module call returned (the global always-called forward hook)."""
        self._tidy()
        if id(module) not in self._modules or threading.get_ident() != self.owner:
            return
        with self._lock:
            if not (self.pending or self.probing) or self._depth == 0:
                return
            self._depth -= 1
            if self._depth == 0 and self.pending:
                self._push_watch()

    def on_op(self, func, args, kwargs) -> None:
        """A torch op on the stepping thread while the watch is on its stack."""
        with self._lock:
            spans = self._spans
            if spans is None:
                return
            touched = [tag for t in _tensors_in(args, kwargs, lists="lists" not in self.test_hooks.knocked_out_rules)
                       for tag in spans.touched(t)]
            if self.probing:
                inside = self._depth > 0
                for i in touched:
                    if inside and i not in self._probe_first_inside:
                        self._probe_first_inside[i] = len(self._probe_calls) - 1
                return
            if not self.pending or "ops" in self.test_hooks.unguarded:
                return
            if getattr(func, "__name__", "") in _BACKWARD_FUNCTIONS and \
                    "backward" not in self.test_hooks.knocked_out_rules:
                return self._wait_until(self._last_position)  # backward may write grads the step reads
            if touched:
                self._wait_until(max(self._positions[i] for i in touched))
