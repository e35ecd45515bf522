"""SwapOptimizer: wraps a torch.optim optimizer (Adam, AdamW, SGD, Adagrad,
RMSprop, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop, Adafactor, Muon, or one
the user vouches for) and keeps its state in host memory, streamed through a
few device staging arenas during step(). This module is what every optimizer
shares: the torch.optim interface, the checks, the step's common part, waits,
device budgets and moves of the store. How a batch is updated is the rule's
(swap_optimizer.rules); DTensor helpers: distributed.py."""

from __future__ import annotations

import functools
import gc
import logging
import warnings
import weakref
from collections.abc import Iterable
from itertools import chain
from typing import Any, Callable, Optional

import torch

from .budget import AutoBudget, allocated, budget_stats, choice_for_budget
from .config import SwapOptimizerConfig
from .overlap import ForwardOverlap
from .params import check_distinct, check_overlap_params, check_params
from .rules import choose_rule
from .step_guards import refuse_step_capture, signals_after_the_step


_log = logging.getLogger("swap_optimizer")






def _holds_params(value: Any) -> bool:
    """Whether `value` is what a torch.optim optimizer takes: a tensor, or an
    iterable of tensors or of param group dicts (model.parameters())."""
    if isinstance(value, (torch.Tensor, dict)):
        return True
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return False
    first = next(iter(value), None)  # (a generator is spent by this; the caller raises)
    return isinstance(first, (torch.Tensor, dict))


def _check_optimizer(optimizer: Any) -> None:
    if isinstance(optimizer, SwapOptimizer):
        raise TypeError("this optimizer is already a SwapOptimizer; wrap the torch.optim optimizer itself")
    if not isinstance(optimizer, torch.optim.Optimizer):
        what = "params (or param groups)" if _holds_params(optimizer) else f"a {type(optimizer).__name__}"
        raise TypeError(f"SwapOptimizer wraps a torch.optim optimizer, and got {what}: make the optimizer first, "
                        "then wrap it, as in SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))")


def _check_not_wrapped(optimizer: torch.optim.Optimizer) -> None:
    """Refuses an optimizer that a live SwapOptimizer already wraps: two
    wrappers would keep two stores of one state and update the params twice."""
    ref = optimizer.__dict__.get("_swap_optimizer")
    if ref is not None and ref() is not None:
        gc.collect()  # a wrapper the program let go of may be waiting in a reference cycle
    if ref is not None and ref() is not None:
        raise RuntimeError(f"SwapOptimizer: this {type(optimizer).__name__} is already wrapped by a SwapOptimizer "
                           "that is still alive; a second wrapper would keep a second store of its state and step "
                           "the params twice. Use the first SwapOptimizer, or drop it (del it, and every reference "
                           "to it) before wrapping the optimizer again")


def _claim(optimizer: torch.optim.Optimizer, wrapper: "SwapOptimizer") -> None:
    """Marks `optimizer` as wrapped by `wrapper` while it lives: a second
    wrapper is refused, and so is a step() of the wrapped optimizer itself,
    which would run torch's update on the host store (SwapOptimizer's own
    update calls the class's step without its hooks). Weak references only:
    the wrapped optimizer must not keep the wrapper alive."""
    itself, wrapped = weakref.ref(wrapper), weakref.ref(optimizer)
    optimizer.__dict__["_swap_optimizer"] = itself
    name = type(optimizer).__name__

    def refuse_step(inner, args, kwargs):
        # (Not for the stand-ins SwapOptimizer's update steps: they share the
        # wrapped optimizer's hooks, and a subclass's super().step() runs them.)
        if inner is wrapped() and itself() is not None:
            raise RuntimeError(f"SwapOptimizer: step() was called on the {name} that a SwapOptimizer wraps; its "
                               "state lives in the SwapOptimizer's host store, which runs the update. Call step() on "
                               "the SwapOptimizer (what SwapOptimizer(...) returned), and hand that to schedulers, "
                               "GradScaler and frameworks")

    try:
        handle = optimizer.register_step_pre_hook(refuse_step)
    except TypeError:  # an optimizer that keeps its hooks in a dict of its own (a wrapper's): no guard to add
        handle = None
    if handle is not None:
        weakref.finalize(wrapper, handle.remove)
    # Frameworks that hold the inner optimizer save and load through it: its
    # state dicts are the wrapper's (the store, waited for and validated).
    optimizer.state_dict = lambda: itself().state_dict()
    optimizer.load_state_dict = lambda state_dict: itself().load_state_dict(state_dict)






