"""SwapOptimizer for optimizers other than Adam/AdamW: their states stream
through the same host store and staging arenas, and each batch is updated by
torch's own step of the wrapped class (swap_optimizer.rules)."""

from __future__ import annotations

import copy
import math
import numbers
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from . import _C
from .budget import Planning, budget_stats, copy_bytes
from .config import SwapOptimizerConfig
from .distributed import _is_dtensor, _like_param, _local, _local_part
from .optimizer import (SwapOptimizer, _auto_budget, _check_distinct, _check_not_wrapped, _check_optimizer,
                        _check_overlap_params, _check_params, _claim, _forward_overlap)
from .overlap import capturing, signals_after_the_step
from .rules import (ELEMENT, REFUSED, SCALAR, WHOLE, Declaration, declaration_for, estimated_temporaries,
                    foreign_state_keys, run_torch_update, trusted_declaration)


def _refuse_settings(config: SwapOptimizerConfig, name: str) -> None:
    adam_only = [field for field, off in (("state_dtype", config.state_dtype is None),
                                          ("master_weights", not config.master_weights),
                                          ("kahan_summation", not config.kahan_summation)) if not off]
    if adam_only:
        raise ValueError(f"SwapOptimizer: {', '.join(adam_only)} work(s) with Adam/AdamW only for now, not with "
                         f"{name}; leave them at their defaults (GradScaler still works through its unscale_)")


def _check_groups(optimizer: torch.optim.Optimizer, declaration: Declaration) -> None:
    """What torch's update could not run exactly here, refused before anything moves."""
    name = type(optimizer).__name__
    for index, group in enumerate(optimizer.param_groups):
        for flag in ("capturable", "differentiable"):
            if group.get(flag):
                raise ValueError(f"SwapOptimizer: param group {index} of {name} has {flag}=True, which SwapOptimizer "
                                 f"does not support (it stages the state batch by batch); create the optimizer with "
                                 f"{flag}=False")
        if group.get("fused") and not all(p.is_contiguous() for p in group["params"]):
            # torch makes a fused state with its param's strides and pairs
            # elements by memory position; the store's views are contiguous.
            raise ValueError(f"SwapOptimizer: param group {index} of {name} has fused=True and a non-contiguous "
                             "param; use fused=False for that group, or make the param contiguous")
    if declaration.validate is not None:
        declaration.validate(optimizer)


def _check_dtensor_params(params: list, declaration: Declaration, name: str) -> None:
    """DTensor params (FSDP2): each rank updates its local shard, which is
    the whole update only for an elementwise rule."""
    if not any(_is_dtensor(p) for p in params):
        return
    if declaration.states is None:
        raise ValueError(f"SwapOptimizer: {name} (wrapped on trust_per_param_step) with DTensor params (FSDP2) is "
                         "not supported yet; keep this optimizer's state on the device")
    if not declaration.elementwise:
        raise ValueError(f"SwapOptimizer: {name} with DTensor params (FSDP2): SwapOptimizer updates each rank's "
                         f"local shard, but {name}'s update needs the whole param (torch's own {name} gathers it "
                         "through DTensor's collectives). Keep this optimizer's state on the device, or use an "
                         "elementwise optimizer (AdamW, SGD, ...) for these params")


def _unscales_in_step(optimizer: torch.optim.Optimizer, declaration: Declaration, setting: Optional[bool]) -> bool:
    """Whether GradScaler hands step() its scale and inf flag: only torch's
    fused SGD and Adagrad take them, in every group. None follows the wrapped
    optimizer (fused: yes), as torch's GradScaler does with the plain one."""
    fused = declaration.takes_grad_scale and all(group.get("fused") for group in optimizer.param_groups)
    if setting and not fused:
        raise ValueError(f"SwapOptimizer: unscale_in_step=True, but {type(optimizer).__name__}'s update takes "
                         "GradScaler's scale and inf flag only in torch's fused SGD and Adagrad, with fused=True in "
                         "every param group; use fused=True there, or leave unscale_in_step at None (GradScaler "
                         "then unscales through its own unscale_)")
    return fused if setting is None else setting


def _copied(entry: dict) -> dict:
    """A state entry whose tensors are copies (a new store, or a probe, starts from it)."""
    return {key: value.clone() if torch.is_tensor(value) else value for key, value in entry.items()}


def _keep_scalar(scalars: dict, name: str, new: Any) -> None:
    """A param's scalar after an update: written into the kept tensor in place
    where it can be (torch keeps its identity), else replaced."""
    old = scalars.get(name)
    if torch.is_tensor(old) and torch.is_tensor(new) and old.shape == new.shape and old.dtype == new.dtype and \
            old.device == new.device:
        old.copy_(new)
    else:
        scalars[name] = new


class _Kept(NamedTuple):
    """A state a param keeps: its name, kind, shape (whole states; element
    states of a learned layout) and dtype (None: the param's)."""
    name: str
    kind: str
    shape: Optional[tuple[int, ...]]
    dtype: Optional[torch.dtype] = None


def _learn_layout(index: int, param: torch.Tensor, entry: dict, name: str,
                  check_device: bool = False) -> tuple[_Kept, ...]:
    """The states of a trusted optimizer's param, read from what it keeps:
    param-shaped tensors are element states, other tensors whole ones, 0-dim
    tensors and numbers scalars (kept where they are). check_device: the
    entry comes from the optimizer itself (not from the host store), so its
    tensors must be on the param's device."""
    kept = []
    for key, value in entry.items():
        where = f"SwapOptimizer: state '{key}' of param {index} ({name})"
        if value is None or isinstance(value, numbers.Number):  # None: timm's SGDW without momentum
            kept.append(_Kept(key, SCALAR, None))
            continue
        if not torch.is_tensor(value):
            raise TypeError(f"{where} is a {type(value).__name__}; a trusted optimizer's states must be plain "
                            "tensors, numbers or None. Keep this optimizer's state on the device")
        if type(value) is not torch.Tensor or value.layout != torch.strided:
            raise TypeError(f"{where} is a {type(value).__name__} with layout {value.layout}, not a plain strided "
                            "tensor (a tensor subclass, such as torchao's 8-bit states, keeps its own storage that "
                            "SwapOptimizer cannot stream). Use the optimizer's plain states, or keep its state on "
                            "the device")
        if value.dim() == 0:
            kept.append(_Kept(key, SCALAR, None))
        elif check_device and value.device != param.device:
            raise TypeError(f"{where} is on {value.device}, its param on {param.device}; SwapOptimizer streams "
                            "states kept on their param's device. Keep this optimizer's state as it is")
        else:
            kept.append(_Kept(key, ELEMENT if value.shape == param.shape else WHOLE, tuple(value.shape),
                              value.dtype))
    return tuple(kept)


