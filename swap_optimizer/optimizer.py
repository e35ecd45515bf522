"""SwapOptimizer: wraps torch.optim.Adam/AdamW and keeps their state in host
memory, streamed through a few device staging arenas during step(). (Other
optimizers: rule_optimizer.py with rules.py; Adam's state-dict conversions:
state_dicts.py; DTensor helpers: distributed.py.)"""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import logging
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch

from . import _C
from .compact import FORMAT_KEY, MIN_QUANTIZED_NUMEL, MOMENTS, code_map, state_format
from .budget import (AutoBudget, Planning, allocated, budget_stats, copy_bytes, fused_op_table_bytes,
                     plan_for_budget)
from .config import SwapOptimizerConfig
from .distributed import (_check_fsdp_8bit, _global_offset, _is_dtensor, _like_param, _local,
                          _shared_default_seed, _sharded_scales)
from .overlap import ForwardOverlap, capturing, signals_after_the_step
from .rules import DECLARATIONS, REFUSED, declaration_for
from .state_dicts import checked_adam_state, write_adam_states


_ADAM_STEP = inspect.unwrap(torch.optim.Adam.step)
_log = logging.getLogger("swap_optimizer")
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Flags that choose how torch runs the update, not what it computes: loading a
# state dict keeps this optimizer's own.
_EXECUTION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def _keeps_adam_step(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, torch.optim.Adam) and inspect.unwrap(type(optimizer).step) is _ADAM_STEP


def _trusted(args: tuple, kwargs: dict) -> bool:
    """Whether SwapOptimizer(optimizer, *args, **kwargs) says trust_per_param_step=True."""
    config = args[0] if args else kwargs.get("config")
    return bool(kwargs.get("trust_per_param_step", getattr(config, "trust_per_param_step", False)))


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
    refused = next((reason for cls, reason in REFUSED.items() if isinstance(optimizer, cls)), None)
    if refused is not None:
        raise TypeError(f"SwapOptimizer cannot wrap {type(optimizer).__name__}: {refused}")
    if not _keeps_adam_step(optimizer):
        supported = ", ".join(sorted(cls.__name__ for d in DECLARATIONS for cls in d.classes))
        raise TypeError(f"SwapOptimizer wraps torch.optim.Adam or AdamW (or subclasses that keep their step) and "
                        f"torch.optim's {supported} (the classes themselves); got {type(optimizer).__name__}. "
                        "For an optimizer of your own or from a package, SwapOptimizer cannot prove from outside "
                        "that its step treats each param on its own (a global norm, Prodigy's d): if it does, "
                        "pass trust_per_param_step=True (see 'Optimizers of your own' in docs/usage.md)")


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


def _check_group_flags(group: dict, index: int) -> None:
    # foreach and fused only choose how torch would run the update, which
    # SwapOptimizer replaces with its own fused one: both are accepted.
    for flag, fix in (("capturable", "capturable=False"), ("differentiable", "differentiable=False")):
        if group.get(flag):
            raise ValueError(f"SwapOptimizer: param group {index} has {flag}=True, which SwapOptimizer does not "
                             f"support (it runs its own fused update); create the optimizer with {fix}")


def _check_params(params: list[torch.Tensor], device: Optional[torch.device], first_index: int = 0) -> torch.device:
    for offset, p in enumerate(params):
        index = first_index + offset
        if p.layout != torch.strided:
            raise ValueError(f"SwapOptimizer: param {index} is sparse ({p.layout}); only dense params are supported")
        if p.is_complex():
            raise TypeError(f"SwapOptimizer: param {index} is complex ({p.dtype}); use torch.view_as_real "
                            "on complex params or keep them in a separate optimizer")
        if p.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"SwapOptimizer: param {index} has dtype {p.dtype}; supported are float32, "
                            "bfloat16 and float16")
        if device is None:
            device = p.device
        elif p.device != device:
            raise ValueError(f"SwapOptimizer: param {index} is on {p.device} but earlier params are on {device}; "
                             "all params must be on one device")
    return device