def _on_the_optimizer_itself(method):
    """Runs `method` on the SwapOptimizer itself when it is called through a
    wrapper that subclasses the optimizer's class and forwards attributes to it
    (Lightning's LightningOptimizer copies or forwards them): the wrapper's own
    attributes would be stale copies, and writing them would split the state."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        return method(self._itself, *args, **kwargs)  # not through getattr: step hooks ran once already
    return run










def _forward_overlap(optimizer: "SwapOptimizer", model: Optional[torch.nn.Module],
                     params: list[torch.Tensor]) -> Optional[ForwardOverlap]:
    """The overlap of the next forward with the step that overlap_forward=True
    asks for (None without it), checking model= and the params."""
    if optimizer.config.overlap_forward:
        if model is None:
            raise ValueError("SwapOptimizer(overlap_forward=True) needs model=: the module whose forward uses the "
                             "params, so that its blocks can wait for their updates")
        check_overlap_params(params)
        return ForwardOverlap(optimizer, model, params)
    if model is not None:
        raise ValueError("SwapOptimizer: model= is read only with overlap_forward=True; add overlap_forward=True "
                         "or leave model= out")
    return None


def _auto_budget(config: SwapOptimizerConfig) -> Optional[AutoBudget]:
    if config.device_budget_bytes != "auto":
        return None
    return AutoBudget(config.auto_warmup_steps, config.auto_headroom_bytes)


class SwapOptimizer(torch.optim.Optimizer):
    """Adam/AdamW whose state lives in host memory between steps.

    ``SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), swap_times=8)``

    It shares ``param_groups`` and ``state`` with the wrapped optimizer, so LR
    schedulers, GradScaler, clip_grad_norm_ and state dicts work as with the
    wrapped optimizer; its results are the wrapped optimizer's. ``state`` holds
    host tensors for the swapped states (device tensors for resident ones), and
    ``state_dict()`` has the wrapped optimizer's format.
    """

    @property
    def _itself(self) -> "SwapOptimizer":
        """This optimizer, also seen from a framework wrapper that subclasses its
        class: copied, the weak reference leads here; forwarded, the
        AttributeError sends the wrapper's __getattr__ here. (Weak: a strong
        self-reference would keep the store alive until a full GC.)"""
        ref = self.__dict__.get("_itself_ref")
        if ref is None:
            raise AttributeError("_itself")
        return ref()

    # GradScaler reads _step_supports_amp_scaling and sets grad_scale / found_inf
    # on whatever object it was given (a framework wrapper, say): all three live
    # on the optimizer itself.
    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether GradScaler hands grad_scale / found_inf to step() instead of
        syncing on them (config.unscale_in_step; see __init__)."""
        return self._itself.__dict__.get("_unscale_in_step", False)

    def _amp_get(self, name: str):
        try:
            return self._itself.__dict__["_amp_" + name]
        except KeyError:
            raise AttributeError(name) from None

    def _amp_set(self, name: str, value) -> None:
        self._itself.__dict__["_amp_" + name] = value

    def _amp_del(self, name: str) -> None:
        self._itself.__dict__.pop("_amp_" + name, None)

    grad_scale = property(lambda self: self._amp_get("grad_scale"), lambda self, v: self._amp_set("grad_scale", v),
                          lambda self: self._amp_del("grad_scale"))
    found_inf = property(lambda self: self._amp_get("found_inf"), lambda self, v: self._amp_set("found_inf", v),
                         lambda self: self._amp_del("found_inf"))

    def __init__(self, optimizer: torch.optim.Optimizer, config: Optional[SwapOptimizerConfig] = None, *,
                 model: Optional[torch.nn.Module] = None, **fields: Any) -> None:
        """model: with overlap_forward=True, the module whose calls use the
        params (the one the training loop calls, or a holder of it); its
        forward then waits for each param's update where it first reads it
        (see swap_optimizer.overlap)."""
        self.__dict__["_itself_ref"] = weakref.ref(self)
        self.config = SwapOptimizerConfig.from_fields(config, fields)
        _check_optimizer(optimizer)
        rule = choose_rule(optimizer, self.config)
        _check_not_wrapped(optimizer)
        rule.check_wrap(self.config)
        all_params = [p for g in optimizer.param_groups for p in g["params"]]
        self._device = check_params(all_params, None)
        check_distinct(all_params)
        rule.check_params(all_params)
        self._overlap = _forward_overlap(self, model, all_params)
        self.optimizer = optimizer
        self._rule = rule
        self._runtime = None
        self._auto = _auto_budget(self.config)
        # (param ids, their first reads in the forward) that the residents follow; None: param order
        self._ranked_by: Optional[tuple[list[int], list[int]]] = None
        self.__dict__["_unscale_in_step"] = rule.unscales_in_step(self.config.unscale_in_step)
        # Sets up hooks and step profiling as for any optimizer; add_param_group
        # below defers to the base class until the runtime exists.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        # (a key that is not a param: the rule refuses it, naming it)
        rule.start(self, {p: dict(s) for p, s in optimizer.state.items() if torch.is_tensor(p) and s})
        _claim(optimizer, self)

    # ----------------------------------------------------------------- state
    @property
    def state(self):  # noqa: D401  (torch.optim attribute)
        """param -> its state; reading it waits for the last step's copies to land."""
        if self._itself is not self:  # through a forwarding wrapper
            return self._itself.state
        if self.__dict__.get("_runtime") is not None:
            self._synchronize()
        return self.__dict__["_state"]

    @state.setter
    def state(self, value) -> None:
        if self._itself is not self:
            self._itself.state = value
        else:
            self.__dict__["_state"] = value

    @property
    def param_groups(self) -> list[dict]:  # noqa: D102  (torch.optim attribute)
        if self._itself is not self:  # through a forwarding wrapper
            return self._itself.param_groups
        if self.__dict__.get("_runtime") is not None:  # the inner optimizer's list, even if reassigned there
            return self.optimizer.param_groups
        return self.__dict__["_param_groups"]

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        """Reassigning works as for torch.optim (Lightning's finetuning callbacks
        do it): the wrapped optimizer gets the same list, and the next step,
        load_state_dict or add_param_group lays the store out for the new
        membership, carrying each kept param's state over."""
        if self._itself is not self:
            self._itself.param_groups = groups
            return
        self.__dict__["_param_groups"] = groups
        if self.__dict__.get("_runtime") is not None:  # not while Optimizer.__init__ builds the list
            self.optimizer.param_groups = groups

    def _params(self) -> list[torch.Tensor]:
        return list(chain.from_iterable(g["params"] for g in self.param_groups))

    def _group_of_param(self) -> list[int]:
        return [g for g, group in enumerate(self.param_groups) for _ in group["params"]]

    # ------------------------------------------------------------------ step
    # Dynamo would trace into the C++ runtime and set capturable=True on the
    # groups (torch.compile(opt.step), a documented recipe): run eagerly instead.
    @_on_the_optimizer_itself
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102  (torch.optim API)
        self._refuse_inside_step("step")
        self._refuse_if_torn("step")  # before the closure runs or anything is written
        refuse_step_capture(self._device)
        loss = None
        if closure is not None:  # as torch.optim: evaluated once, before the update
            with torch.enable_grad():
                loss = closure()
        self.wait()  # after the closure, whose forward overlapped the last step
        # Ends the pass since the last step (a probe's record becomes the wait schedule);
        # may refuse grads whose forward could not wait for that step.
        if self._overlap is not None:
            self._overlap.end_pass()
        self._rule.step(self)
        return loss

    @_on_the_optimizer_itself
    def wait(self) -> None:
        """Waits for the step that overlap_forward=True left running. Reads and
        writes of params wait by themselves (the forward where it first reads
        each param, anything else on the thread that called step() at the
        op); call it for code that reads them where nothing can see, such as
        another thread or a raw pointer. On CUDA the current stream waits (no
        host sync); on the CPU it blocks. Raises what stopped that step.
        Without overlap_forward it does nothing."""
        runtime = self.__dict__.get("_runtime")
        overlap = self.__dict__.get("_overlap")
        if overlap is not None and runtime is not None:
            try:
                overlap.wait_all()
                runtime.wait_step()  # CUDA: also when a wait on another stream finished the step
            except BaseException:
                self._rule.step_waited(self, failed=True)
                raise
            self._rule.step_waited(self)  # a vouched-for step's group writes land now

    @_on_the_optimizer_itself
    def synchronize(self) -> None:
        """Blocks the host until the last step has finished on the device and
        its state has landed in host memory. Before capturing a CUDA graph
        after an overlapped step, this proves to SwapOptimizer that the step
        ended (a stream wait such as wait() cannot)."""
        if self.__dict__.get("_runtime") is not None:
            self._synchronize()

    def _synchronize(self) -> None:
        self.wait()
        self._runtime.synchronize()
        if self._overlap is not None:
            self._overlap.synchronized()

    @_on_the_optimizer_itself
    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102  (torch.optim API)
        if not set_to_none:
            self.wait()  # zeroing in place writes grads the running step reads
        super().zero_grad(set_to_none)

    @_on_the_optimizer_itself
    def add_param_group(self, param_group: dict) -> None:  # noqa: D102  (torch.optim API)
        if self.__dict__.get("_runtime") is None:  # called by Optimizer.__init__
            return super().add_param_group(param_group)
        self._refuse_inside_step("add_param_group")
        self._rule.add_param_group(self, param_group)

    # ----------------------------------------------------------- state dicts
    @_on_the_optimizer_itself
    def state_dict(self) -> dict[str, Any]:  # noqa: D102  (torch.optim API)
        """The wrapped optimizer's format; swapped states are the host tensors
        themselves (no device copy). (The base class reads `state`, which
        waits for the last step's copies.) What the rule adds: see its
        state_dict_extras."""
        state_dict = super().state_dict()
        self._rule.state_dict_extras(self, state_dict)
        return state_dict

    @_on_the_optimizer_itself
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102  (torch.optim API)
        """The rule checks the whole state dict before anything is written
        (a refused one changes nothing); the hooks registered on this
        optimizer run as torch.optim runs them."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("SwapOptimizer.load_state_dict: expected an optimizer state dict with 'state' and "
                             "'param_groups'")
        self._refuse_inside_step("load_state_dict")
        state_dict = state_dict.copy()  # as torch: hooks and loading never change the caller's dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._rule.load_state_dict(self, state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _refuse_inside_step(self, what: str) -> None:
        """A signal handler runs inside step() (at a param boundary): reading
        `state` or `state_dict()` there is served; changing the store is not."""
        if self.__dict__.get("_stepping"):
            raise RuntimeError(f"SwapOptimizer.{what}() was called while step() runs (from a signal handler?): "
                               "the step would go on over the change. Read state or state_dict() there (they are "
                               f"served, each param wholly old or new), and call {what}() after step() returns")

    def _refuse_if_torn(self, what: str) -> None:
        """Refuses `what` while a failed step has left a split param partly updated
        (the runtime's step() refuses in the same words)."""
        torn = self._runtime.torn_params()
        if torn:
            raise RuntimeError(f"SwapOptimizer: a failed step left param(s) {', '.join(map(str, torn))} partly "
                               f"updated; {what}() refuses to run so that no piece is stepped twice. Load a "
                               "checkpoint with load_state_dict() (which clears this), or create a new SwapOptimizer")

    # ---------------------------------------------------------- device budget
    def _budget_now(self) -> Optional[int]:
        """The device budget plans follow: the one given, what "auto" made of
        it once derived, or None."""
        if self._auto is not None:
            return None if self._auto.measured is None else self._auto.measured["budget_bytes"]
        return self.config.device_budget_bytes

    def _ranks_now(self) -> Optional[list[int]]:
        """The first reads the residents follow: those adopted for these
        params, while a budget is in force (None: param order)."""
        ranked = self._ranked_by
        if ranked is None or self._budget_now() is None or ranked[0] != list(map(id, self._params())):
            return None
        return ranked[1]

    def _resident_priority(self) -> Optional[list[int]]:
        """The order the budget keeps params resident in: with overlap_forward,
        once a forward was probed, the order it first reads them (None: param
        order)."""
        ranks = self._ranks_now()
        return None if ranks is None else sorted(range(len(ranks)), key=lambda i: (ranks[i], i))

    def _resident_groups(self) -> list[int]:
        """Per param, its resident batch: with overlap_forward and a budget, one
        per block of the forward (the block's first call), so that a block
        waits only for its own resident params; else one for all ([])."""
        ranks = self._ranks_now()
        return [] if ranks is None else list(ranks)

    def _settle_budget_choice(self) -> None:
        """At a step boundary (the last step is done, this one has not begun):
        with overlap_forward, adopts the forward's first reads once a probe has
        seen them, once per set of params (a forward whose calls vary from step
        to step must not move the store every step); derives an "auto" budget
        once it is due. Under a budget, either lays the store out again, in one
        move."""
        overlap, ids = self._overlap, list(map(id, self._params()))
        adopting = overlap is not None and overlap.first_reads is not None \
            and (self._ranked_by is None or self._ranked_by[0] != ids)
        if adopting:
            self._ranked_by = (ids, list(overlap.first_reads))
        if self._settle_auto_budget() or not adopting or self._budget_now() is None:
            return  # an "auto" move took the first reads along
        planning = self._planning
        try:
            choice = choice_for_budget(self.config, self._budget_now(), planning.lay_out, planning.base,
                                       planning.copy_bytes, self._device, self._resident_priority())
            if not choice.resident_params and not (planning.choice and planning.choice.resident_params):
                return  # the budget keeps no param resident either way: moving would change nothing
            # On failure the old layout, param order, is laid out again, and kept.
            self._move_to_budget_choice(lambda: setattr(self, "_ranked_by", (ids, None)))
        except Exception as error:
            self._ranked_by = (ids, None)  # not retried for these params
            if self._runtime is None:  # the old layout could not be laid out again either
                raise
            warnings.warn(f"SwapOptimizer: laying the resident states out in the order the forward reads them "
                          f"failed ({type(error).__name__}: {error}); they stay in param order, which is as exact "
                          "but lets the forward wait longer for them", RuntimeWarning, stacklevel=3)

    def _settle_auto_budget(self) -> bool:
        """device_budget_bytes="auto", at the step after the warm-up (a step
        boundary: the last step is done, this one has not begun): derives the
        budget and moves the states to its plan, once. Returns whether the
        store moved."""
        if self._auto is None or not self._auto.due():
            return False
        planning = self._planning
        budget = self._auto.derive(self._device, allocated(self._runtime.memory_stats()["resident_state_bytes"]))
        if budget is None:
            warnings.warn("SwapOptimizer: device_budget_bytes='auto' has no device memory to measure on the CPU; the "
                          "plan stays as given (pass a number to plan for one)", RuntimeWarning, stacklevel=4)
            return False
        refusal = None
        try:  # planned first, nothing allocated: a budget no plan fits leaves the store as it is
            choice_for_budget(self.config, budget, planning.lay_out, planning.base, planning.copy_bytes, self._device,
                              self._resident_priority())
        except ValueError as error:
            refusal = str(error)
        # Every rank moves, or none does (each plans for its own shards).
        if not self._auto.least_over_ranks(int(refusal is None), self._device):
            self._auto.measured["budget_bytes"] = None
            why = f"in which no plan fits ({refusal})" if refusal else "in which another rank's states find no plan"
            warnings.warn(f"SwapOptimizer: device_budget_bytes='auto' derived {budget} bytes, {why}; the plan stays "
                          "as given", RuntimeWarning, stacklevel=4)
            return False
        self._move_to_budget_choice(lambda: self._auto.measured.update(budget_bytes=None))
        stats = self.memory_stats()
        _log.info("SwapOptimizer: device_budget_bytes='auto' is %d bytes after %d warm-up steps (%s); the states "
                  "moved to swap_times=%d, num_arenas=%d, resident share %.1f%%", budget, self._auto.warmup_steps,
                  ", ".join(f"{k} {v}" for k, v in self._auto.measured.items() if k != "budget_bytes"),
                  stats["plan"]["swap_times"], stats["plan"]["num_arenas"], 100 * stats["resident_share"])
        return True

    def _move_to_budget_choice(self, undo: Callable[[], None]) -> None:
        """Lays the store out for the budget now in force and moves every state
        into it byte for byte. The device part of the old store is copied to
        host memory and freed before the new store is allocated, so no state is
        on the device twice. If the new store cannot be made or filled, the old
        plan is laid out again (after `undo` restores what chose the new one)
        and filled from the same bytes, and the error raised; signals wait
        until one of them is whole."""
        if self._overlap is not None:  # what any layout checks, checked while the old store still stands
            params = self._params()
            try:
                check_overlap_params(params)
                self._overlap.check_params(params)
            except BaseException:
                undo()
                raise
        with signals_after_the_step():  # a Ctrl-C is raised once every state is in a whole store
            saved = [{key: view.to("cpu", copy=True) if view.device.type != "cpu" else view
                      for key, view in views.items()} for views in self._rule.views]
            kept = self._rule.bookkeeping()
            self._release_store()
            try:
                self._rule.lay_out_empty(self)
                self._fill_store(saved, kept)
            except BaseException:
                undo()
                self._release_store()
                self._rule.lay_out_empty(self)
                self._fill_store(saved, kept)
                raise

    def _fill_store(self, saved: list[dict], kept: dict) -> None:
        with torch.no_grad():
            for views, values in zip(self._rule.views, saved):
                for key, view in views.items():
                    view.copy_(values[key])
        self._rule.restore_bookkeeping(self, kept)
        self._runtime.order_writes()

    def _release_store(self) -> None:
        """Drops the store and every view of it (its device memory is freed)."""
        self.__dict__["_state"].clear()
        self._rule.release()
        self._runtime = None

    # ----------------------------------------------------------------- misc
    @_on_the_optimizer_itself
    def memory_stats(self) -> dict[str, Any]:
        """Bytes of the host store, staging arenas (now and peak), resident
        states, bytes moved each way by the last step, batches and arenas; the
        resident share (device state bytes / all state bytes); with
        device_budget_bytes, the budget and the plan chosen for it. With
        torch's update (TorchUpdateRule.memory_stats): the state keys that go
        to host memory, an estimate of the update's device temporaries, and the
        swapped states of the largest param that moves whole."""
        return {**budget_stats(self._runtime.memory_stats(), self._planning, self._auto),
                **self._rule.memory_stats(self)}

    @_on_the_optimizer_itself
    def plan_report(self) -> dict[str, Any]:
        """The plan this optimizer runs and its neighbours (half and twice the
        swap_times, an arena fewer and more, no resident beyond min_numel and
        state_keys): for each, swap_times, num_arenas, resident share, bytes
        moved each way, device bytes as the budget counts them and the
        predicted step time, from the cost model (config.cost_model or
        StepCostModel.for_device). A dict that prints as a table."""
        return self._planning.report(self.config, self._device)

    @_on_the_optimizer_itself
    def _set_test_hooks(self, copy_delay_us: int = 0, seed: int = 0, fault: Optional[str] = None,
                        fault_batch: int = -1, simulated_free_bytes: int = -1, compute_delay_us: int = 0) -> None:
        """Tests only: random delays before each copy (copy_delay_us) and on the
        compute queue before each batch's update (compute_delay_us), on both
        backends; one injected failure; arenas allocated as if the device had
        simulated_free_bytes free."""
        self._runtime.set_test_hooks(copy_delay_us=copy_delay_us, seed=seed, fault=fault, fault_batch=fault_batch,
                                     simulated_free_bytes=simulated_free_bytes, compute_delay_us=compute_delay_us)

    @_on_the_optimizer_itself
    def _batch_layout(self) -> list[dict]:
        """The batches in pipeline order (with overlap_forward, block order)."""
        layout = self._runtime.batch_layout()
        return [layout[b] for b in self._runtime.pipeline_order()]

    @_on_the_optimizer_itself
    def _set_timeline(self, enabled: bool) -> None:
        """Benchmark only: note when each batch's copies and update run."""
        self._runtime.enable_timeline(enabled)

    @_on_the_optimizer_itself
    def _timeline(self) -> list[dict]:
        """Benchmark only: the last step's spans, {lane, batch (pipeline
        position), start, end} in seconds after step() began; waits for it."""
        self.wait()
        return [dict(lane=lane, batch=batch, start=start, end=end)
                for lane, batch, start, end in self._runtime.timeline()]

    def __getstate__(self):
        raise TypeError("SwapOptimizer cannot be pickled or deep-copied; save state_dict() and load it into a new "
                        "SwapOptimizer")

    def __repr__(self) -> str:
        return f"SwapOptimizer({self.optimizer!r}, config={self.config!r})"
