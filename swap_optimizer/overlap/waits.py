"""ForwardOverlap: one overlapping optimizer's pass state (from a step() to
the next), the probe's record and the schedule made from it, and every wait
of the forward (module calls, ops outside them, signals, a dropped optimizer)."""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from .. import _C, torch_internals
from ..step_guards import capturing
from .armed import ARMED_RULES, ArmedPass, armable, foreign_handler
from .guard import _BACKWARD_FUNCTIONS, _insert_mode, _ReadWatch, _remove_mode, pass_checks
from .hooks import _Watch
from .probe import _compiled_in_place, _structure, _WaitSchedule, _wrapped_module, check_model, find_blocks

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


def _first_calls(calls: list[nn.Module]) -> dict[int, int]:
    """Per module (by id), the index of its first call in `calls`."""
    first_call_of: dict[int, int] = {}
    for call, module in enumerate(calls):
        first_call_of.setdefault(id(module), call)
    return first_call_of


@dataclass(frozen=True)
class OverlapTestHooks:
    """Tests only, given through ForwardOverlap.set_test_hooks: negative
    controls and a simulation. knocked_out: params whose waits are left out;
    unguarded: waits switched off by kind, of UNGUARDABLE ("ops": outside the
    model's calls, "divergence": where calls differ from the probe's,
    "compiled": at a compiled model's first call); knocked_out_rules: single
    rules switched off, of KNOCKABLE_RULES; as_if_cuda: the capture rules as
    for params on a GPU (idle calls watched, an overlapped step unproven until
    synchronize()), for a CPU test with `capturing` simulated; keep_watching:
    a pass goes on to its last wait even once every batch is updated (the
    benchmark measures the checks' cost so, with the step done); mode_watch:
    every pass keeps the global hooks and the read watch, never arms its
    tensors (ArmedPass: the tests of that watch)."""
    knocked_out: frozenset = frozenset()
    unguarded: frozenset = frozenset()
    knocked_out_rules: frozenset = frozenset()
    as_if_cuda: bool = False
    keep_watching: bool = False
    mode_watch: bool = False


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
        self.foreign_handlers = False  # the probe saw an op on a param beside a tensor subclass's handler
        self.armable_model = False     # what the probe saw lets passes arm (_armable_model)
        self.test_hooks = OverlapTestHooks()
        self._param_positions: list[int] = []  # per param: the last pipeline position holding it
        # Per param, from the last probe: where the forward first needs it (_first_reads); None before one.
        self.first_reads: Optional[list[int]] = None
        self._last_step_deferred = False
        self.orphaned = False  # its optimizer is gone, its last step not yet waited for (_Watch.unregister)
        self._set_modules()
        self._lock = threading.RLock()
        self.enqueuing = False  # set by before_step(); step() clears it once after_step() has run
        self.checks = pass_checks()  # which ops the watch looks at: the pass's spans and runtime (_reset_pass)
        self._reset_pass()
        self._watch = _ReadWatch(self)
        _Watch.register(self)
        self._finalizer = weakref.finalize(optimizer, _Watch.unregister, self)

    def set_test_hooks(self, **changes) -> None:
        """Tests only: changes fields of the OverlapTestHooks (the others stay)."""
        unknown_rules = set(changes.get("knocked_out_rules", ())) - set(KNOCKABLE_RULES) - set(ARMED_RULES)
        unknown_kinds = set(changes.get("unguarded", ())) - set(UNGUARDABLE)
        if unknown_rules or unknown_kinds:
            raise ValueError(f"set_test_hooks: unknown rules {sorted(unknown_rules)} or kinds {sorted(unknown_kinds)}; "
                             f"rules are {sorted(KNOCKABLE_RULES)} and {sorted(ARMED_RULES)}, kinds {list(UNGUARDABLE)}")
        sets = {key: frozenset(value) for key, value in changes.items()
                if key not in ("as_if_cuda", "keep_watching", "mode_watch")}
        self.test_hooks = replace(self.test_hooks, **{**changes, **sets})
        self.checks.lists = "lists" not in self.test_hooks.knocked_out_rules
        self.checks.keep_watching = self.test_hooks.keep_watching
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
        return self._watching_calls() or self.watch_captures or self.orphaned or self._watch.thread is not None

    def _watching_calls(self) -> bool:
        """Whether module calls matter to the pass: a probe, or a pending pass
        that did not arm its tensors."""
        return self.probing or self.pending and self._armed is None

    # The pass's spans and pending runtime live in its checks, which C++ reads at each op.
    @property
    def _spans(self) -> Optional[_C.SpanIndex]:
        return self.checks.spans

    @_spans.setter
    def _spans(self, spans: Optional[_C.SpanIndex]) -> None:
        self.checks.spans = spans

    @property
    def _pending_runtime(self):
        return self.checks.runtime

    @_pending_runtime.setter
    def _pending_runtime(self, runtime) -> None:
        self.checks.runtime = runtime

    def _reset_pass(self) -> None:
        self._give_back_armed()
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
        self._spans = None
        self._positions: list[int] = []  # per span tag: the position it waits for

    def _give_back_armed(self) -> None:
        """The pass's armed tensors, if any, are Parameters and Tensors again
        (the pass forgets them only then: an interrupt in between leaves them
        to the next give-back)."""
        armed = getattr(self, "_armed", None)
        if armed is not None:
            armed.give_back_through()
        self._armed: Optional[ArmedPass] = None  # the pass's tensors that watch themselves, if it armed them

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
            else:  # (a pass whose tensors watch themselves: the probe's hooks go now, not at the next call)
                _Watch.disarm_if_idle()

    def _knock_out_pass_rules(self) -> None:
        """Tests only: the rules of an overlapped pass's start switched off
        (knocked_out_rules), as if _begin_overlapped lacked them."""
        if "grads" in self.test_hooks.knocked_out_rules and self._spans is not None:
            self._spans = None  # the watch is on: the ops below, on params, must not wait for them
            self._spans = _C.SpanIndex([(p, i) for i, p in enumerate(self.params)
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
        self._positions = last
        if self._may_arm(tagged):
            rules_off = self.test_hooks.knocked_out_rules
            # (tagged: the params, then the grads, which a test's knocked-out rule leaves unarmed)
            tensors = tagged[:len(self.params)] if "armed_grads" in rules_off else tagged
            self._armed = ArmedPass(self, [(t, last[i]) for t, i in tensors if last[i] >= 0], rules_off)
            self._armed.arm()
            return
        self._spans = _C.SpanIndex(tagged, self.device)
        if schedule.step_position >= 0:
            self._wait_until(schedule.step_position, runtime)
        if self.pending:
            self._push_watch()

    def _may_arm(self, tagged: list[tuple[torch.Tensor, int]]) -> bool:
        """Whether the pass's params and grads may watch themselves
        (ArmedPass): the probe saw every read of a param with a grad (none
        finishes inside step()), each by its module's first call at the
        latest, and no op on a param beside a tensor subclass with a handler
        of its own; no module with an eval fast path on; nothing is compiled,
        each tensor is a Parameter or Tensor with no alias, and no test
        needs today's watch."""
        hooks = self.test_hooks
        if hooks.mode_watch or hooks.knocked_out or hooks.unguarded or hooks.as_if_cuda or \
                hooks.knocked_out_rules - ARMED_RULES.keys():
            return False
        schedule = self.schedule
        # (MultiheadAttention and TransformerEncoderLayer skip their eval fast
        # path when a param has a handler: the slow path's last bits differ)
        fast_path = torch.backends.mha.get_fastpath_enabled() and \
            any(isinstance(m, (nn.MultiheadAttention, nn.TransformerEncoderLayer)) for m in self.model.modules())
        return schedule.step_position < 0 and not schedule.compiled and not self.foreign_handlers and \
            self.armable_model and not fast_path and all(armable(t) for t, _ in tagged) and \
            ArmedPass.may_arm_in_this_process()

    def wait_armed(self, position: int) -> None:
        """An op read an armed tensor whose update is at `position`. Not on
        the thread that runs the step's update (the host backend's update
        thread runs the step on these very tensors): it neither waits nor
        gives back."""
        if self.on_update_thread():
            return
        with self._lock:
            if self._armed is None:
                return  # the pass ended meanwhile: its tensors are back
            if "armed_ops" in self._armed.rules_off:
                return self._armed.give_back_through(position)
            self._wait_until(position)
            if self._armed is not None:
                self._armed.give_back_through(self._waited)

    def on_update_thread(self) -> bool:
        """Whether this thread runs the pending step's update (the host
        backend's update thread: it never waits for its own step)."""
        runtime = self._pending_runtime
        return runtime is not None and runtime.on_update_thread()

    def _begin_probe(self) -> None:
        self.probing = True
        self._set_modules()  # as the probe sees them
        self._probe_calls: list[nn.Module] = []
        self._probe_first_inside: dict[int, int] = {}
        self._probe_compiled = any(_compiled_in_place(m) for m in self.model.modules())
        # An op on a param beside a tensor with a handler of its own: the handler may run it past an armed param's.
        self.foreign_handlers = False
        self._spans = _C.SpanIndex([(p, i) for i, p in enumerate(self.params)], self.device)
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
        self.armable_model = self._armable_model(calls, index_of)
        if unseen:
            warnings.warn(f"SwapOptimizer(overlap_forward=True): param(s) {self._param_names(unseen)} got grads "
                          "although the probe saw no read of them inside a call of the model (the model run on "
                          "another thread than step(), or a Triton or raw-pointer kernel?); their updates now "
                          "complete inside step(), before it returns",
                          RuntimeWarning, stacklevel=4)

    def _armable_model(self, calls: list[nn.Module], index_of: dict[int, int]) -> bool:
        """Whether the probe's record lets passes arm (ArmedPass): no param
        with a grad whose first read the probe saw came after its module's
        first call (a read no Python sees may come before it, in that call:
        only the mode watch's static rule waits there)."""
        first_call_of = _first_calls(calls)
        for module in self.model.modules():
            call = first_call_of.get(id(module))
            for p in module.parameters(recurse=False) if call is not None else ():
                i = index_of.get(id(p))
                if i is not None and self.params[i].grad is not None and \
                        self._probe_first_inside.get(i, _UNRANKED) > call:
                    return False
        return True

    def _first_reads(self, rank: list[int], calls: list[nn.Module]) -> list[int]:
        """Per param, where the forward first needs it, counted in calls: for a
        read inside a block, that block's first call, so that a block's params
        share one rank (and, kept resident, one resident batch); -1 for params
        that must be done inside step(), _UNRANKED for those never read."""
        block_start = {}
        first_call_of = _first_calls(calls)
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

    def _all_updated(self, runtime) -> bool:
        """Whether every batch of the pending step is updated (a check that
        does not wait): the pass then ends at once, its watch and hooks off,
        instead of checking each call and op up to its last wait."""
        return runtime is not None and not self.test_hooks.keep_watching and runtime.deferred_step_updated()

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
        if position < self._last_position and self._all_updated(runtime):
            position = self._last_position  # nothing is left to guard: the pass ends
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
        self._give_back_armed()
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

    def _tidy(self, may_unregister: bool = True) -> None:
        """Unregisters an orphaned pass whose step is done (not from the
        post hook: see _Watch.disarm_if_idle), or takes a watch left on this
        thread's stack off."""
        if may_unregister and self.orphaned and not self.pending and threading.get_ident() == self.owner:
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
        self._give_back_armed()
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

    def orphan(self) -> None:
        """Its optimizer is gone while its last step runs on: the pass goes on
        until that step is done (_Watch.unregister), and keeps the hooks on
        (puts them on, after an armed pass): the stepping thread's next module
        call unregisters it."""
        self.orphaned = True
        _Watch.arm()

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
            self._give_back_armed()
            self._pending_runtime = None
            self._spans = None

    def on_call(self, module: nn.Module) -> None:
        """A module call anywhere (the global pre-hook)."""
        if self.orphaned or self._watch.thread is not None and not (self.pending or self.probing):
            self._tidy()  # (what _tidy does, tested first: this runs at every module call)
        watching = self._watching_calls()  # (a pass whose tensors watch themselves needs no call)
        if not (watching or self.watch_captures):
            return  # idle on the CPU: nothing to do
        if id(module) not in self._modules:
            wrapped = _wrapped_module(module)
            if wrapped is None or id(wrapped) not in self._modules:
                return
            self._modules.add(id(module))  # its return is counted too
            self._wrappers.add(id(module))
        wrapper = id(module) in self._wrappers
        if not watching:  # CUDA, idle or armed: only a capture is watched for, with no lock
            if capturing(self.device):
                self._refuse_capture()  # after wait(): a stream wait proves nothing here
                self._note_capture()
            return
        with self._lock:
            if not self._watching_calls():
                return
            owner = threading.get_ident() == self.owner
            if owner:
                self._depth += 1
            if self.probing:
                self._probe_compiled |= wrapper
                self._probe_calls.append(module)
                if self.watch_captures and capturing(self.device):
                    self._note_capture()
                return
            if owner and self._depth == 1:
                self._pop_watch()
            if self.watch_captures and capturing(self.device):  # (watch_captures: the params are on CUDA)
                self._refuse_capture()
                self._note_capture()
            schedule = self.schedule
            if wrapper or schedule.compiled:
                if "compiled" not in self.test_hooks.unguarded:
                    self._wait_until(self._last_position)
                return
            # (a step already done ends the pass before the structure walk)
            if self._index == 0 and (self._all_updated(self._runtime()) or self._structure_changed()):
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
        if self._watch.thread is not None and not (self.pending or self.probing):
            self._tidy(may_unregister=False)
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
            touched = spans.touched(args, kwargs, lists="lists" not in self.test_hooks.knocked_out_rules)
            if self.probing:
                self.foreign_handlers = self.foreign_handlers or bool(touched) and foreign_handler(args, kwargs)
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
            elif self._all_updated(self._runtime()):  # nothing is left to guard: the pass ends
                self._wait_until(self._last_position)