def _on_the_optimizer_itself(method):
    """Runs `method` on the SwapOptimizer itself when it is called through a
    wrapper that subclasses the optimizer's class and forwards attributes to it
    (Lightning's LightningOptimizer copies or forwards them): the wrapper's own
    attributes would be stale copies, and writing them would split the state."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        return method(self._itself, *args, **kwargs)  # not through getattr: step hooks ran once already
    return run


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes a tensor's elements occupy."""
    extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    return tensor.data_ptr(), tensor.data_ptr() + extent * tensor.element_size()


def _elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose byte spans overlap share an element: column
    slices of one buffer interleave without sharing any."""
    (a_begin, a_end), (b_begin, b_end) = _byte_span(a), _byte_span(b)
    size = a.element_size()
    start, count = min(a_begin, b_begin), (max(a_end, b_end) - min(a_begin, b_begin)) // size
    if b.element_size() != size or (a_begin - b_begin) % size or count > 1 << 24:
        return True  # not comparable element by element (or too large to check): take the spans' word
    taken = torch.zeros(count, dtype=torch.bool)
    indices = torch.arange(count)
    taken[indices.as_strided(a.shape, a.stride(), (a_begin - start) // size).flatten()] = True
    return bool(taken[indices.as_strided(b.shape, b.stride(), (b_begin - start) // size).flatten()].any())


def _check_distinct(params: list[torch.Tensor]) -> None:
    """Refuses a param listed twice (a tied weight passed twice, say) and params
    whose memory overlaps; disjoint views of one buffer (vector_to_parameters)
    are fine. Indices are in param_groups order."""
    first_index = {}
    for index, p in enumerate(params):
        if id(p) in first_index:
            raise ValueError(f"SwapOptimizer: param {index} is the same tensor as param {first_index[id(p)]} "
                             "(a tied weight listed twice?); list each param once")
        first_index[id(p)] = index
    locals_ = [_local(p) for p in params]
    spans = sorted((*_byte_span(t), index) for index, t in enumerate(locals_) if t.numel() > 0 and not t.is_meta)
    open_spans = []  # (end, index) of earlier spans that may still overlap
    for begin, end, index in spans:
        open_spans = [(e, i) for e, i in open_spans if e > begin]
        for _, other in open_spans:
            if _elements_overlap(locals_[other], locals_[index]):
                a, b = sorted((other, index))
                raise ValueError(f"SwapOptimizer: params {a} and {b} share memory (their elements overlap), so one "
                                 "update would overwrite the other; give each its own tensor, or list a tied weight "
                                 "once")
        open_spans.append((end, index))


def _check_overlap_params(params: list[torch.Tensor]) -> None:
    dtensors = [i for i, p in enumerate(params) if _is_dtensor(p)]
    if dtensors:
        raise ValueError(f"SwapOptimizer: overlap_forward=True does not support DTensor params yet (FSDP2 and tensor "
                         f"parallel; param(s) {dtensors}): FSDP2 gathers params in its own hooks, which would read "
                         "them before their update. Use overlap_forward=False with DTensor params")


def _forward_overlap(optimizer: "SwapOptimizer", model: Optional[torch.nn.Module],
                     params: list[torch.Tensor]) -> Optional[ForwardOverlap]:
    """The overlap of the next forward with the step that overlap_forward=True
    asks for (None without it), checking model= and the params."""
    if optimizer.config.overlap_forward:
        if model is None:
            raise ValueError("SwapOptimizer(overlap_forward=True) needs model=: the module whose forward uses the "
                             "params, so that its blocks can wait for their updates")
        _check_overlap_params(params)
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

    def __new__(cls, optimizer: Optional[torch.optim.Optimizer] = None, *args: Any, **kwargs: Any):
        """Adam/AdamW get the fused kernel; the optimizers swap_optimizer.rules
        declares get their own update through RuleSwapOptimizer."""
        if cls is SwapOptimizer and isinstance(optimizer, torch.optim.Optimizer) \
                and not isinstance(optimizer, SwapOptimizer) and not _keeps_adam_step(optimizer) \
                and (declaration_for(optimizer) is not None or _trusted(args, kwargs)):
            from .rule_optimizer import RuleSwapOptimizer
            cls = RuleSwapOptimizer
        return super().__new__(cls)

    def __init__(self, optimizer: torch.optim.Optimizer, config: Optional[SwapOptimizerConfig] = None, *,
                 model: Optional[torch.nn.Module] = None, **fields: Any) -> None:
        """model: with overlap_forward=True, the module whose calls use the
        params (the one the training loop calls, or a holder of it); its
        forward then waits for each param's update where it first reads it
        (see swap_optimizer.overlap)."""
        self.__dict__["_itself_ref"] = weakref.ref(self)
        self.config = SwapOptimizerConfig.from_fields(config, fields)
        _check_optimizer(optimizer)
        _check_not_wrapped(optimizer)
        self.config.check_adam_state_keys()
        for index, group in enumerate(optimizer.param_groups):
            _check_group_flags(group, index)
        all_params = [p for g in optimizer.param_groups for p in g["params"]]
        self._device = _check_params(all_params, None)
        _check_distinct(all_params)
        self._overlap = _forward_overlap(self, model, all_params)
        self.optimizer = optimizer
        self._runtime = None
        self._auto = _auto_budget(self.config)
        # (param ids, their first reads in the forward) that the residents follow; None: param order
        self._ranked_by: Optional[tuple[list[int], list[int]]] = None
        self._rounding_seed = None
        if self.config.state_dtype == torch.bfloat16:  # stochastic rounding; the seed is saved in state dicts
            self._rounding_seed = self.config.rounding_seed
            if self._rounding_seed is None:
                self._rounding_seed = _shared_default_seed()
        if self.config.kahan_summation and not any(p.dtype != torch.float32 for p in all_params):
            warnings.warn("SwapOptimizer: kahan_summation=True applies to 16-bit params, and this optimizer has "
                          "none; it does nothing here", UserWarning, stacklevel=2)
        unscale = self.config.unscale_in_step
        self.__dict__["_unscale_in_step"] = (any(bool(g.get("fused")) for g in optimizer.param_groups)
                                             if unscale is None else unscale)
        # Sets up hooks and step profiling as for any optimizer; add_param_group
        # below defers to the base class until the runtime exists.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        existing = {p: dict(s) for p, s in optimizer.state.items() if s}
        self._build_runtime(existing, "the wrapped optimizer's state")
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

    def _follow_param_groups(self, caller: str) -> None:
        """Rebuilds the store when the params in param_groups are no longer those
        it was laid out for (groups reassigned, or params added by hand). A torn
        state is refused, in `caller`'s name, except by load_state_dict, which
        rewrites every state (and so may rebuild over it)."""
        params = self._params()
        if [id(p) for p in params] == self._param_ids and \
                [len(g["params"]) for g in self.param_groups] == self._group_sizes:
            return
        for index, group in enumerate(self.param_groups):
            _check_group_flags(group, index)
        _check_params(params, self._device)
        _check_distinct(params)
        if caller != "load_state_dict":
            self._refuse_if_torn(caller)
        previous = {p: entry for p, entry in self.state.items() if entry}  # waits for the last step
        self._build_runtime(previous, "the state carried over to the new param_groups")

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _group_of_param(self) -> list[int]:
        return [g for g, group in enumerate(self.param_groups) for _ in group["params"]]

    @torch.no_grad()
    def _build_runtime(self, previous: dict, source: str) -> None:
        """Lays out the stores for the current params (this rank's parts of
        DTensors) and fills them from `previous` (param -> state dict), zeros
        where absent."""
        params = self._params()
        if self._overlap is not None:  # refused before anything is built or written: the old store stays whole
            _check_overlap_params(params)
            self._overlap.check_params(params)
        group_of_param = self._group_of_param()
        group_amsgrad = [bool(group["amsgrad"]) for group in self.param_groups]
        index_of = {p: i for i, p in enumerate(params)}
        updates = [(index_of[p], checked_adam_state(p, entry, group_amsgrad[group_of_param[index_of[p]]],
                                                      f"{source}, param {index_of[p]}"))
                   for p, entry in previous.items() if p in index_of and entry]
        local_params = [_local(p) for p in params]
        swappable = [p.numel() >= self.config.min_numel and p.is_contiguous() for p in local_params]
        swap_keys = self.config.runtime_swap_keys()
        global_offsets = []
        if self._rounding_seed is not None:
            global_offsets = [_global_offset(p, i) for i, p in enumerate(params)]
        quantized_params = []
        if self.config.state_dtype == torch.uint8:
            for i, p in enumerate(params):
                if _is_dtensor(p):
                    _check_fsdp_8bit(p, f"SwapOptimizer: param {i}")
            # On the whole param (a DTensor's numel), so every rank's shard of it agrees.
            quantized_params = [p.numel() >= MIN_QUANTIZED_NUMEL for p in params]
        lay_out_as = functools.partial(_C.plan_staging, local_params, group_of_param, group_amsgrad,
                                       master_weights=self.config.master_weights, swap_keys=swap_keys,
                                       kahan_summation=self.config.kahan_summation)

        state_dtype = self.config.state_dtype  # (the closures keep no reference to this optimizer)

        def lay_out(swappable: list[bool], swap_times: int, num_arenas: int) -> _C.StagingSummary:
            summary = lay_out_as(swappable, swap_times=swap_times, num_arenas=num_arenas, state_dtype=state_dtype,
                                 quantized_params=quantized_params)
            return summary.with_update_temporary_bytes(fused_op_table_bytes(summary.plan))

        def advice(chosen, cost_model) -> list[str]:
            """Compact states the user may opt into, with what they would move
            and the predicted step: advice only, as they change the numerics."""
            lines = []
            for dtype in (torch.bfloat16, torch.uint8):
                if state_dtype == dtype:
                    continue
                quantized = [p.numel() >= MIN_QUANTIZED_NUMEL for p in params] if dtype == torch.uint8 else []
                summary = lay_out_as(chosen.swappable, swap_times=chosen.swap_times, num_arenas=chosen.num_arenas,
                                     state_dtype=dtype, quantized_params=quantized)
                seconds = cost_model.predict(summary, chosen.num_arenas)["seconds"]
                lines.append(f"state_dtype={dtype} would move {summary.moved_bytes} bytes each way (now "
                             f"{chosen.summary.moved_bytes}), predicted step {seconds * 1e3:.3f} ms; it changes "
                             "the numerics, so it is yours to opt into (docs/usage.md, 'Compact states')")
            return lines

        def staging_budget_swap_times() -> int:
            swap_times, smallest = _C.smallest_swap_times_for_budget(
                local_params, group_of_param, group_amsgrad, swappable, state_dtype=self.config.state_dtype,
                master_weights=self.config.master_weights, swap_keys=swap_keys,
                num_arenas=self.config.fixed_num_arenas, budget_bytes=self.config.staging_budget_bytes,
                kahan_summation=self.config.kahan_summation)
            if swap_times < 0:
                raise ValueError(f"SwapOptimizerConfig.staging_budget_bytes={self.config.staging_budget_bytes} is too "
                                 f"small: the smallest budget that works is {smallest} bytes (the finest split, "
                                 "pieces of at least 64 KiB of state); raise the budget, or keep more params "
                                 "resident with a larger min_numel")
            return swap_times

        copies = copy_bytes(local_params, self.__dict__["_unscale_in_step"] or self._overlap is not None)
        planning = Planning.make(self.config, self._budget_now(), lay_out, swappable, copies, self._device,
                                 staging_budget_swap_times, advice, self._resident_priority())
        runtime = _C.SwapRuntime(local_params, group_of_param, group_amsgrad, planning.swappable,
                                 swap_times=planning.swap_times, num_arenas=planning.num_arenas, state_dtype=self.config.state_dtype,
                                 master_weights=self.config.master_weights, pin_memory=self.config.pin_memory,
                                 keep_arenas=self.config.keep_arenas, swap_keys=swap_keys,
                                 kahan_summation=self.config.kahan_summation, rounding_seed=self._rounding_seed,
                                 global_offsets=global_offsets, quantized_params=quantized_params,
                                 resident_groups=self._resident_groups())
        stats = runtime.memory_stats()
        if stats["unpinned_host_bytes"]:
            warnings.warn(f"SwapOptimizer: could not pin {stats['unpinned_host_bytes']} bytes of host memory; that "
                          "part of the optimizer state uses pageable memory, so its copies are slower",
                          RuntimeWarning, stacklevel=3)
        views = [runtime.state_views(i) for i in range(len(params))]
        write_adam_states(params, views, dict(updates))
        runtime.order_writes()
        self._views = views  # this rank's store views, param by param
        # Scales are per local shard, never shaped like the param: kept local.
        self._entries = [{key: value if key == "step" or key.endswith("_absmax") else _like_param(value, p)
                          for key, value in view.items()} for p, view in zip(params, views)]
        # As torch.optim, a param shows a state entry once it has one: saved, or
        # from its first step with a grad. The store keeps a slot for every param.
        self._shown = [i in dict(updates) for i in range(len(params))]
        state = self.__dict__["_state"]
        state.clear()
        state.update((p, dict(entry)) for p, entry, shown in zip(params, self._entries, self._shown) if shown)
        if self._overlap is not None:
            self._overlap.lay_out(params)
        self._runtime = runtime
        self._planning = planning
        self._group_sizes = [len(g["params"]) for g in self.param_groups]
        self._param_ids = [id(p) for p in params]
        self._data_pointers = [p.data_ptr() for p in local_params]
        self._note_param_versions()

    def _note_param_versions(self) -> None:
        """Remembers the version counter of each param that has a master copy or
        a Kahan buffer."""
        self._param_versions = {i: _local(p)._version for i, p in enumerate(self._params())
                                if "master_param" in self._views[i] or "compensation" in self._views[i]}

    def _sync_outside_changes(self, params: list[torch.Tensor]) -> None:
        """Brings the store up to date with what changed outside step(): a master
        copy follows its param when the param was written since the last step
        (model.load_state_dict, say); a state entry that was replaced, edited or
        removed in `state` is loaded into the store (removed: reset and hidden, as
        torch starts it anew at the param's next grad)."""
        state = self.__dict__["_state"]
        edits, group_of_param = {}, None  # the latter only once something was edited
        for i, p in enumerate(params):
            entry, ours = state.get(p), self._entries[i]
            if not entry and not self._shown[i]:
                continue  # no state yet, as in torch (an empty entry: a read of the defaultdict)
            if entry is not None and len(entry) == len(ours) and all(entry.get(k) is v for k, v in ours.items()):
                continue
            group_of_param = group_of_param or self._group_of_param()
            amsgrad = bool(self.param_groups[group_of_param[i]]["amsgrad"])
            edits[i] = checked_adam_state(p, entry, amsgrad, f"SwapOptimizer.state[param {i}]") if entry else {}
        followed = [i for i, version in self._param_versions.items()
                    if _local(params[i])._version != version and i not in edits]
        if edits or followed:
            # The host store is written: the last step's copies out must have landed (on CUDA they may not).
            self._runtime.synchronize()
        if edits:
            write_adam_states(params, self._views, edits, only=edits.keys())
            for i, values in edits.items():
                self._shown[i] = bool(values)
                if values:
                    state[params[i]] = dict(self._entries[i])
        with torch.no_grad():
            for i in followed:
                view = self._views[i]
                if "compensation" in view:  # what the old value lost does not belong to the new one
                    view["compensation"].zero_()
                    continue
                # elementwise, as the kernel takes a write through .data
                master, local = view["master_param"], _local(params[i]).to(view["master_param"].device)
                master.copy_(torch.where(master.to(local.dtype) == local, master, local.float()))
        if edits or followed:
            self._runtime.order_writes()

    # ------------------------------------------------------------------ step
    # Dynamo would trace into the C++ runtime and set capturable=True on the
    # groups (torch.compile(opt.step), a documented recipe): run eagerly instead.
    @_on_the_optimizer_itself
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102  (torch.optim API)
        self._refuse_inside_step("step")
        self._refuse_if_torn("step")  # before the closure runs or anything is written
        if capturing(self._device):
            raise RuntimeError("SwapOptimizer.step() cannot be captured in a CUDA graph: it copies the state "
                               "between host and device through its own streams. Capture the forward and backward "
                               "only, and call step() outside the graph")
        loss = None
        if closure is not None:  # as torch.optim.Adam: evaluated once, before the update
            with torch.enable_grad():
                loss = closure()
        self.wait()  # after the closure, whose forward overlapped the last step
        # Ends the pass since the last step (a probe's record becomes the plan);
        # may refuse grads whose forward could not wait for that step.
        if self._overlap is not None:
            self._overlap.end_pass()
        self._stepping = True  # from here a signal handler may read, not change, the store
        stepped = False
        try:
            self._follow_param_groups("step")
            groups = self.param_groups
            group_args = []
            for index, group in enumerate(groups):
                _check_group_flags(group, index)
                beta1, beta2 = group["betas"]
                decoupled = group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
                group_args.append((float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                                   float(group["weight_decay"]), bool(group["amsgrad"]), bool(group["maximize"]),
                                   bool(decoupled)))
            params = [p for g in groups for p in g["params"]]
            data_pointers = [_local(p).data_ptr() for p in params]
            if data_pointers != self._data_pointers:  # .data replaced since the last step: aliasing is possible again
                _check_distinct(params)
                self._data_pointers = data_pointers
            self._sync_outside_changes(params)
            self._settle_plan()  # may move the (synced) store to a new plan
            deferred = self._overlap is not None and self._overlap.may_defer()  # after any rebuild or move
            grads = [None if p.grad is None else _local(p.grad) for p in params]
            state = self.__dict__["_state"]
            for i, (p, grad) in enumerate(zip(params, grads)):
                if grad is not None and not self._shown[i]:  # its first step: the state appears, as torch makes it
                    self._shown[i] = True
                    state[p] = dict(self._entries[i])
            stepped = True
            if self._overlap is not None:
                self._overlap.before_step(deferred)
            self._runtime.step([_local(p) for p in params], grads, group_args, getattr(self, "grad_scale", None),
                               getattr(self, "found_inf", None), deferred=deferred)
            if self._overlap is not None:
                self._overlap.after_step(deferred, self._runtime, grads)
        finally:
            self._stepping = False
            if self._overlap is not None:
                self._overlap.enqueuing = False  # its pass has begun, or step() raised
            # A stopped step leaves each param and its master consistent too.
            # (The step bumps no version counter, deferred or not: any later
            # bump is a write made outside step().)
            if stepped:
                self._note_param_versions()
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
            overlap.wait_all()
            runtime.wait_step()  # CUDA: also when a wait on another stream finished the step

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
            self._overlap.unproven = False

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
        self.wait()
        self._follow_param_groups("add_param_group")
        params = param_group["params"]
        # A generator can be read once: keep the list, as torch's add_param_group does.
        param_group["params"] = params = [params] if isinstance(params, torch.Tensor) else list(params)
        _check_params(params, self._device, first_index=sum(self._group_sizes))
        _check_group_flags(param_group, len(self.param_groups))
        _check_distinct(self._params() + params)
        self._refuse_if_torn("add_param_group")
        previous = dict(self.state)  # waits for the last step; views stay valid after the rebuild
        self.optimizer.add_param_group(param_group)  # validates and appends to the shared param_groups
        try:
            self._build_runtime(previous, "the current state")
        except BaseException:
            self.param_groups.pop()
            raise

    # ----------------------------------------------------------- state dicts
    @_on_the_optimizer_itself
    def state_dict(self) -> dict[str, Any]:  # noqa: D102  (torch.optim API)
        """The wrapped optimizer's format; swapped states are the host tensors
        themselves (no device copy), steps are CPU float32 tensors. (The base
        class reads `state`, which waits for the last step's copies.) With
        compact states, each param group also says how they are stored
        (FORMAT_KEY: the moments' form, the code maps and block size of 8-bit
        ones, the rounding seed of bf16 ones); see dequantize_state_dict."""
        state_dict = super().state_dict()
        if self.config.state_dtype == torch.uint8:  # scales of sharded params get a place per rank
            params = self._params()
            for index, entry in state_dict["state"].items():
                if _is_dtensor(params[index]):
                    entry = state_dict["state"][index] = dict(entry)  # torch's state dict shares our entries
                    for key in [k for k in entry if k.endswith("_absmax")]:
                        entry[key] = _sharded_scales(entry[key], params[index])
        if self.config.state_dtype in (torch.bfloat16, torch.uint8) or self.config.kahan_summation:
            form = state_format(self.config.state_dtype, self._rounding_seed)
            for group in state_dict["param_groups"]:
                group[FORMAT_KEY] = copy.deepcopy(form)
        return state_dict

    @_on_the_optimizer_itself
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102  (torch.optim API)
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("SwapOptimizer.load_state_dict: expected an optimizer state dict with 'state' and "
                             "'param_groups'")
        self._refuse_inside_step("load_state_dict")
        self.wait()
        self._follow_param_groups("load_state_dict")
        state_dict = state_dict.copy()  # as torch: hooks and loading never change the caller's dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        groups = self.param_groups
        if len(saved_groups) != len(groups):
            raise ValueError(f"SwapOptimizer.load_state_dict: the state dict has {len(saved_groups)} param groups "
                             f"but this optimizer has {len(groups)}")
        params = self._params()
        saved_ids, new_groups, saved_seed = [], [], None
        for g, (saved, group) in enumerate(zip(saved_groups, groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"SwapOptimizer.load_state_dict: param group {g} has {len(saved['params'])} params "
                                 f"in the state dict but {len(group['params'])} here")
            if bool(saved.get("amsgrad", False)) != bool(group["amsgrad"]):
                raise ValueError(f"SwapOptimizer.load_state_dict: param group {g} was saved with amsgrad="
                                 f"{bool(saved.get('amsgrad', False))} but this optimizer has amsgrad={group['amsgrad']}; "
                                 "create the wrapped optimizer with the saved amsgrad")
            saved_ids.extend(saved["params"])
            new_group = {**self.defaults, **saved, "params": group["params"]}
            form = new_group.pop(FORMAT_KEY, None)
            for moment, values in (form.get("code_maps") or {}).items() if isinstance(form, dict) else ():
                if moment in MOMENTS and list(values) != code_map(moment).tolist():
                    raise ValueError(f"SwapOptimizer.load_state_dict: param group {g}'s {FORMAT_KEY} has another "
                                     f"code map for {moment} than this version of swap_optimizer; decode the state "
                                     "dict with the version that saved it (dequantize_state_dict) and load that")
            seed = form.get("rounding_seed") if isinstance(form, dict) else None
            if seed is not None and self._rounding_seed is not None:  # resumes the same rounding draws
                if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
                    raise ValueError(f"SwapOptimizer.load_state_dict: param group {g}'s {FORMAT_KEY} has "
                                     f"rounding_seed {seed!r}; it must be an int in [0, 2**63)")
                saved_seed = seed
            for flag in _EXECUTION_FLAGS:
                new_group[flag] = group.get(flag)
            if isinstance(self.optimizer, torch.optim.AdamW):
                new_group["decoupled_weight_decay"] = True  # as AdamW.__setstate__ has it
            if "param_names" in group and "param_names" not in saved:
                new_group["param_names"] = group["param_names"]
            new_groups.append(new_group)
        index_of_id = {saved_id: i for i, saved_id in enumerate(saved_ids)}
        group_of_param = self._group_of_param()
        values = {}
        for saved_id, entry in state_dict["state"].items():
            if saved_id not in index_of_id:
                raise ValueError(f"SwapOptimizer.load_state_dict: state for param id {saved_id!r}, which no param "
                                 "group of the state dict lists")
            i = index_of_id[saved_id]
            if entry:
                values[i] = checked_adam_state(params[i], entry, bool(groups[group_of_param[i]]["amsgrad"]),
                                                f"SwapOptimizer.load_state_dict: param {i}")
        # Everything is checked: write.
        self._runtime.synchronize()
        if saved_seed is not None:
            self._rounding_seed = saved_seed
            self._runtime.set_rounding_seed(saved_seed)
        groups[:] = new_groups
        write_adam_states(params, self._views, values)
        self._runtime.order_writes()
        self._runtime.clear_torn()  # every param's state is rewritten, the torn ones' included
        state = self.__dict__["_state"]
        self._shown = [i in values for i in range(len(params))]
        for p, entry, shown in zip(params, self._entries, self._shown):
            if shown:
                state[p] = dict(entry)
            else:
                state.pop(p, None)
        self._note_param_versions()
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
        if ranked is None or self._budget_now() is None or ranked[0] != [id(p) for p in self._params()]:
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

    def _settle_plan(self) -> None:
        """At a step boundary (the last step is done, this one has not begun):
        with overlap_forward, adopts the forward's first reads once a probe has
        seen them, once per set of params (a forward whose calls vary from step
        to step must not move the store every step); derives an "auto" budget
        once it is due. Under a budget, either lays the store out again, in one
        move."""
        overlap, ids = self._overlap, [id(p) for p in self._params()]
        adopting = overlap is not None and overlap.first_reads is not None \
            and (self._ranked_by is None or self._ranked_by[0] != ids)
        if adopting:
            self._ranked_by = (ids, list(overlap.first_reads))
        if self._settle_auto_budget() or not adopting or self._budget_now() is None:
            return  # an "auto" move took the first reads along
        planning = self._planning
        try:
            choice = plan_for_budget(self.config, self._budget_now(), planning.lay_out, planning.base,
                                     planning.copy_bytes, self._device, self._resident_priority())
            if not choice.resident_params and not (planning.choice and planning.choice.resident_params):
                return  # the budget keeps no param resident either way: moving would change nothing
            # On failure the old layout, param order, is laid out again, and kept.
            self._move_to_new_plan(lambda: setattr(self, "_ranked_by", (ids, None)))
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
            plan_for_budget(self.config, budget, planning.lay_out, planning.base, planning.copy_bytes, self._device,
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
        self._move_to_new_plan(lambda: self._auto.measured.update(budget_bytes=None))
        stats = self.memory_stats()
        _log.info("SwapOptimizer: device_budget_bytes='auto' is %d bytes after %d warm-up steps (%s); the states "
                  "moved to swap_times=%d, num_arenas=%d, resident share %.1f%%", budget, self._auto.warmup_steps,
                  ", ".join(f"{k} {v}" for k, v in self._auto.measured.items() if k != "budget_bytes"),
                  stats["plan"]["swap_times"], stats["plan"]["num_arenas"], 100 * stats["resident_share"])
        return True

    def _move_to_new_plan(self, undo: Callable[[], None]) -> None:
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
                _check_overlap_params(params)
                self._overlap.check_params(params)
            except BaseException:
                undo()
                raise
        with signals_after_the_step():  # a Ctrl-C is raised once every state is in a whole store
            saved = [{key: view.to("cpu", copy=True) if view.device.type != "cpu" else view
                      for key, view in views.items()} for views in self._views]
            kept = self._bookkeeping()
            self._release_store()
            try:
                self._lay_out_empty()
                self._fill_store(saved, kept)
            except BaseException:
                undo()
                self._release_store()
                self._lay_out_empty()
                self._fill_store(saved, kept)
                raise

    def _fill_store(self, saved: list[dict], kept: dict) -> None:
        with torch.no_grad():
            for views, values in zip(self._views, saved):
                for key, view in views.items():
                    view.copy_(values[key])
        self._restore_bookkeeping(kept)
        self._runtime.order_writes()

    def _bookkeeping(self) -> dict:
        """What a store's layout does not hold: which params show a state."""
        return dict(shown=list(self._shown))

    def _restore_bookkeeping(self, kept: dict) -> None:
        self._shown = kept["shown"]
        state = self.__dict__["_state"]
        state.clear()
        state.update((p, dict(entry)) for p, entry, shown in zip(self._params(), self._entries, self._shown)
                     if shown)

    def _release_store(self) -> None:
        """Drops the store and every view of it (its device memory is freed)."""
        self.__dict__["_state"].clear()
        self._views = self._entries = None
        self._runtime = None

    def _lay_out_empty(self) -> None:
        self._build_runtime({}, "no state (it is moved in after)")

    # ----------------------------------------------------------------- misc
    @_on_the_optimizer_itself
    def memory_stats(self) -> dict[str, Any]:
        """Bytes of the host store, staging arenas (now and peak), resident
        states, bytes moved each way by the last step, batches and arenas; the
        resident share (device state bytes / all state bytes); with
        device_budget_bytes, the budget and the plan chosen for it."""
        return budget_stats(self._runtime.memory_stats(), self._planning, self._auto)

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
    def _batch_plan(self) -> list[dict]:
        """The batches in pipeline order (with overlap_forward, block order)."""
        plan = self._runtime.batch_plan()
        return [plan[b] for b in self._runtime.pipeline_order()]

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