def _same_state(a: dict, b: dict, flatten: bool = False) -> bool:
    """Whether two state entries hold the same values (flatten: compare
    tensors element by element, whatever their shapes)."""
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if flatten and torch.is_tensor(x) and torch.is_tensor(y):
            x, y = x.reshape(-1), y.reshape(-1)
        if not _same_value(x, y):
            return False
    return True


def _same_value(a: Any, b: Any) -> bool:
    """Equal values, NaN equal to NaN (a tensor comparison waits for it)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype):
            return False
        a, b = a.detach(), b.detach().to(a.device)
        return bool(((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b).all())
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (list, tuple)) and type(a) is type(b):  # element by element: they may hold tensors
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and type(a) is type(b):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001  (values that cannot be compared are not the same)
        return False


def _fresh(value: Any) -> Any:
    """A copy of a group value's tensors and containers (lists, tuples, dicts,
    sets, as deep as they go; tensor betas, say): what a step's batches read
    is the value at step(), whatever a call, a scheduler's in-place fill_ or
    GradScaler does to the original meanwhile. Any other object is shared,
    as a shallow copy of the group shares it: a module or a lock a group may
    hold is neither copied nor refused."""
    if torch.is_tensor(value):
        with torch.no_grad():
            return value.clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_fresh(item) for item in value))
    if isinstance(value, (list, tuple, set)):
        return type(value)(_fresh(item) for item in value)
    if isinstance(value, dict):
        copied = copy.copy(value)  # (its type and attributes, a defaultdict's factory)
        for key, item in value.items():
            copied[key] = _fresh(item)
        return copied
    return value


@dataclass
class _StepContext:
    """Everything a step's batch updates read, captured at step(): the runtime
    holds it (through _BatchRule) until the step is done, so a deferred step
    completes with these values whatever happens meanwhile to the groups (a
    scheduler writing a tensor lr in place), GradScaler's tensors, or the
    SwapOptimizer itself (dropped before anything waited)."""

    optimizer: torch.optim.Optimizer        # the wrapped one: its class's step, its attributes
    plan: list[dict]                        # the runtime's batch plan
    keys: list[str]                         # the store's state keys, in arena offset order
    views: list[dict]                       # per param: its state views in the store (shapes, dtypes)
    layouts: list[tuple]                    # per param: the states it keeps
    scalars: list[dict]                     # per param: its scalars now (the last piece writes them)
    scalars_before: list[dict]              # per param: copies of its scalars before the step
    had_state: list[bool]                   # per param: whether it had stepped before
    group_of: list[int]                     # per param: its group
    step_groups: list[dict]                 # per group: copies of its values at step()
    grad_scale: dict                        # GradScaler's grad_scale / found_inf, copies
    learner: Optional[Any] = None           # a vouched-for optimizer's SwapOptimizer (never deferred)


class _BatchRule:
    """The update the runtime calls for each batch. It holds the current
    step's context, never the SwapOptimizer: the optimizer holds the runtime,
    so a reference back would keep both alive."""

    def __init__(self) -> None:
        self.step: Optional[_StepContext] = None

    def __call__(self, batch: int, arena: torch.Tensor, params: list[torch.Tensor],
                 grads: list[Optional[torch.Tensor]]) -> None:
        _update_batch(self.step, batch, arena, params, grads)


def _update_batch(step: _StepContext, batch: int, arena: torch.Tensor, params: list[torch.Tensor],
                  grads: list[Optional[torch.Tensor]]) -> None:
    """One batch of `step`, by torch's own step: each row (a param, or a piece
    of a cut one) becomes a param of its group with the staged views as its
    state; torch's call creates or replaces states at a param's first step,
    which are then copied into the arena."""
    plan = step.plan[batch]
    groups: dict[int, list[torch.Tensor]] = {}
    state: dict[torch.Tensor, dict] = {}
    rows = []
    for (index, offset, count), offsets, param, grad in zip(plan["pieces"], plan["arena_offsets"], params,
                                                              grads):
        if grad is None:
            continue
        whole = offset == 0 and count == param.numel()
        if whole:
            piece, piece_grad = param.detach(), grad
        else:  # only contiguous params are cut
            piece = param.detach().view(-1)[offset:offset + count]
            piece_grad = grad.reshape(-1)[offset:offset + count]
        piece.grad = piece_grad
        views = {}
        for key, arena_offset in zip(step.keys, offsets):
            if arena_offset < 0:
                continue
            described = step.views[index][key]
            shape = described.shape if whole else (count,)
            numel = described.numel() if whole else count
            nbytes = numel * described.element_size()
            views[key] = arena[arena_offset:arena_offset + nbytes].view(described.dtype).view(shape)
        entry = {}
        if step.had_state[index]:
            entry.update(views)
            for name, value in step.scalars_before[index].items():
                entry[name] = value.clone() if torch.is_tensor(value) else value
        groups.setdefault(step.group_of[index], []).append(piece)
        state[piece] = entry
        rows.append((index, offset + count == param.numel(), piece, views))
    if not rows:
        return
    learner = step.learner
    if learner is not None:  # a vouched-for step may write its groups: each call gets copies, checked after
        calls = [learner._call_group(g, pieces) for g, pieces in sorted(groups.items())]
        run_torch_update(step.optimizer, [group for group, _ in calls], state, strict=True)
        for g, (call_group, start) in zip(sorted(groups), calls):
            learner._note_groups_after(g, call_group, start)
    else:  # torch's own steps leave their groups as they are
        run_torch_update(step.optimizer, [dict(step.step_groups[g], params=pieces)
                                          for g, pieces in sorted(groups.items())], state,
                         grad_scale=step.grad_scale)
    name = type(step.optimizer).__name__
    source = "it kept at its first update" if learner is not None else "its declaration says it keeps"
    for index, last, piece, views in rows:
        entry = state[piece]
        kept = {spec.name for spec in step.layouts[index]}
        # (a vouched-for param that kept nothing at its first update must keep nothing still)
        if (step.had_state[index] or learner is not None) and set(entry) != kept:
            raise RuntimeError(f"SwapOptimizer: {name}'s step left param {index} with states {sorted(entry)}, but "
                               f"{source} {sorted(kept)}: SwapOptimizer keeps a param's states from its first "
                               "update on, as torch.optim does. This optimizer cannot be wrapped; keep its state "
                               "on the device")
        for key, view in views.items():
            value = entry.get(key)
            if value is None:
                raise RuntimeError(f"SwapOptimizer: {name}'s step kept no '{key}' for param {index}, which "
                                   f"{source}")
            if value is not view:  # created or replaced by torch's step: adopted into the store
                view.copy_(value)
        if last:  # the param's scalars after the step: in place, as torch keeps them (identity included)
            for spec in step.layouts[index]:
                if spec.kind == SCALAR:
                    _keep_scalar(step.scalars[index], spec.name, entry[spec.name])


class RuleSwapOptimizer(SwapOptimizer):
    """A SwapOptimizer whose update is torch's own step of the wrapped class,
    run on each batch's staged states (see swap_optimizer.rules). Made by
    SwapOptimizer(optimizer) for the optimizers rules.DECLARATIONS lists."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: Optional[SwapOptimizerConfig] = None, *,
                 model: Optional[torch.nn.Module] = None, **fields: Any) -> None:
        self.__dict__["_itself_ref"] = weakref.ref(self)
        self.config = SwapOptimizerConfig.from_fields(config, fields)
        name = type(optimizer).__name__
        declaration = declaration_for(optimizer)
        if declaration is None:
            refused = next((reason for cls, reason in REFUSED.items() if isinstance(optimizer, cls)), None)
            if refused is not None or not self.config.trust_per_param_step:
                _check_optimizer(optimizer)  # raises, saying why (and which setting vouches for an optimizer)
            declaration = trusted_declaration(optimizer, self.config.trust_elementwise_step)
        _refuse_settings(self.config, name)
        _check_not_wrapped(optimizer)
        _check_groups(optimizer, declaration)
        all_params = [p for g in optimizer.param_groups for p in g["params"]]
        self._device = _check_params(all_params, None)
        _check_distinct(all_params)
        _check_dtensor_params(all_params, declaration, name)
        self._overlap = _forward_overlap(self, model, all_params)
        self.declaration: Declaration = declaration
        self.optimizer = optimizer
        self._runtime = None
        self._auto = _auto_budget(self.config)
        self._ranked_by: Optional[tuple[list[int], list[int]]] = None
        self._rounding_seed = None
        self._learned: dict = {}
        self._probed: set = set()  # (group, dimensionality) whose contract was probed
        self._stateless: set = set()  # ids of params whose first update kept no state
        # A vouched-for optimizer's params with state that no update of ours made
        # (made in its __init__, loaded, or eager in add_param_group): their next
        # update runs whole, from that state, to learn all they keep.
        self._not_updated: set = set()
        self.__dict__["_unscale_in_step"] = _unscales_in_step(optimizer, declaration, self.config.unscale_in_step)
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        foreign = foreign_state_keys(optimizer.state, {id(p) for p in all_params})
        if foreign:
            raise ValueError(f"SwapOptimizer: {name} keeps state under {foreign}, keys that are not its params (a "
                             "step counter shared by all params, say); SwapOptimizer runs the step batch by batch "
                             "and cannot keep such a value. This optimizer cannot be wrapped; keep its state on the "
                             "device")
        existing = {p: dict(s) for p, s in optimizer.state.items() if s}
        if declaration.states is None:  # a vouched-for optimizer's own states: on their params' devices
            index_of = {id(p): i for i, p in enumerate(all_params)}
            for p, entry in existing.items():
                _learn_layout(index_of[id(p)], p, entry, name, check_device=True)
            self._not_updated = {id(p) for p in existing}
        self._lay_out(existing)
        _claim(optimizer, self)

    # ---------------------------------------------------------------- layout
    @property
    def _learning(self) -> bool:
        """Whether the states are learned per param (a trusted optimizer)."""
        return self.declaration.states is None

    def _layouts(self, learned: Optional[dict] = None) -> list[tuple]:
        """Per param in group order, the states its group's current settings
        give it (_follow holds a param that has stepped to the ones it has);
        for a trusted optimizer, those learned from its state (`learned`, else
        the current ones)."""
        if self._learning:
            learned = self._learned if learned is None else learned
            return [learned.get(p, ()) for p in self._params()]
        layouts = []
        for group in self.param_groups:
            for p in group["params"]:
                layouts.append(tuple(_Kept(spec.name, spec.kind, tuple(spec.shape(p.shape)) if spec.kind == WHOLE
                                           else None) for spec in self.declaration.states(p, group)))
        return layouts

    def _lay_out(self, previous: dict, learned: Optional[dict] = None) -> None:
        """Builds the store for the current params and their layouts, filled
        from `previous` (param -> its state as torch.optim holds it); a trusted
        optimizer's layouts are learned from `previous` unless given."""
        params = self._params()
        if self._overlap is not None:  # refused before anything is built: the old store stays whole
            _check_overlap_params(params)
            self._overlap.check_params(params)
        if self._learning and learned is None:
            name = type(self.optimizer).__name__
            learned = {p: _learn_layout(i, p, previous[p], name) for i, p in enumerate(params) if previous.get(p)}
        layouts = self._layouts(learned)
        keys: list[str] = []
        for specs in layouts:
            keys += [s.name for s in specs if s.kind != SCALAR and s.name not in keys]
        locals_ = [_local(p) for p in params]  # a DTensor's shard on this rank: what the store holds
        states, swappable, splittable = [], [], []
        for p, specs in zip(locals_, layouts):
            by_name = {s.name: s for s in specs}
            row = []
            for key in keys:
                spec = by_name.get(key)
                if spec is None:
                    row.append((key, "absent", 0, p.dtype, []))
                    continue
                dtype = spec.dtype or p.dtype
                if spec.kind == ELEMENT:
                    row.append((key, "element", dtype.itemsize, dtype, list(p.shape)))
                else:
                    row.append((key, "whole", math.prod(spec.shape) * dtype.itemsize, dtype, list(spec.shape)))
            states.append(row)
            kept = any(s.kind != SCALAR for s in specs)
            swappable.append(kept and p.numel() >= self.config.min_numel and p.is_contiguous())
            # torch's CPU kernels round 16-bit values differently in their
            # vectorized body and their scalar tail, and where tails fall
            # depends on how the threads share a tensor: cutting a 16-bit param
            # on the CPU would change torch's own result (docs/design.md).
            cpu_16_bit = p.device.type == "cpu" and p.element_size() < 4
            splittable.append(self.declaration.elementwise and all(s.kind != WHOLE for s in specs) and not cpu_16_bit)
        unknown = [k for k in (self.config.state_keys or ()) if k not in keys]
        # A trusted optimizer's names are known once every param has stepped.
        if unknown and (not self._learning or len(learned) == len(params)):
            raise ValueError(f"SwapOptimizerConfig.state_keys: {unknown} are not states of "
                             f"{type(self.optimizer).__name__} here; its states are {keys}")
        swap_keys = [self.config.state_keys is None or key in self.config.state_keys for key in keys]
        itself = weakref.ref(self)  # the plan keeps lay_out, which must not keep this optimizer alive

        def lay_out(swappable_now: list[bool], swap_times: int, num_arenas: int) -> _C.StagingSummary:
            summary = _C.plan_rule_staging(locals_, states, swappable_now, splittable, swap_keys,
                                           swap_times=swap_times, num_arenas=num_arenas)
            return summary.with_update_temporary_bytes(itself()._temporaries_of(summary.plan, states))

        copies = copy_bytes(locals_, self.__dict__.get("_unscale_in_step", False) or self._overlap is not None)
        planning = Planning.make(self.config, self._budget_now(), lay_out, swappable, copies, self._device,
                                 lambda: self._swap_times_for_budget(locals_, states, swappable, splittable, swap_keys),
                                 priority=self._resident_priority())
        rule = _BatchRule()
        runtime = _C.SwapRuntime(locals_, states, planning.swappable, splittable, rule,
                                 swap_times=planning.swap_times, num_arenas=planning.num_arenas,
                                 pin_memory=self.config.pin_memory, keep_arenas=self.config.keep_arenas,
                                 swap_keys=swap_keys, resident_groups=self._resident_groups())
        views = [runtime.state_views(i) for i in range(len(params))]
        scalars: list[dict] = [{} for _ in params]
        shown = [False] * len(params)
        with torch.no_grad():
            for i, (p, specs) in enumerate(zip(params, layouts)):
                entry = previous.get(p)
                if not entry:
                    continue
                self._check_entry(i, p, specs, entry)
                for spec in specs:
                    if spec.kind == SCALAR:
                        value = entry[spec.name]
                        scalars[i][spec.name] = value.clone() if torch.is_tensor(value) else value
                    else:
                        views[i][spec.name].copy_(_local_part(entry[spec.name], p))
                shown[i] = True
        runtime.order_writes()
        if self._overlap is not None:  # a new store: the next pass probes again
            self._overlap.lay_out(params)
        self._runtime = runtime
        self._rule = rule
        if learned is not None:
            self._learned = learned
        self._keys = keys
        self._swap_keys = swap_keys
        self._state_rows = states
        self._planning = planning
        self._moves_whole = [swap and not cut for swap, cut in zip(planning.swappable, splittable)]
        self._layouts_now = layouts
        self._views = views
        # What `state` shows: DTensors over the store's views for DTensor params
        # (made once: _sync_edits tells edits by identity).
        self._shown_views = [{key: _like_param(view, p) for key, view in row.items()} for row, p in zip(views, params)]
        self._scalars = scalars
        self._shown = shown
        self._plan = runtime.batch_plan()
        self._param_ids = [id(p) for p in params]
        self._group_sizes = [len(g["params"]) for g in self.param_groups]
        self._data_pointers = [_local(p).data_ptr() for p in params]
        self._refresh_state(params)

    def _swap_times_for_budget(self, params: list, states: list, swappable: list, splittable: list,
                               swap_keys: list) -> int:
        """The smallest swap_times whose staging plus torch's update temporaries
        (an estimate, see memory_stats) fit in staging_budget_bytes; refuses,
        naming the smallest budget that works, when none does."""
        budget, num_arenas = self.config.staging_budget_bytes, self.config.fixed_num_arenas

        def need(swap_times: int) -> tuple[int, int, int]:
            summary = _C.plan_rule_staging(params, states, swappable, splittable, swap_keys,
                                           swap_times=swap_times, num_arenas=num_arenas)
            staging, temporaries = summary.staging_bytes, self._temporaries_of(summary.plan, states)
            return staging + temporaries, staging, summary.finest_swap_times

        finest = need(1)[2]
        for swap_times in range(1, min(num_arenas, finest) + 1):  # below num_arenas batches each adds an arena
            if need(swap_times)[0] <= budget:
                return swap_times
        # From there on the largest batch shrinks as batches are added (up to a
        # wobble near the finest split): bisect, then step back while one fits.
        low, high = min(num_arenas, finest) + 1, finest
        if low > high or need(high)[0] > budget:
            window = range(max(1, finest - 8), finest + 1)
            smallest, at = min((need(k)[0], k) for k in window)
            if smallest <= budget:
                return at
            whole = max((math.prod(_local(p).shape) for p, row, cut in zip(self._params(), states, splittable)
                         if not cut and any(kind != "absent" for _, kind, *_ in row)), default=0)
            raise ValueError(
                f"SwapOptimizerConfig.staging_budget_bytes={budget} is too small for "
                f"{type(self.optimizer).__name__}: the smallest budget that works is {smallest} bytes (its arenas "
                f"and the estimate of torch's update temporaries at swap_times={at}"
                + (f"; params its rule never cuts move whole, the largest of {whole} elements" if whole else "")
                + "); raise the budget, or keep more params resident with a larger min_numel")
        while low < high:
            middle = (low + high) // 2
            if need(middle)[0] <= budget:
                high = middle
            else:
                low = middle + 1
        while low > min(num_arenas, finest) + 1 and need(low - 1)[0] <= budget:
            low -= 1
        return low

    def _check_entry(self, index: int, param: torch.Tensor, specs, entry: dict) -> None:
        where = f"SwapOptimizer: the state of param {index} ({type(self.optimizer).__name__})"
        missing = [s.name for s in specs if s.name not in entry]
        extra = [k for k in entry if k not in {s.name for s in specs}]
        if missing or extra:
            raise ValueError(f"{where} has keys {sorted(entry)}, but under its group's settings it keeps "
                             f"{[s.name for s in specs]}; a state saved with other settings (momentum, centered) "
                             "loads into an optimizer created with those settings")
        for spec in specs:
            value = entry[spec.name]
            if spec.kind == SCALAR:
                continue
            if not torch.is_tensor(value) or value.layout != torch.strided or value.is_meta:
                raise ValueError(f"{where}: '{spec.name}' must be a dense tensor, got {type(value).__name__}")
            shape = tuple(param.shape) if spec.kind == ELEMENT else spec.shape
            if tuple(value.shape) != shape:
                raise ValueError(f"{where}: '{spec.name}' has shape {tuple(value.shape)}, expected {shape}")

    def _refresh_state(self, params: list[torch.Tensor]) -> None:
        """`state` as torch.optim shows it: for each param with a state, its
        views in the store and its scalars."""
        state = self.__dict__["_state"]
        state.clear()
        for i, p in enumerate(params):
            if self._shown[i]:
                state[p] = self._entry(i)

    def _entry(self, index: int) -> dict:
        entry = {}
        for spec in self._layouts_now[index]:
            entry[spec.name] = self._scalars[index][spec.name] if spec.kind == SCALAR else \
                self._shown_views[index][spec.name]
        return entry

    def _follow(self) -> None:
        """Lays the store out again when the params, or the states a param that
        has not stepped yet would keep, changed since (param_groups edited, a
        scheduler that turned momentum on before the first step). A param that
        has stepped keeps its states, as torch's; a change of setting that
        would need others is refused."""
        params = self._params()
        layouts = self._layouts()
        same_params = [id(p) for p in params] == self._param_ids and \
            [len(g["params"]) for g in self.param_groups] == self._group_sizes
        if same_params and layouts == self._layouts_now:
            return
        if same_params:
            for i, (now, then) in enumerate(zip(layouts, self._layouts_now)):
                if self._shown[i] and now != then:
                    raise ValueError(
                        f"SwapOptimizer: param {i} now would keep states {[s.name for s in now]} under its group's "
                        f"settings, but it has stepped with {[s.name for s in then]}; torch.optim keeps a param's "
                        "states from its first step too. Change such settings (momentum, centered) only before the "
                        "first step, or load a state dict saved with the new settings")
        _check_params(params, self._device)
        _check_distinct(params)
        self._refuse_if_torn("step")
        self._lay_out(self._kept_state())

    def _kept_state(self) -> dict:
        """Copies of the state of every param the store was laid out for that is
        still in the groups (param -> entry), to fill a new store from."""
        self._synchronize()
        by_id = {id(p): p for p in self._params()}
        return {by_id[pid]: _copied(self._entry(i)) for i, pid in enumerate(self._param_ids)
                if self._shown[i] and pid in by_id}

    # ------------------------------------------------------------------ step
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102  (torch.optim API)
        self = self._itself
        self._refuse_inside_step("step")
        self._refuse_if_torn("step")
        if capturing(self._device):
            raise RuntimeError("SwapOptimizer.step() cannot be captured in a CUDA graph: it copies the state "
                               "between host and device through its own streams. Capture the forward and backward "
                               "only, and call step() outside the graph")
        loss = None
        if closure is not None:  # as torch.optim: evaluated once, before the update
            with torch.enable_grad():
                loss = closure()
        self.wait()  # after the closure, whose forward overlapped the last step
        if self._overlap is not None:  # ends the pass since the last step (a probe's record becomes the plan)
            self._overlap.end_pass()
        _check_groups(self.optimizer, self.declaration)
        amp = {name: value for name in ("grad_scale", "found_inf")
               if (value := getattr(self, name, None)) is not None}
        not_fused = [g for g, group in enumerate(self.param_groups) if not group.get("fused")]
        if amp and (not self.declaration.takes_grad_scale or not_fused):
            raise ValueError(f"SwapOptimizer: GradScaler handed step() its scale and inf flag (unscale_in_step), "
                             f"but param group(s) {not_fused} of {type(self.optimizer).__name__} are not fused=True "
                             "(any more), and only torch's fused SGD and Adagrad take them: set fused=True there, or "
                             "wrap with unscale_in_step=False")
        self._follow()
        params = self._params()
        data_pointers = [_local(p).data_ptr() for p in params]
        if data_pointers != self._data_pointers:  # .data replaced since the last step
            _check_distinct(params)
            self._data_pointers = data_pointers
        grads = [None if p.grad is None else _local(p.grad) for p in params]  # a DTensor's: this rank's shard
        for i, grad in enumerate(grads):
            if grad is not None and grad.is_sparse:
                raise RuntimeError(f"SwapOptimizer: param {i} has a sparse gradient; "
                                   f"{type(self.optimizer).__name__} runs on dense grads here (torch.optim.SparseAdam "
                                   "is the optimizer for sparse ones)")
        self._sync_edits(params)
        self._settle_plan()
        # What every batch call starts from: the groups as they are now, copied
        # (a deferred step runs on after step() returns, while a scheduler may
        # write a tensor lr in place).
        self._step_groups = [{k: _fresh(v) for k, v in group.items() if k != "params"} for group in self.param_groups]
        self._group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        self._groups_after: dict[int, dict] = {}
        # A vouched-for optimizer's params without state yet are updated whole,
        # one at a time, to learn what they keep; the others go through the store.
        first = [i for i, grad in enumerate(grads) if grad is not None and self._learning
                 and (not self._shown[i] or id(params[i]) in self._not_updated) and id(params[i]) not in self._stateless]
        # overlap_forward: the step may run beside the next forward once the
        # probe has made a plan, unless a param steps for the first time (its
        # states and scalars appear during the step) or the optimizer is a
        # vouched-for one (its group writes are checked when the step is done).
        deferred = self._overlap is not None and self._overlap.may_defer() and not self._learning and all(
            self._shown[i] or not self._layouts_now[i] for i, grad in enumerate(grads) if grad is not None)
        with signals_after_the_step():  # raised once the step and its bookkeeping are done
            self._stepping = True
            try:
                if self._learning:
                    self._probe_contract(params, grads, [i for i, grad in enumerate(grads) if grad is not None])
                if first:
                    self._learn_first_updates(params, grads, first)
                # The step's context, held by the runtime's rule until the step is done
                # (after the first updates: they may lay the store out again).
                self._rule.step = _StepContext(
                    optimizer=self.optimizer, plan=self._plan, keys=self._keys, views=self._views,
                    layouts=self._layouts_now, scalars=self._scalars,
                    # the kept tensors are the last piece's to write
                    scalars_before=[{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                                    for s in self._scalars],
                    had_state=list(self._shown), group_of=self._group_of, step_groups=self._step_groups,
                    grad_scale={name: _fresh(value) for name, value in amp.items()},
                    learner=self if self._learning else None)
                streamed = [None if i in first else grad for i, grad in enumerate(grads)]
                if self._overlap is not None:
                    self._overlap.before_step(deferred)
                self._runtime.step([_local(p) for p in params], streamed, [], None, None, deferred=deferred)
                if self._overlap is not None:
                    self._overlap.after_step(deferred, self._runtime, streamed)
                for g, writes in self._groups_after.items():  # the same from every call: the group's new values
                    # (a tensor copied again here: one made in a call is an inference tensor)
                    self.param_groups[g].update({k: v.clone() if torch.is_tensor(v) else v for k, v in writes.items()})
            finally:
                self._stepping = False
                if self._overlap is not None:
                    self._overlap.enqueuing = False  # its pass has begun, or step() raised
                if self._learning:  # never deferred: done, and the context must not keep this optimizer alive
                    self._rule.step = None
            state = self.__dict__["_state"]
            for i, grad in enumerate(grads):
                if grad is not None and self._layouts_now[i]:  # SGD without momentum keeps no state, as in torch
                    self._shown[i] = True
                    state[params[i]] = self._entry(i)  # a first step's scalars are new objects
        return loss

    def _learn_first_updates(self, params: list[torch.Tensor], grads: list, first: list[int]) -> None:
        """A trusted optimizer's first update of each param in `first`, whole
        and on its own, on the device: the states it makes tell the param's
        layout, and the store is laid out again with them. If anything fails
        (a call breaks the contract, a state cannot be streamed, state_keys
        names a state it does not keep), the params updated so far get their
        values back before the error: nothing changed."""
        name = type(self.optimizer).__name__
        backups, updated, layouts, stateless = [], {}, {}, []
        had_state = any(self._shown[i] for i in first)
        if had_state:
            self._synchronize()  # the host store holds the last step's copies
        try:
            for i in first:
                param = params[i]
                start_state = self._start_state(i, param)  # before the param changes
                backups.append((param, param.detach().to("cpu", copy=True)))
                piece = param.detach()
                piece.grad = grads[i].clone()  # the call may change it in place; a refusal must not
                state = {piece: start_state}
                call_group, start = self._call_group(self._group_of[i], [piece])
                run_torch_update(self.optimizer, [call_group], state, strict=True)
                self._note_groups_after(self._group_of[i], call_group, start)
                updated[i] = state[piece]
                layouts[i] = _learn_layout(i, param, updated[i], name, check_device=True)  # refuses the unstreamable
                if not updated[i]:
                    stateless.append(id(param))
            if all(self._shown[i] and updated[i] and layouts[i] == self._layouts_now[i] for i in first):
                self._write_entries(updated)  # a resume: the states the store holds already, new values
            elif had_state or any(updated.values()):
                entries = {params[i]: {key: value.to("cpu", copy=True) if torch.is_tensor(value) and value.dim() > 0
                                       else value for key, value in entry.items()} for i, entry in updated.items()}
                self._lay_out({**self._kept_state(), **entries})
        except BaseException:
            for param, backup in backups:
                param.detach().copy_(backup)
            raise
        self._stateless.update(stateless)
        self._not_updated -= {id(params[i]) for i in first}

    def _write_entries(self, updated: dict) -> None:
        """Writes the states of params whose layout did not change (index ->
        its state after a whole update) into the store: views copied, scalars
        in place where they can be (torch keeps their identity)."""
        for i, entry in updated.items():
            for spec in self._layouts_now[i]:
                if spec.kind == SCALAR:
                    _keep_scalar(self._scalars[i], spec.name, entry[spec.name])
                else:
                    self._views[i][spec.name].copy_(entry[spec.name])
        self._runtime.order_writes()  # resident states written on this stream
        self._refresh_state(self._params())

    def _start_state(self, index: int, param: torch.Tensor) -> dict:
        """Copies, on the param's device, of the state param `index` has now
        (none before its first update, unless the optimizer made some in its
        __init__ or it was loaded): what a whole update of it starts from.
        The caller has synchronized: the host store holds the last step's."""
        if not self._shown[index]:
            return {}
        return {key: (value.to(param.device, copy=True) if value.dim() > 0 else value.clone())
                if torch.is_tensor(value) else copy.deepcopy(value) for key, value in self._entry(index).items()}

    def _probe_contract(self, params: list[torch.Tensor], grads: list, candidates: list[int]) -> None:
        """What can be checked of the user's word before a trusted optimizer's
        first update, on copies of the smallest new param of each group and
        dimensionality, over two updates (a first one is often scale-free, as
        Adam's is): that they are the same beside another param in the call
        (no global norm, as LAMB's clipping; no estimate over the params, as
        Prodigy's d) and, with trust_elementwise_step, the same when the param
        is cut in two. Once per (group, dimensionality) after the optimizer was
        wrapped or loaded, whether the params have state or not; the caller's
        random number streams are left as they were. A check, not a proof
        (docs/usage.md)."""
        name = type(self.optimizer).__name__
        smallest: dict[tuple, int] = {}
        for i in candidates:
            key = (self._group_of[i], params[i].dim())
            if key not in self._probed and (key not in smallest or params[i].numel() < params[smallest[key]].numel()):
                smallest[key] = i
        # The probe's random draws leave the user's streams as they were.
        devices = sorted({params[i].device.index or 0 for i in smallest.values()
                          if params[i].device.type == "cuda"})
        if any(self._shown[i] for i in smallest.values()):
            self._synchronize()  # the host store holds the last step's copies (_start_state reads them)
        with torch.random.fork_rng(devices=devices):
            for key, i in smallest.items():
                value, grad = params[i].detach(), grads[i]
                start = self._start_state(i, params[i])
                # A second grad that is no multiple of the first.
                grads_by_step = [grad, grad.reshape(-1).roll(1).reshape(grad.shape) * 2]
                alone, = self._probe_updates(key[0], [value], [[g] for g in grads_by_step], [start])
                layout = _learn_layout(i, params[i], alone[1], name, check_device=True)  # refuses the unstreamable
                # The companion comes first: an update that depends on what came
                # before it in the call (a running norm, a value carried from one
                # param to the next) shows too.
                _, beside = self._probe_updates(key[0], [value * 3 + 1, value],
                                                [[g * 1000 + 1, g] for g in grads_by_step], [start, start])
                if not (torch.equal(alone[0], beside[0]) and _same_state(alone[1], beside[1])):
                    raise RuntimeError(
                        f"SwapOptimizer: {name}'s update of param {i} changes when another param is in the same call: "
                        "its step combines params (a global norm, as LAMB's clipping, an estimate over all params, "
                        "as Prodigy's d, a value carried from one param to the next, or random numbers drawn in "
                        "turn), so it cannot run batch by batch, whatever trust_per_param_step says. Keep this "
                        "optimizer's state on the device (or turn off what combines the params, such as a "
                        "max_grad_norm of the optimizer's own)")
                if self.declaration.elementwise and value.numel() >= 2 and value.is_contiguous() \
                        and all(s.kind == ELEMENT for s in layout if s.kind != SCALAR):
                    self._probe_cut(key[0], i, value, grads_by_step, alone, start)
                self._probed.add(key)

    def _probe_cut(self, g: int, index: int, value: torch.Tensor, grads_by_step: list, alone: tuple,
                   start: dict) -> None:
        """trust_elementwise_step's check: the updates of `value` cut in two
        halves, as two params of one call, are its updates whole (`alone`),
        each half starting from its half of the param's state `start`."""
        half = value.numel() // 2
        flat = value.reshape(-1)

        def halves_of(state: dict) -> list[dict]:
            cut = [{}, {}]
            for key, item in state.items():
                whole = torch.is_tensor(item) and item.shape == value.shape and item.dim() > 0
                cut[0][key] = item.reshape(-1)[:half] if whole else item
                cut[1][key] = item.reshape(-1)[half:] if whole else item
            return cut

        try:
            (first_value, first_state), (second_value, second_state) = self._probe_updates(
                g, [flat[:half], flat[half:]], [[grad.reshape(-1)[:half], grad.reshape(-1)[half:]]
                                                for grad in grads_by_step], halves_of(start))
            arrays = [k for k, v in second_state.items() if torch.is_tensor(v) and v.dim() > 0]
            joined = dict(second_state, **{k: torch.cat([first_state[k].reshape(-1), second_state[k].reshape(-1)])
                                          for k in arrays})
            cut_alike = torch.equal(torch.cat([first_value, second_value]), alone[0].reshape(-1)) \
                and _same_state({k: v for k, v in first_state.items() if k not in arrays},
                                {k: v for k, v in second_state.items() if k not in arrays}) \
                and _same_state(joined, alone[1], flatten=True)
            failure = ""
        except Exception as error:  # noqa: BLE001  (a piece the update cannot take: the answer is no)
            cut_alike, failure = False, f" ({type(error).__name__}: {error})"
        if not cut_alike:
            name = type(self.optimizer).__name__
            raise RuntimeError(
                f"SwapOptimizer: trust_elementwise_step=True, but {name}'s update of param {index} cut in two "
                f"differs from its update whole{failure}: it reads the whole param (a per-param norm, as LAMB's "
                "trust ratio, or a matrix operation, as Muon's). Drop trust_elementwise_step; its params then move "
                "whole")

    def _probe_updates(self, g: int, values: list[torch.Tensor], grads_by_step: list[list[torch.Tensor]],
                       starts: list[dict]) -> list:
        """The trusted optimizer's updates of copies of `values`, params of one
        call with group `g`'s settings, each starting from a copy of its state
        in `starts` (empty before a first update), one update per entry of
        grads_by_step (their grads): each copy after them, and its state."""
        pieces = [value.clone() for value in values]
        state = {piece: _copied(start) for piece, start in zip(pieces, starts)}
        group, _ = self._call_group(g, pieces)  # what one update writes, the next reads
        for number, step_grads in enumerate(grads_by_step):
            for piece, grad in zip(pieces, step_grads):
                piece.grad = grad.clone()
            run_torch_update(self.optimizer, [group], state, strict=True)
            keys = [sorted(state[piece]) for piece in pieces]
            if number == 0:
                first_keys = keys
            elif keys != first_keys:
                raise RuntimeError(f"SwapOptimizer: {type(self.optimizer).__name__}'s states change after a param's "
                                   f"first update ({first_keys[0]}, then {keys[0]}); SwapOptimizer keeps the states a "
                                   "param has after its first update, as torch.optim does. This optimizer cannot be "
                                   "wrapped; keep its state on the device")
        return [(piece, state[piece]) for piece in pieces]

    def _call_group(self, g: int, params: list) -> tuple[dict, dict]:
        """A call's copy of param group `g` as it was before the step, holding
        `params`, and what it started from (key -> value)."""
        group = {key: _fresh(value) for key, value in self._step_groups[g].items()}
        start = dict(group)
        group["params"] = params
        return group, start

    def _note_groups_after(self, g: int, call_group: dict, start: dict) -> None:
        """What a call wrote into its copy of param group `g` (a value set,
        or a tensor or container changed in place): every call must write the
        same (a group step counter, as timm's Adan keeps); a value that differs
        between calls was computed over the params of the call. (A tensor
        written there is compared on the host: a wait per call.)"""
        written = {}
        for key, value in call_group.items():
            if key == "params":
                continue
            # A tensor or container the call got as a copy may have changed in
            # place: compared by value with the group's (the runtime's calls run
            # in inference mode, where a copy's version counter says nothing).
            if key not in start or value is not start[key] or (
                    (torch.is_tensor(value) or isinstance(value, (list, tuple, dict, set)))
                    and not _same_value(value, self._step_groups[g][key])):
                written[key] = value
        removed = sorted(set(start) - set(call_group))
        if removed:
            raise RuntimeError(f"SwapOptimizer: {type(self.optimizer).__name__}'s step removed {removed} from param "
                               f"group {g}; SwapOptimizer runs the step batch by batch and cannot follow that. This "
                               "optimizer cannot be wrapped; keep its state on the device")
        first = self._groups_after.setdefault(g, written)  # the first call's writes: every other must match
        for key in first.keys() | written.keys():
            unwritten = self._step_groups[g].get(key, "(no value)")  # what a call that did not write it leaves
            a, b = first.get(key, unwritten), written.get(key, unwritten)
            if a is not b and not _same_value(a, b):
                raise RuntimeError(
                    f"SwapOptimizer: {type(self.optimizer).__name__}'s step wrote param group {g}'s '{key}' as "
                    f"{a!r} in one call and {b!r} in another: the value is computed over the params of the call "
                    "(as Prodigy's d is), so the step combines params and cannot run batch by batch. This "
                    "optimizer cannot be wrapped; keep its state on the device")

    def _sync_edits(self, params: list[torch.Tensor]) -> None:
        """Loads into the store what was written into `state` since the last
        step: an entry replaced or removed (torch starts a removed one anew)."""
        state = self.__dict__["_state"]
        changed = []
        for i, p in enumerate(params):
            entry = state.get(p)
            if not entry and not self._shown[i]:
                continue
            ours = self._entry(i) if self._shown[i] else {}
            if entry is not None and len(entry) == len(ours) and all(entry.get(k) is v for k, v in ours.items()):
                continue
            changed.append(i)
        if not changed:
            return
        self._synchronize()
        self._lay_out({p: _copied(state[p]) for p in params if state.get(p)})

    # ----------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:  # noqa: D102  (torch.optim API)
        """The wrapped optimizer's own format: swapped states are the host
        tensors themselves, scalars as torch keeps them."""
        self = self._itself
        self._synchronize()
        return torch.optim.Optimizer.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102  (torch.optim API)
        """As torch.optim's (torch's own load casts the values, so a resume is
        that of the plain optimizer), then into the store."""
        self = self._itself
        self._refuse_inside_step("load_state_dict")
        inner = self.optimizer
        self._synchronize()
        saved_state, saved_groups = inner.state, inner.param_groups
        try:
            torch.optim.Optimizer.load_state_dict(inner, state_dict)  # torch's checks and casts; new groups
            loaded = {p: dict(entry) for p, entry in inner.state.items() if entry}
            inner.state = saved_state
            _check_groups(inner, self.declaration)
            self._lay_out(loaded)  # a new store (no torn params), or an error before anything is replaced
            self._probed.clear()  # new settings: a vouched-for optimizer's contract is checked again
            self._not_updated = {id(p) for p in loaded} if self._learning else set()
            self._stateless.difference_update(id(p) for p in loaded)  # a loaded state is learned again
        except BaseException:
            inner.state, inner.param_groups = saved_state, saved_groups
            raise

    def add_param_group(self, param_group: dict) -> None:  # noqa: D102  (torch.optim API)
        if self.__dict__.get("_runtime") is None:  # called by Optimizer.__init__
            return torch.optim.Optimizer.add_param_group(self, param_group)
        self = self._itself
        self._refuse_inside_step("add_param_group")
        previous = self._kept_state()
        self.optimizer.add_param_group(param_group)  # validates, and makes eager states (Adagrad's sum)
        state = self.__dict__["_state"]  # the wrapped optimizer's too: its eager states land here
        added = self.param_groups[-1]["params"]
        previous.update({p: dict(state[p]) for p in added if state.get(p)})
        try:
            _check_groups(self.optimizer, self.declaration)
            _check_params(self._params(), self._device)
            _check_distinct(self._params())
            _check_dtensor_params(self._params(), self.declaration, type(self.optimizer).__name__)
            self._lay_out(previous)
            if self._learning:
                self._not_updated |= {id(p) for p in added if state.get(p)}
        except BaseException:
            self.param_groups.pop()
            for p in added:
                state.pop(p, None)
            raise

    def memory_stats(self) -> dict[str, Any]:
        """As SwapOptimizer's, and the state keys that go to host memory;
        host_state_bytes 0 means nothing is swapped (an optimizer that keeps no
        state for its params, such as SGD without momentum). Also
        update_temporary_bytes: an estimate of what torch's update allocates
        on the device beyond the staged states, for the largest batch; and
        largest_whole_param_state_bytes: the swapped states of the largest
        param the rule never cuts (Muon, Adafactor, a whole state), which
        every arena holds at least."""
        itself = self._itself
        stats = budget_stats(itself._runtime.memory_stats(), itself._planning, itself._auto)
        stats["swapped_state_keys"] = [k for k, swapped in zip(itself._keys, itself._swap_keys) if swapped]
        stats["update_temporary_bytes"] = itself._update_temporaries()
        params = itself._params()
        stats["largest_whole_param_state_bytes"] = max(
            (sum(unit * _local(params[i]).numel() if kind == "element" else unit
                 for (_, kind, unit, _, _), swapped in zip(rows, itself._swap_keys) if swapped)
             for i, rows in enumerate(itself._state_rows) if itself._moves_whole[i]), default=0)
        return stats

    def _bookkeeping(self) -> dict:
        return dict(shown=list(self._shown), scalars=self._scalars)

    def _restore_bookkeeping(self, kept: dict) -> None:
        self._shown, self._scalars = kept["shown"], kept["scalars"]
        self._refresh_state(self._params())

    def _release_store(self) -> None:
        super()._release_store()
        self._shown_views = None

    def _lay_out_empty(self) -> None:
        self._lay_out({}, learned=self._learned if self._learning else None)

    def _update_temporaries(self) -> int:
        """An estimate of the device memory torch's update allocates beyond the
        staged states, for the largest batch: per call (one per group, run one
        after another) foreach intermediates, Newton-Schulz products, ...
        (rules.Declaration.temporaries). It comes on top of staging_bytes."""
        return self._temporaries_of(self._plan, self._state_rows)

    def _temporaries_of(self, plan: list[dict], states: list) -> int:
        """The largest call's estimate over `plan`, whose params keep the
        states `states` (per param, the store's (key, kind, unit bytes, dtype,
        shape) rows), counting their creation at a first step."""
        params = self._params()
        group_of = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        largest = 0
        for batch in plan:
            rows_by_group: dict[int, list] = {}
            new_state_bytes: dict[int, int] = {}
            for index, offset, count in batch["pieces"]:
                local = _local(params[index])
                whole = count == local.numel()
                g = group_of[index]
                rows_by_group.setdefault(g, []).append((tuple(local.shape) if whole else (count,),
                                                        local.element_size()))
                new_state_bytes[g] = new_state_bytes.get(g, 0) + sum(
                    unit * count if kind == "element" else unit if whole else 0
                    for _, kind, unit, _, _ in states[index])
            for g, rows in rows_by_group.items():
                largest = max(largest, estimated_temporaries(self.declaration, rows, self.param_groups[g],
                                                             _local(params[0]).device, new_state_bytes[g]))
        return largest
