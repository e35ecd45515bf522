"""The rule that runs torch's own update of the wrapped class on each batch's
staged views: every optimizer swap_optimizer.rules.declarations declares
(Adam/AdamW with default states included). Each row of a batch (a param, or a
piece of a cut one) becomes a param of its group with the staged views as its
state, so the results are the wrapped optimizer's, bit for bit."""

from __future__ import annotations

import copy
import math
import operator
import warnings
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any, NamedTuple, Optional

import torch

from .. import _C
from ..budget import Planning, copy_bytes
from ..codec import STATE_CODE_FORMS
from ..compact import FORMAT_KEY, ROUNDING_STEP, dequantize, dequantize_state_dict, named_map, state_format
from ..config import SwapOptimizerConfig
from ..distributed import (_check_fsdp_8bit, _global_offset, _is_dtensor, _like_param, _local, _local_part,
                           _shared_default_seed)
from ..params import check_distinct, check_overlap_params, check_params, param_versions, written_since
from ..state_dicts import check_readable, check_state_entry
from ..step_guards import signals_after_the_step
from .compact_states import (ABSMAX, BF16, CODES, COMPENSATION, EIGHT_BIT, BatchCodec, ScratchPool, blocks,
                             compact_of, compacts, encode_exact, form_for, kahan_applies, kahan_round, kahan_stand_in,
                             scratch_bytes_per_element, store_keys, update_dtype, warn_if_no_16_bit)
from .declarations import (DECLARATIONS, ELEMENT, SCALAR, WHOLE, Declaration, estimated_temporaries)
from .functional import FunctionalUpdate, NotReady, class_step, functional_update_for



def _torch_step(optimizer: torch.optim.Optimizer):
    """The class's own step, without the per-instance and global step hooks
    that torch wraps it in (those run once per SwapOptimizer.step())."""
    return class_step(type(optimizer))


def _fingerprint(value, held: Optional[list] = None) -> bytes:
    """What shows an in-place change of an attribute: a tensor's version, a
    container's members (by identity, tensors by version). In C++: a
    vouched-for step's strict check takes these for the optimizer's
    attributes around every call (_C.fingerprints). held: a list that gets
    every object named by identity; kept until the comparison, it keeps
    another object from taking one's address (with the same version)."""
    return _C.fingerprint(value, held)


class _GroupsAtStep(NamedTuple):
    """Per param group, the fingerprints of its values at step() (params
    left out), and the objects they name, held until they are compared."""
    shown: list[dict]
    held: list


def _groups_at_step(param_groups: list[dict]) -> _GroupsAtStep:
    held: list = []
    return _GroupsAtStep([{k: _fingerprint(v, held) for k, v in group.items() if k != "params"}
                          for group in param_groups], held)


# An optimizer's hook registries (register_step_pre_hook and the like): other
# code adds and removes hooks on other threads while a deferred step runs
# (SwapOptimizer itself takes its guard off when it is dropped), and no step
# keeps its state there, so the strict check of a step leaves them out.
_HOOK_REGISTRIES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                    "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks")
_NOT_CHECKED = ("param_groups", "state", *_HOOK_REGISTRIES)


def foreign_state_keys(state: dict, param_ids: set) -> list[str]:
    """The keys of an optimizer's `state` that are not among its params."""
    return sorted(f"a tensor of shape {tuple(key.shape)}" if torch.is_tensor(key) else repr(key)
                  for key in state if not torch.is_tensor(key) or id(key) not in param_ids)


_DEVICE_ERRORS = tuple(error for error in (getattr(torch, "AcceleratorError", None),) if error is not None)


def run_torch_update(optimizer: torch.optim.Optimizer, groups: list[dict], state: dict,
                     strict: bool = False, grad_scale: Optional[dict] = None) -> None:
    """torch's own step of `optimizer`'s class over `groups` (param groups
    holding the batch's params or pieces, with .grad set) and `state` (their
    staged states): on a shallow copy of the optimizer, so the wrapped one's
    groups and state stay as they are. grad_scale: GradScaler's grad_scale
    and found_inf, which torch's fused step reads from the optimizer. strict:
    an attribute the step sets on the optimizer (lost with the copy) raises,
    naming it."""
    stand_in = object.__new__(type(optimizer))
    stand_in.__dict__.update(optimizer.__dict__, param_groups=groups, state=state, **(grad_scale or {}))
    held: list = []  # (what `before` names, kept until `after` is compared with it)
    before = _C.fingerprints(optimizer.__dict__, _NOT_CHECKED, held) if strict else None
    try:
        _torch_step(optimizer)(stand_in)
    except Exception as error:
        # torch's own optimizers' errors are theirs to word; so are a lack of
        # memory and a device's failure, whoever's step met them.
        if not strict or isinstance(error, (torch.OutOfMemoryError, *_DEVICE_ERRORS)):
            raise
        raise RuntimeError(
            f"SwapOptimizer: {type(optimizer).__name__}'s own step raised {type(error).__name__}: {error}, where "
            "SwapOptimizer ran it on a part of the params (one param, or one batch) with the states it has kept for "
            "them. An optimizer whose step needs more than its params' own states and its param groups (a value "
            "set outside step(), a state under another key, the other params) cannot be wrapped, whatever "
            "trust_per_param_step says: keep its state on the device") from error
    if strict:
        after = _C.fingerprints(optimizer.__dict__, _NOT_CHECKED)
        changed = sorted(key for key, value in after.items() if value != before.get(key)) if after != before else ()
        if changed:
            raise RuntimeError(f"SwapOptimizer: {type(optimizer).__name__}'s step changed the optimizer's "
                               f"attribute(s) {changed} in place, outside its params' states and param groups; "
                               "SwapOptimizer runs the step batch by batch and cannot keep such a value. This "
                               "optimizer cannot be wrapped; keep its state on the device (the attribute has "
                               "been changed)")
        params = set(map(id, chain.from_iterable(group["params"] for group in groups)))
        if not params.issuperset(map(id, state)):  # (the keys named only then: a walk per key)
            foreign = foreign_state_keys(state, params)
            raise RuntimeError(f"SwapOptimizer: {type(optimizer).__name__}'s step keeps state under {foreign}, keys "
                               "that are not params (a step counter shared by all params, say); SwapOptimizer runs "
                               "the step batch by batch and cannot keep such a value. This optimizer cannot be "
                               "wrapped; keep its state on the device")
        written = sorted(key for key, value in stand_in.__dict__.items() if key not in _NOT_CHECKED
                         and (key not in optimizer.__dict__ or optimizer.__dict__[key] is not value))
        if written:
            raise RuntimeError(f"SwapOptimizer: {type(optimizer).__name__}'s step wrote the optimizer's attribute(s) "
                               f"{written}, outside its params' states and param groups; SwapOptimizer runs the "
                               "step batch by batch and cannot keep such a value. This optimizer cannot be wrapped; "
                               "keep its state on the device")


def _refuse_settings(config: SwapOptimizerConfig, name: str, declaration: Declaration, learning: bool) -> None:
    compact = config.state_dtype in (torch.bfloat16, torch.uint8)
    for setting, on in ((f"state_dtype={config.state_dtype}", compact),
                        ("kahan_summation=True", config.kahan_summation)):
        if on and learning and not declaration.elementwise:
            raise ValueError(f"SwapOptimizer: {setting} with an optimizer wrapped on your word ({name}) needs "
                             "trust_elementwise_step=True too: its states are stored and its update run piece by "
                             "piece as an elementwise optimizer's. If its update is elementwise, set it; else "
                             "leave the setting off")
        if on and not declaration.elementwise:
            raise ValueError(f"SwapOptimizer: {setting} works with elementwise optimizers (Adam, SGD, RMSprop, "
                             f"...), not with {name}: its update reads each param whole (Adafactor's factored "
                             "rows and columns, Muon's momentum under Newton-Schulz): its states are not worth "
                             "quantizing and it does not run exactly on a float32 stand-in piece by piece; leave "
                             "it off")
    if compact and learning and config.trusted_state_kinds is None:
        raise ValueError(f"SwapOptimizer: state_dtype={config.state_dtype} with an optimizer wrapped on your word "
                         f"({name}) needs trusted_state_kinds: its states are learned at the first update, so "
                         "their role (a momentum, a denominator, a running maximum), which picks their 8-bit map "
                         "and rounding, is unknown, and a wrong one would go wrong silently. Name each "
                         "param-shaped state's kind, e.g. trusted_state_kinds={'exp_avg': 'signed'} (docs/usage.md, "
                         "'Compact states'), or leave state_dtype at None")
    adam_only = [field for field, off in (("state_dtype", config.state_dtype is None or compact),
                                          ("master_weights", not config.master_weights)) if not off]
    if adam_only:
        raise ValueError(f"SwapOptimizer: {', '.join(adam_only)} work(s) with Adam/AdamW only for now, not with "
                         f"{name}; leave them at their defaults (GradScaler still works through its unscale_)"
                         + ("; state_dtype=torch.bfloat16 and torch.uint8 work with every elementwise optimizer"
                            if config.state_dtype == torch.float32 else "")
                         + ("; kahan_summation=True keeps what rounding 16-bit params loses with every "
                            "elementwise optimizer" if config.master_weights else ""))


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
    if not declaration.elementwise:
        raise ValueError(f"SwapOptimizer: {name} with DTensor params (FSDP2): SwapOptimizer updates each rank's "
                         f"local shard, but {name}'s update needs the whole param (torch's own {name} gathers it "
                         "through DTensor's collectives). Keep this optimizer's state on the device, or use an "
                         "elementwise optimizer (AdamW, SGD, ...) for these params")


_FUSED_TAKING_SCALE = ", ".join(cls.__name__ for d in DECLARATIONS if d.takes_grad_scale for cls in d.classes)


def _unscales_in_step(optimizer: torch.optim.Optimizer, declaration: Declaration, setting: Optional[bool]) -> bool:
    """Whether GradScaler hands step() its scale and inf flag: only torch's
    fused updates (Adam, AdamW, SGD, Adagrad) take them, in every group. None follows the wrapped
    optimizer (fused: yes), as torch's GradScaler does with the plain one."""
    fused = declaration.takes_grad_scale and all(group.get("fused") for group in optimizer.param_groups)
    if setting and not fused:
        raise ValueError(f"SwapOptimizer: unscale_in_step=True, but {type(optimizer).__name__}'s update takes "
                         f"GradScaler's scale and inf flag only in torch's fused {_FUSED_TAKING_SCALE}, with "
                         "fused=True in every param group; use fused=True there, or leave unscale_in_step at None (GradScaler "
                         "then unscales through its own unscale_)")
    return fused if setting is None else setting


def _copied(entry: dict) -> dict:
    """A state entry whose tensors are copies (a new store, or a probe, starts from it)."""
    return {key: value.clone() if torch.is_tensor(value) else value for key, value in entry.items()}


def _keep_scalar(scalars: dict, name: str, new: Any) -> bool:
    """A param's scalar after an update: written into the kept tensor in place
    where it can be (torch keeps its identity), else replaced (then True)."""
    old = scalars.get(name)
    if old is new:  # the update advanced the kept tensor itself
        return False
    if torch.is_tensor(old) and torch.is_tensor(new) and old.shape == new.shape and old.dtype == new.dtype and \
            old.device == new.device:
        old.copy_(new)
        return False
    scalars[name] = new
    return True


def _signature(params: list) -> Any:
    """The params' dtypes and shapes, in a form equal while none changed
    (bytes from C++; tuples where C++ cannot read one: not a tensor, or
    nested or symbolic sizes)."""
    signature = _C.tensor_signature(params)
    return signature if signature is not None else tuple((p.dtype, p.shape) for p in params)


class _SettingsKey:
    """What the store's layout is made from (each group's params, with their
    dtypes and shapes, and its settings), in a form that shows any change:
    values of plain types by value, containers by their members, a tensor by
    identity, version and what it holds (an inference tensor, which keeps no
    version, never compares equal), any other object by identity. It holds
    the objects it names, so an identity cannot be reused while it is kept."""

    __slots__ = ("_tokens", "_held")

    def __init__(self, param_groups: list[dict]) -> None:
        self._held: list = []
        self._tokens = tuple((tuple(map(id, group["params"])), _signature(group["params"]),
                              tuple((key, self._token(value)) for key, value in group.items() if key != "params"))
                             for group in param_groups)
        for group in param_groups:
            self._held.extend(group["params"])

    _PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)

    def _token(self, value: Any) -> Any:
        if type(value) in self._PLAIN:
            return (type(value), value)
        if torch.is_tensor(value):
            if value.is_inference():  # no version counter: never taken as unchanged
                return ("inference tensor", object())
            self._held.append(value)
            # (.data = ... changes what it holds without a version bump)
            return ("tensor", id(value), value._version, value.data_ptr(), value.dtype, value.shape, value.device)
        if type(value) in (list, tuple):
            return (type(value), tuple(self._token(item) for item in value))
        if type(value) is dict:
            return ("dict", tuple((key, self._token(item)) for key, item in value.items()))
        self._held.append(value)
        return ("object", id(value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SettingsKey) and self._tokens == other._tokens


class _Kept(NamedTuple):
    """A state a param keeps: its name, kind, shape (whole states; element
    states of a learned layout), dtype (None: the param's), and for an
    element state under compact states its form (compact_states.BF16 or
    EIGHT_BIT; None: exact) and its compact kind (StateSpec.code)."""
    name: str
    kind: str
    shape: Optional[tuple[int, ...]]
    dtype: Optional[torch.dtype] = None
    form: Optional[str] = None
    code: Optional[str] = None


def _store_keys(kept: _Kept, param_dtype: torch.dtype) -> list[tuple[str, str, torch.dtype]]:
    """(store key, kind, dtype) of a kept state that the store holds (none for a scalar)."""
    if kept.kind == SCALAR:
        return []
    if kept.kind == WHOLE:
        return [(kept.name, "whole", kept.dtype or param_dtype)]
    return store_keys(kept.name, kept.form, param_dtype, kept.dtype)


class StoreRows(NamedTuple):
    """The store of some params under their layouts, as the runtime takes it
    (_C.SwapRuntime's rule constructor, _C.summarize_rule_staging): `keys`, the
    store keys in arena offset order; `rows`, per param, one (key, kind, unit
    bytes, dtype, shape) row per key (kind "absent" where the param keeps no
    such state); `scratch`, per param, the device bytes an element's compact
    scratch (and Kahan's float32 stand-in) takes during its update
    (UpdateTemporaries); `block_keys`, the keys of 8-bit scales."""
    keys: list[str]
    rows: list[list[tuple]]
    scratch: list[int]
    block_keys: frozenset


def store_rows(params: list, layouts: list) -> StoreRows:
    """The store of `params` (local tensors, a DTensor's shard; meta ones
    too) keeping `layouts` (per param, its _Kept states, as
    TorchUpdateRule.layouts_for gives them): what _lay_out builds the
    runtime from and the planner lays out, made here once."""
    keys: list[str] = []
    block_keys: set[str] = set()
    for p, specs in zip(params, layouts):
        for spec in specs:
            for key, kind, _ in _store_keys(spec, p.dtype):
                if key not in keys:
                    keys.append(key)
                if kind == "block":
                    block_keys.add(key)
    rows, scratch = [], []
    for p, specs in zip(params, layouts):
        by_key = {key: (spec, kind, dtype) for spec in specs for key, kind, dtype in _store_keys(spec, p.dtype)}
        row = []
        for key in keys:
            spec, kind, dtype = by_key.get(key, (None, "absent", p.dtype))
            if spec is None:
                row.append((key, "absent", 0, p.dtype, []))
            elif kind == "element":
                row.append((key, "element", dtype.itemsize, dtype, list(p.shape)))
            elif kind == "block":  # one float32 scale per started block of 256 elements
                row.append((key, "block", dtype.itemsize, dtype, [blocks(p.numel())]))
            else:
                row.append((key, "whole", math.prod(spec.shape) * dtype.itemsize, dtype, list(spec.shape)))
        rows.append(row)
        kahan = any(s.name == COMPENSATION for s in specs)
        scratch.append(scratch_bytes_per_element([s.form for s in specs], torch.float32 if kahan else p.dtype, kahan))
    return StoreRows(keys, rows, scratch, frozenset(block_keys))


def _state_name(key: str) -> str:
    """The state a store key holds (an 8-bit state's codes and scales: the state's name)."""
    for suffix in (CODES, ABSMAX):
        if key.endswith(suffix):
            return key[:-len(suffix)]
    return key


def row_bytes(kind: str, unit: int, count: int, whole: bool) -> int:
    """Bytes of `count` elements of a store row (whole rows: only with the whole param)."""
    if kind == "element":
        return unit * count
    if kind == "block":
        return unit * blocks(count)
    return unit if kind == "whole" and whole else 0


_ATOMS = (int, float, complex, bool, str, bytes, type(None))


def _immutable(value: Any) -> bool:
    """Whether no in-place write can change `value`: a number, a string,
    None, or a plain tuple or frozenset of those (say, Adam's betas)."""
    return type(value) in _ATOMS or (type(value) in (tuple, frozenset) and all(type(item) in _ATOMS
                                                                               for item in value))


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
    if _immutable(value):  # (shared, as a copy of it would be equal forever)
        return value
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


class _Unedited(NamedTuple):
    """What _sync_edits last found unedited: the params, their shown flags
    and marks, and `state` as it was then (its keys, its entries, each
    entry's length, keys and values), each by identity and held. While all
    of it is the same, the per-param check would find what it found then;
    comparing them takes no lookup by param (a tensor key's hash is a call
    into Python), so an unedited step pays tens of nanoseconds a param."""
    shown: tuple
    params: list
    marks: list
    keys: list
    entries: list
    lengths: list
    entry_keys: list
    values: list


def _same_objects(a: list, b: list) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _unedited_now(state: dict, params: list, shown: list, marks: list) -> Optional[_Unedited]:
    entries = list(state.values())
    if not all(isinstance(entry, dict) for entry in entries):  # (a mapping of the user's: checked param by param)
        return None
    return _Unedited(tuple(shown), list(params), list(marks), list(state), entries, list(map(len, entries)),
                     list(chain.from_iterable(entries)), list(chain.from_iterable(map(dict.values, entries))))


def _still_unedited(last: Optional[_Unedited], state: dict, params: list, shown: list, marks: list) -> bool:
    if last is None or last.shown != tuple(shown) or not _same_objects(last.params, params) or \
            not _same_objects(last.marks, marks) or not _same_objects(last.keys, list(state)):
        return False
    entries = list(state.values())
    return _same_objects(last.entries, entries) and last.lengths == list(map(len, entries)) and \
        _same_objects(last.entry_keys, list(chain.from_iterable(entries))) and \
        _same_objects(last.values, list(chain.from_iterable(map(dict.values, entries))))


class _RowPlan(NamedTuple):
    """What a batch's update does with a param's row, worked out once per
    layout from its kept states (_Kept), so that a step's per-row Python is
    a few lookups: on a GPU the update of a batch takes microseconds, and
    the host's work around it bounds the step."""
    numel: int                     # the param's elements (a DTensor's: this rank's)
    kahan: bool                    # updated on a float32 stand-in, with a compensation
    scalars_in: tuple              # scalar names handed to torch's step (its rounding count is ours)
    exact: tuple                   # exact states: their arena views are the states torch's step reads
    coded: tuple                   # compact states (_Kept), decoded into scratch for the step
    stored: tuple                  # the states written back, in layout order (_Kept; no compensation)
    kept: frozenset                # the names torch's step must leave in the entry
    scalars_out: tuple             # the scalars kept after the step (rounding count included)
    has_rounding_step: bool        # the layout keeps its own rounding count (ROUNDING_STEP)


def _row_plan(specs: tuple, numel: int) -> _RowPlan:
    scalars = tuple(spec.name for spec in specs if spec.kind == SCALAR)
    stored = tuple(spec for spec in specs if spec.kind != SCALAR and spec.name != COMPENSATION)
    return _RowPlan(
        numel=numel, kahan=any(spec.name == COMPENSATION for spec in specs),
        scalars_in=tuple(name for name in scalars if name != ROUNDING_STEP),
        exact=tuple(spec.name for spec in stored if spec.form is None),
        coded=tuple(spec for spec in stored if spec.form is not None),
        stored=stored, kept=frozenset(spec.name for spec in specs if spec.name not in (ROUNDING_STEP, COMPENSATION)),
        scalars_out=scalars, has_rounding_step=ROUNDING_STEP in scalars)


class _LeanBatch(NamedTuple):
    """A batch that _lean_batch_update may run (its rows in one group, none
    with compact states or Kahan, a split param's pieces with no scalars),
    per row: what its step reads and must leave, worked out once per layout."""
    group: int                     # the rows' group
    pieces: list                   # per row: None (a whole param), or its piece's (offset, count)
    kept: list                     # per row: its plan's kept names
    exact: list                    # per row: its plan's exact names
    scalars_in: list               # per row: whether torch's step reads kept scalars
    with_scalars_out: list         # the rows that keep scalars after the step


def _lean_batch(pieces: list, plans: list[_RowPlan], group: Optional[int]) -> Optional[_LeanBatch]:
    """A batch's _LeanBatch over its `pieces` (the runtime's (param, offset,
    count) rows) of param group `group`, or None where they span groups
    (group None), a row's states are compact or under Kahan, or a piece of a
    split param keeps scalars."""
    rows = [index for index, _, _ in pieces]
    if group is None:
        return None
    for index, _, count in pieces:
        plan = plans[index]
        if plan.kahan or plan.coded or plan.has_rounding_step or (
                count != plan.numel and (plan.scalars_in or plan.scalars_out)):
            return None
    return _LeanBatch(group=group,
                      pieces=[None if count == plans[i].numel else (offset, count) for i, offset, count in pieces],
                      kept=[plans[i].kept for i in rows], exact=[plans[i].exact for i in rows],
                      scalars_in=[bool(plans[i].scalars_in) for i in rows],
                      with_scalars_out=[row for row, i in enumerate(rows) if plans[i].scalars_out])


@dataclass
class _StepContext:
    """Everything a step's batch updates read, captured at step(): the runtime
    holds it (through _BatchRule) until the step is done, so a deferred step
    completes with these values whatever happens meanwhile to the groups (a
    scheduler writing a tensor lr in place), GradScaler's tensors, or the
    SwapOptimizer itself (dropped before anything waited)."""

    optimizer: torch.optim.Optimizer        # the wrapped one: its class's step, its attributes
    batch_layout: list[dict]                # the runtime's, per batch
    row_plans: list[_RowPlan]               # per param: what a batch does with its rows
    # per param: its scalars now. A whole param's update advances them in place
    # (its batch's rows are torn if it fails); a split param's last piece writes them.
    scalars: list[dict]
    scalars_before: dict[int, dict]         # per split param: copies of its scalars at step(), for each piece
    had_state: list[bool]                   # per param: whether it had stepped before
    group_of: list[int]                     # per param: its group
    step_groups: list[dict]                 # per group: copies of its values at step()
    grad_scale: dict                        # GradScaler's grad_scale / found_inf, copies
    group_writes: Optional[Any] = None      # a vouched-for optimizer's: each call's group copy, what calls wrote
    rounding_seed: Optional[int] = None     # bf16 states: the stochastic rounding's seed
    global_offsets: Optional[list] = None   # bf16 states: per param, its first element's index in the whole
    scalars_replaced: set = field(default_factory=set)  # the params whose kept scalars are new objects
    # torch's functional update and, per group, its keywords from step_groups
    # (None: each batch runs the class's step(); see rules/functional.py)
    functional: Optional[FunctionalUpdate] = None
    functional_keywords: Optional[list[dict]] = None
    batch_rows: Optional[list[list[int]]] = None  # per batch: its rows' params
    # per batch: the one group of its rows where each is a whole param that has
    # stepped before or keeps nothing (None: not so)
    whole_batch_group: Optional[list[Optional[int]]] = None
    lean_batches: Optional[list[Optional[_LeanBatch]]] = None  # per batch: see _lean_batch_update


class _BatchRule:
    """The update the runtime calls for each batch. It holds the current
    step's context, never the SwapOptimizer: the optimizer holds the runtime,
    so a reference back would keep both alive."""

    def __init__(self, keep_arenas: bool = False) -> None:
        self.step: Optional[_StepContext] = None
        self.scratch_pool = ScratchPool()  # the CPU's decoded compact states
        self._keep_pool = keep_arenas  # between steps, as the arenas
        self._counted: Optional[_StepContext] = None  # the step whose batches _batches_done counts
        self._batches_done = 0

    def __call__(self, batch: int, arena: torch.Tensor, params: list[torch.Tensor],
                 grads: list[Optional[torch.Tensor]], views: list[dict]) -> None:
        step, pool, failed = self.step, None, True
        try:
            if arena.device.type == "cpu" and self.scratch_pool.lend():
                pool = self.scratch_pool
            _update_batch(step, batch, arena, params, grads, views, pool)
            failed = False
        finally:
            if self._counted is not step:
                self._counted, self._batches_done = step, 0
            self._batches_done += 1
            if pool is not None:  # the step's last batch (or a failed one) frees it
                pool.give_back(free=not self._keep_pool and
                               (failed or self._batches_done >= len(step.batch_layout)))


def _scalars_before(step: _StepContext, index: int) -> dict:
    """Param `index`'s scalars as they were at step()."""
    before = step.scalars_before.get(index)
    return step.scalars[index] if before is None else before


def _row(step: _StepContext, index: int, offset: int, count: int, param: torch.Tensor,
         grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's param and grad: param `index` whole, or its piece (only
    contiguous params are cut)."""
    if count == step.row_plans[index].numel:
        return param, grad
    return param.view(-1)[offset:offset + count], grad.reshape(-1)[offset:offset + count]


def _piece_scalars(step: _StepContext, index: int) -> dict:
    """The scalars each piece of split param `index` starts from: copies of
    the param's at step()."""
    return {name: value.clone() if torch.is_tensor(value) else value
            for name, value in _scalars_before(step, index).items()}


def _update_batch(step: _StepContext, batch: int, arena: torch.Tensor, params: list[torch.Tensor],
                  grads: list[Optional[torch.Tensor]], row_views: list[dict],
                  scratch_pool: Optional[ScratchPool] = None) -> None:
    """One batch of `step`, by torch's own step: each row (a param, or a piece
    of a cut one) becomes a param of its group with its staged views (the
    runtime's, by store key) as its state; torch's call creates or replaces
    states at a param's first step, which are then copied into the arena.
    Compact states decode into `scratch_pool`'s memory if one is lent."""
    if step.functional is not None and _functional_batch(step, batch, params, grads, row_views):
        return
    if step.lean_batches is not None and step.lean_batches[batch] is not None and \
            _lean_batch_update(step, batch, params, grads, row_views):
        return
    groups: dict[int, list[torch.Tensor]] = {}
    state: dict[torch.Tensor, dict] = {}
    rows = []
    codec: Optional[BatchCodec] = None  # the batch's compact states, if any
    for (index, offset, count), param, grad, views in zip(step.batch_layout[batch]["pieces"], params, grads,
                                                          row_views):
        if grad is None:
            continue
        plan = step.row_plans[index]
        piece, piece_grad = _row(step, index, offset, count, param.detach(), grad)
        had_state = step.had_state[index]
        # With Kahan (a 16-bit param), torch's update runs on a float32 stand-in
        # (piece + compensation) and its float32 states; kahan_round splits it back.
        if plan.kahan:
            target = kahan_stand_in(piece, piece_grad, views[COMPENSATION] if had_state else None)
        else:
            target = piece
            piece.grad = piece_grad
        if had_state:
            entry = {name: views[name] for name in plan.exact}
            if plan.scalars_in:
                # A whole param's kept scalars are advanced by torch's step itself;
                # each piece of a split param starts from a copy of those at step().
                scalars = _piece_scalars(step, index) if count != plan.numel else step.scalars[index]
                for name in plan.scalars_in:
                    entry[name] = scalars[name]
            for kept in plan.coded:  # decoded below, one call per batch
                if codec is None:
                    codec = BatchCodec(arena.device, step.rounding_seed, scratch_pool)
                entry[kept.name] = codec.scratch(kept.form, kept.code, views, kept.name, target.shape, target.dtype)
        else:
            entry = {}
        group = groups.get(step.group_of[index])
        if group is None:
            groups[step.group_of[index]] = [target]
        else:
            group.append(target)
        state[target] = entry
        rows.append((index, offset, offset + count == plan.numel, target, views, piece if plan.kahan else None))
    if not rows:
        return
    if codec is not None:
        codec.decode()
    _run_calls(step, groups, state)
    # (target: what torch's update ran on; rounded_piece: under Kahan, the piece it is rounded into)
    for index, offset, last, target, views, rounded_piece in rows:
        entry = state[target]
        plan = step.row_plans[index]
        if entry.keys() != plan.kept:
            _refuse_kept(step, index, entry)
        rounding_step = None
        compact_index = 0  # the state's place among the param's compact states (the rounding's key)
        for spec in plan.stored:
            value = entry.get(spec.name)
            if value is None:
                _refuse_states(step, index, f"kept no '{spec.name}' for param {index}, which {{source}}")
            if spec.form is None:
                if value is not views[spec.name]:  # created or replaced by torch's step: adopted into the store
                    views[spec.name].copy_(value)
                continue
            if codec is None:
                codec = BatchCodec(target.device, step.rounding_seed)
            if spec.form == BF16 and rounding_step is None:
                rounding_step = _rounding_step(step, index, entry)
            codec.write_back(spec.form, spec.code, views, spec.name, value, index, compact_index,
                             (step.global_offsets[index] if step.global_offsets else 0) + offset,
                             rounding_step or 0)
            compact_index += 1
        if rounded_piece is not None:
            kahan_round(target, rounded_piece, views[COMPENSATION])
        if last:  # the param's scalars after the step: in place, as torch keeps them (identity included)
            for name in plan.scalars_out:
                if name == ROUNDING_STEP:  # a tensor written in place, as torch's step (state shows it)
                    new = torch.tensor(_rounding_step(step, index, entry), dtype=torch.int64, device="cpu")
                else:
                    new = entry[name]
                if _keep_scalar(step.scalars[index], name, new):
                    step.scalars_replaced.add(index)
    if codec is not None:
        codec.encode()


def _run_calls(step: _StepContext, groups: dict[int, list[torch.Tensor]], state: dict) -> None:
    """torch's step over a batch's rows, one call per group (`groups`: group
    -> its rows, with .grad set; `state`: row -> its states)."""
    writes = step.group_writes
    if writes is not None:  # a vouched-for step may write its groups: each call gets copies, checked after
        calls = [writes.call_group(g, pieces) for g, pieces in sorted(groups.items())]
        run_torch_update(step.optimizer, [group for group, _ in calls], state, strict=True)
        for g, (call_group, start) in zip(sorted(groups), calls):
            writes.note(g, call_group, start)
    else:  # torch's own steps leave their groups as they are
        run_torch_update(step.optimizer, [dict(step.step_groups[g], params=pieces)
                                          for g, pieces in sorted(groups.items())], state,
                         grad_scale=step.grad_scale)


def _refuse_kept(step: _StepContext, index: int, entry: dict) -> None:
    """Raises: torch's step left param `index` with other states (`entry`)
    than its layout's. (A vouched-for param that kept nothing at its first
    update must keep nothing still; a declared optimizer's first step makes
    exactly its layout's states.)"""
    _refuse_states(step, index, f"left param {index} with states {sorted(entry)}, but {{source}} "
                   f"{sorted(step.row_plans[index].kept)}: SwapOptimizer keeps a param's states from its first "
                   "update on, as torch.optim does. This optimizer cannot be wrapped; keep its state on the device")


def _lean_batch_update(step: _StepContext, batch: int, params: list[torch.Tensor],
                       grads: list[Optional[torch.Tensor]], row_views: list[dict]) -> bool:
    """One batch of `step` by torch's own step, where _lean_batch says it
    may: the rows, their grads and states are made and checked in C++ (the
    per-row walk's Python costs about 3 µs a row). False, with nothing run,
    where a grad is missing or a param is a tensor subclass: the walk runs it.
    A row whose states are not its layout's refuses the batch before any row
    is adopted (the walk adopted the rows before it; the batch fails either
    way, its params torn)."""
    rows = step.batch_rows[batch]
    lean = step.lean_batches[batch]
    staged = _C.staged_rows(params, grads, row_views, [step.scalars[i] if scalars_in else None
                                                        for i, scalars_in in zip(rows, lean.scalars_in)],
                            lean.pieces)
    if staged is None:
        return False
    targets, state = staged
    _run_calls(step, {lean.group: targets}, state)
    differs, replaced = _C.replaced_states(targets, state, row_views, lean.kept, lean.exact)
    if differs >= 0:
        _refuse_kept(step, rows[differs], state[targets[differs]])
    for row, name in replaced:  # created or replaced by torch's step: adopted into the store
        value = state[targets[row]][name]
        if value is None:
            _refuse_states(step, rows[row], f"kept no '{name}' for param {rows[row]}, which {{source}}")
        row_views[row][name].copy_(value)
    for row in lean.with_scalars_out:  # (the param's scalars after the step, as in the walk)
        index, entry = rows[row], state[targets[row]]
        for name in step.row_plans[index].scalars_out:
            if _keep_scalar(step.scalars[index], name, entry[name]):
                step.scalars_replaced.add(index)
    return True


def _functional_batch(step: _StepContext, batch: int, params: list[torch.Tensor],
                      grads: list[Optional[torch.Tensor]], row_views: list[dict]) -> bool:
    """One batch of `step` by torch's functional update, called as the
    class's step() calls it, with the rows, their grads and their staged
    views as its lists. False, with nothing written, where a row has no
    states yet (a first step creates them) or the call would differ from
    step()'s (NotReady): the batch then runs step(). Every row's states are
    views or kept scalars updated in place, so a whole param needs nothing
    after the call; a split param's pieces start from copies of its scalars,
    the last one's kept."""
    group = step.whole_batch_group[batch] if step.whole_batch_group is not None else None
    if group is not None and all(map(operator.is_not, grads, repeat(None))):
        # The common batch (whole params of one group, all with grads and
        # states): the runtime's lists are the call's, without a per-row walk
        # (where a row lacks a state the call reads, the walk decides).
        try:
            lists = step.functional.lists_over(step.step_groups[group], row_views,
                                               [step.scalars[index] for index in step.batch_rows[batch]])
        except NotReady:
            lists = None
        if lists is not None:
            with torch.no_grad():
                step.functional(step.functional_keywords[group], params, grads, lists, step.grad_scale)
            return True
    calls: dict[int, tuple[list, list, list]] = {}  # per group: its rows, their grads, their states by name
    last_pieces = []  # (param, its scalars after the update) for each split param's last piece
    with torch.no_grad():  # (a deferred step's batches run on the runtime's thread)
        for (index, offset, count), param, grad, views in zip(step.batch_layout[batch]["pieces"], params, grads,
                                                              row_views):
            if grad is None:
                continue
            plan = step.row_plans[index]
            if plan.kept and not step.had_state[index]:  # (a row that keeps nothing, SGD's without momentum, has none)
                return False
            param, grad = _row(step, index, offset, count, param, grad)
            scalars = step.scalars[index]
            if count != plan.numel:
                scalars = _piece_scalars(step, index)
                if offset + count == plan.numel:
                    last_pieces.append((index, scalars))
            call = calls.get(step.group_of[index])
            if call is None:
                call = calls[step.group_of[index]] = ([], [], [])
            call[0].append(param)
            call[1].append(grad)
            call[2].append({**views, **scalars} if scalars else views)
        if not calls:
            return True
        try:
            ready = [(g, rows, row_grads, step.functional.lists_of(step.step_groups[g], entries))
                     for g, (rows, row_grads, entries) in sorted(calls.items())]
        except NotReady:
            return False
        for g, rows, row_grads, lists in ready:
            step.functional(step.functional_keywords[g], rows, row_grads, lists, step.grad_scale)
    for index, scalars in last_pieces:  # the param's scalars after the step, as torch keeps them
        for name, value in scalars.items():
            if _keep_scalar(step.scalars[index], name, value):
                step.scalars_replaced.add(index)
    return True


def _refuse_states(step: _StepContext, index: int, what: str) -> None:
    """Raises: torch's step left param `index` with other states than its
    layout's (`what`, whose {source} says where the layout came from)."""
    source = "it kept at its first update" if step.group_writes is not None else "its declaration says it keeps"
    raise RuntimeError(f"SwapOptimizer: {type(step.optimizer).__name__}'s step {what.format(source=source)}")


def _rounding_step(step: _StepContext, index: int, entry: dict) -> int:
    """The step that keys param `index`'s bf16 rounding in this update: the
    rule's count (ROUNDING_STEP) where its layout keeps one (SGD keeps no
    step; a vouched-for optimizer's 'step' may mean anything), else torch's
    own step count after it. Every piece of a cut param gets the same."""
    if step.row_plans[index].has_rounding_step:
        return int(_scalars_before(step, index).get(ROUNDING_STEP, 0)) + 1
    value = entry["step"]
    return int(value.item() if torch.is_tensor(value) else value)


class UpdateTemporaries:
    """An estimate of the device memory torch's update allocates beyond the
    staged states, for the largest call over a batch layout (one call per
    group, run one after another: foreach intermediates, Newton-Schulz
    products, ..., see Declaration.temporaries), whose params keep the
    states `states` (per param, the store's (key, kind, unit bytes, dtype,
    shape) rows), counting their creation at a first step, as torch's
    default path runs on `device` (the planner passes cuda for meta params),
    and (compact states) the scratch their decoded values take (`scratch`:
    per param, bytes an element; None: no compact states; with Kahan, its
    float32 stand-in param and grad too). It comes on top of staging_bytes.
    Made once per store: what each param brings is worked out here, so the
    budget search, which weighs thousands of layouts of one store, pays
    only per piece."""

    def __init__(self, declaration: Declaration, groups: list[dict], states: list, device: torch.device,
                 scratch: Optional[list] = None) -> None:
        self.declaration, self.groups, self.device = declaration, groups, device
        self._group_of = [g for g, group in enumerate(groups) for _ in group["params"]]
        # per param: its shape, numel and the element bytes torch's update runs it in
        # (with Kahan a 16-bit param's update runs in float32, its compensation beside it)
        self._params = []
        # per param: state bytes per element (scratch included), per 256-element block, and whole
        self._bytes = []
        for index, p in enumerate(p for group in groups for p in group["params"]):
            local, rows = _local(p), states[index]
            upcast = any(key == COMPENSATION and kind == "element" for key, kind, *_ in rows)
            self._params.append((tuple(local.shape), local.numel(), 4 if upcast else local.element_size()))
            self._bytes.append(((scratch[index] if scratch else 0) + sum(
                row_bytes(kind, unit, 1, False) for _, kind, unit, _, _ in rows if kind == "element"),
                sum(unit for _, kind, unit, _, _ in rows if kind == "block"),
                sum(unit for _, kind, unit, _, _ in rows if kind == "whole")))

    def __call__(self, batch_layout: list[dict]) -> int:
        largest = 0
        for batch in batch_layout:
            rows_by_group: dict[int, list] = {}
            new_state_bytes: dict[int, int] = {}
            for index, _, count in batch["pieces"]:
                shape, numel, element = self._params[index]
                per_element, per_block, whole_bytes = self._bytes[index]
                whole = count == numel
                g = self._group_of[index]
                rows_by_group.setdefault(g, []).append((shape if whole else (count,), element))
                new_state_bytes[g] = new_state_bytes.get(g, 0) + per_element * count + per_block * blocks(count) + (
                    whole_bytes if whole else 0)
            for g, rows in rows_by_group.items():
                largest = max(largest, estimated_temporaries(self.declaration, rows, self.groups[g], self.device,
                                                             new_state_bytes[g]))
        return largest


class TorchUpdateRule:
    """torch's own update of the wrapped class, run on each batch's staged
    views (see the module docstring). It keeps the store's layout for the
    declared states, the scalars torch keeps per param (step counts), and
    which params show a state; SwapOptimizer hands itself (`opt`) to each
    call, and the rule holds no reference to it."""

    learning = False  # whether the states are learned per param (VouchedForRule)

    def __init__(self, optimizer: torch.optim.Optimizer, declaration: Declaration) -> None:
        self.optimizer = optimizer
        self.declaration = declaration
        self._views: Optional[list[dict]] = None
        self._batch_rule: Optional[_BatchRule] = None
        self._pending: Optional[tuple] = None  # what a deferred step leaves for its wait (step_waited)
        self._unedited: Optional[_Unedited] = None  # what _sync_edits last found unedited
        # torch's functional update, called with each batch's lists (rules/functional.py); None: step() runs
        self._functional = None if self.learning else functional_update_for(optimizer)

    # ------------------------------------------------------- settings
    def check_wrap(self, config: SwapOptimizerConfig) -> None:
        """What this rule cannot run under `config`, refused (with the reason)
        before anything is built."""
        _refuse_settings(config, type(self.optimizer).__name__, self.declaration, self.learning)
        self._kahan = config.kahan_summation
        warn_if_no_16_bit([p for group in self.optimizer.param_groups for p in group["params"]], self._kahan)
        self._compact = compact_of(config.state_dtype)
        self._rounding_seed = None
        if self._compact is not None:  # bf16 states (under 8-bit too: BF16_UNDER_8BIT); saved in state dicts
            self._rounding_seed = config.rounding_seed if config.rounding_seed is not None else \
                _shared_default_seed()
        if self._compact is not None and not self.learning:  # (a vouched-for optimizer's kinds: its check_wrap)
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            if not any(compacts(self._compact, spec.code) for group in self.optimizer.param_groups
                       for p in group["params"]
                       for spec in self.declaration.states(p, group)) and params:
                warnings.warn(f"SwapOptimizer: state_dtype={config.state_dtype}: {type(self.optimizer).__name__} "
                              "keeps no state worth compacting under its settings (docs/usage.md, 'Compact "
                              "states'); its states stay exact", UserWarning, stacklevel=3)
        _check_groups(self.optimizer, self.declaration)

    def check_params(self, params: list) -> None:
        _check_dtensor_params(params, self.declaration, type(self.optimizer).__name__)

    def unscales_in_step(self, setting: Optional[bool]) -> bool:
        return _unscales_in_step(self.optimizer, self.declaration, setting)

    def start(self, opt, existing: dict) -> None:
        """Lays out the first store, filled from the wrapped optimizer's state."""
        self._refuse_foreign_keys(opt)
        self._lay_out(opt, existing)

    def _refuse_foreign_keys(self, opt) -> None:
        foreign = foreign_state_keys(self.optimizer.state, {id(p) for p in opt._params()})
        if foreign:
            raise ValueError(f"SwapOptimizer: {type(self.optimizer).__name__} keeps state under {foreign}, keys "
                             "that are not its params (a step counter shared by all params, say); SwapOptimizer "
                             "runs the step batch by batch and cannot keep such a value. This optimizer cannot be "
                             "wrapped; keep its state on the device")

    @property
    def views(self) -> Optional[list[dict]]:
        """Per param, its state views in the store (None while there is no store)."""
        return self._views

    def _layouts(self, opt, learned: Optional[dict] = None) -> list[tuple]:
        """Per param in group order, the states its group's current settings
        give it (_follow holds a param that has stepped to the ones it has);
        for a trusted optimizer, those learned from its state (`learned`, else
        the current ones)."""
        return self.layouts_for(opt.param_groups)

    def layouts_for(self, param_groups: list[dict], numels: Optional[list[int]] = None) -> list[tuple]:
        """Per param of `param_groups` in group order, the states (_Kept) its
        group's settings give it under the compact and Kahan settings this
        rule got from check_wrap; needs no SwapOptimizer (the planner calls it
        on meta params). `numels`: per param, the whole param's element count
        that decides 8-bit forms (default: each param's numel, a DTensor's
        global one; the planner's params are one rank's shards)."""
        layouts = []
        compact = getattr(self, "_compact", None)
        kahan = getattr(self, "_kahan", False)
        params = [p for group in param_groups for p in group["params"]]
        for p, group, numel in zip(params, (group for group in param_groups for _ in group["params"]),
                                   numels or [None] * len(params)):
            specs = self.declaration.states(p, group)
            # With Kahan a 16-bit param's update runs in float32 (update_dtype): its
            # element states are kept in float32, and its compensation beside them.
            upcast = update_dtype(p, kahan) if kahan_applies(p, kahan) else None
            kept = tuple(_Kept(spec.name, spec.kind, tuple(spec.shape(p.shape)) if spec.kind == WHOLE else None,
                               dtype=upcast if spec.kind == ELEMENT else None, form=form,
                               code=spec.code if form else None)
                         for spec in specs
                         for form in [form_for(compact, spec.code, p, upcast, numel) if spec.kind == ELEMENT
                                      else None])
            if any(k.form == BF16 for k in kept) and not any(k.name == "step" for k in kept):
                kept += (_Kept(ROUNDING_STEP, SCALAR, None),)  # the rounding's step (SGD keeps none)
            if upcast is not None:  # (SGD without momentum too: Kahan keeps what the param loses)
                kept += (_Kept(COMPENSATION, ELEMENT, None, dtype=p.dtype),)
            layouts.append(kept)
        return layouts

    def _cuts_16_bit_on_cpu(self, opt) -> list[bool]:
        """Per param in group order, whether its group's settings let a 16-bit
        param be cut on the CPU."""
        allowed = self.declaration.cuts_16_bit_on_cpu
        return [allowed is not None and allowed(group) for group in opt.param_groups for _ in group["params"]]

    def _lay_out(self, opt, previous: dict, learned: Optional[dict] = None) -> None:
        """Builds the store for the current params and their layouts, filled
        from `previous` (param -> its state as torch.optim holds it); a trusted
        optimizer's layouts are learned from `previous` unless given."""
        params = opt._params()
        if opt._overlap is not None:  # refused before anything is built: the old store stays whole
            check_overlap_params(params)
            opt._overlap.check_params(params)
        learned = self._learned_from(params, previous, learned)
        layouts = self._layouts(opt, learned)
        for i, (p, specs) in enumerate(zip(params, layouts)):
            # (8-bit blocks start at each shard's first element)
            if _is_dtensor(p) and any(spec.form == EIGHT_BIT for spec in specs):
                _check_fsdp_8bit(p, f"SwapOptimizer: param {i}")
        locals_ = [_local(p) for p in params]  # a DTensor's shard on this rank: what the store holds
        self._dtensors = any(map(_is_dtensor, params))
        keys, states, scratch, block_keys = store_rows(locals_, layouts)
        cuts_16_bit = self._cuts_16_bit_on_cpu(opt)
        swappable, splittable = [], []
        for p, specs, cut_16_bit in zip(locals_, layouts, cuts_16_bit):
            kahan = any(s.name == COMPENSATION for s in specs)
            kept = any(s.kind != SCALAR for s in specs)
            swappable.append(kept and p.numel() >= opt.config.min_numel and p.is_contiguous())
            # A 16-bit param is cut on the CPU only where its group's settings make
            # the cut proven exact (Declaration.cuts_16_bit_on_cpu), or where Kahan
            # runs its update in float32 (which the CPU cuts exactly).
            cpu_16_bit = p.device.type == "cpu" and p.element_size() < 4 and not cut_16_bit and not kahan
            splittable.append(self.declaration.elementwise and all(s.kind != WHOLE for s in specs) and not cpu_16_bit)
        # state_keys names states; an 8-bit state's codes and scales follow its name
        names = list(dict.fromkeys(_state_name(key) for key in keys))
        unknown = [k for k in (opt.config.state_keys or ()) if k not in names]
        # A trusted optimizer's names are known once every param has stepped.
        if unknown and (not self.learning or len(learned) == len(params)):
            raise ValueError(f"SwapOptimizerConfig.state_keys: {unknown} are not states of "
                             f"{type(self.optimizer).__name__} here; its states are {names}")
        swap_keys = [opt.config.state_keys is None or _state_name(key) in opt.config.state_keys for key in keys]
        # (the plan keeps lay_out, which holds this rule, never the SwapOptimizer)
        temporaries = UpdateTemporaries(self.declaration, self.optimizer.param_groups, states,
                                        locals_[0].device if locals_ else torch.device("cpu"), scratch)

        def lay_out(swappable_now: list[bool], swap_times: int, num_arenas: int) -> _C.StagingSummary:
            summary = _C.summarize_rule_staging(locals_, states, swappable_now, splittable, swap_keys,
                                                swap_times=swap_times, num_arenas=num_arenas)
            return summary.with_update_temporary_bytes(temporaries(summary.batch_layout))

        copies = copy_bytes(locals_, opt.__dict__.get("_unscale_in_step", False) or opt._overlap is not None)
        planning = Planning.make(opt.config, opt._budget_now(), lay_out, swappable, copies, opt._device,
                                 lambda: self._swap_times_for_budget(opt, locals_, states, swappable, splittable, swap_keys,
                                                                     temporaries),
                                 priority=opt._resident_priority())
        rule = _BatchRule(keep_arenas=opt.config.keep_arenas)
        runtime = _C.SwapRuntime(locals_, states, planning.swappable, splittable, rule,
                                 swap_times=planning.swap_times, num_arenas=planning.num_arenas,
                                 pin_memory=opt.config.pin_memory, keep_arenas=opt.config.keep_arenas,
                                 swap_keys=swap_keys, resident_groups=opt._resident_groups())
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
                        # (a plain state dict has no ROUNDING_STEP: 0)
                        value = entry.get(spec.name, torch.tensor(0, dtype=torch.int64, device="cpu"))
                        scalars[i][spec.name] = value.clone() if torch.is_tensor(value) else value
                    elif spec.name == COMPENSATION and spec.name not in entry:  # (a plain state dict)
                        views[i][spec.name].zero_()
                    elif spec.form is None:
                        views[i][spec.name].copy_(_local_part(entry[spec.name], p))
                    elif spec.form == EIGHT_BIT and spec.name in entry:  # torch's form: encoded
                        encode_exact(_local_part(entry[spec.name], p), spec.form, spec.code, views[i], spec.name)
                    else:  # the store's own form (bf16: any float rounds to nearest, bf16 is copied)
                        for key, kind, _ in _store_keys(spec, p.dtype):
                            value = entry[key]
                            views[i][key].copy_(value if kind == "block" else _local_part(value, p))
                shown[i] = True
        runtime.order_writes()
        if opt._overlap is not None:  # a new store: the next pass probes again
            opt._overlap.lay_out(params)
        opt._runtime = runtime
        self._batch_rule = rule
        if learned is not None:
            self._learned = learned
        self._keys = keys
        self._block_keys = block_keys
        self._swap_keys = swap_keys
        self._state_rows = states
        self._scratch = scratch  # (with _keys, _state_rows and _block_keys: the store's StoreRows, as the planner's)
        self._temporaries = temporaries
        self._global_offsets = [_global_offset(p, i) for i, p in enumerate(params)] \
            if getattr(self, "_rounding_seed", None) is not None else None
        opt._planning = planning
        self._moves_whole = [swap and not cut for swap, cut in zip(planning.swappable, splittable)]
        self._layouts_now = layouts
        self._followed: Optional[_SettingsKey] = None  # _follow checks this layout at the next step
        self._note_param_versions(params)
        self._cuts_16_bit_now = cuts_16_bit
        self._views = views
        # What `state` shows: DTensors over the store's views for DTensor params
        # (made once: _sync_edits tells edits by identity).
        self._shown_views = [{key: view if key in block_keys else _like_param(view, p) for key, view in row.items()}
                             for row, p in zip(views, params)]
        self._scalars = scalars
        self._shown = shown
        self._batch_layout = runtime.batch_layout()
        self._row_plans = [_row_plan(specs, p.numel()) for specs, p in zip(layouts, locals_)]
        # torch's functional update takes the staged views as they are: no compact state, no Kahan
        self._functional_fits = not any(plan.kahan or plan.coded for plan in self._row_plans)
        # Per batch: its rows' params, and their one group where every row is a
        # whole param of that group (else None): after a param's first step such
        # a batch hands torch's functional update the runtime's own lists. (The
        # groups hold for the layout: a change of the params or of a group's
        # size lays the store out again.)
        group_of = opt._group_of_param()
        self._batch_rows = [[index for index, _, _ in batch["pieces"]] for batch in self._batch_layout]
        one_group = [group_of[rows[0]] if rows and all(group_of[i] == group_of[rows[0]] for i in rows) else None
                     for rows in self._batch_rows]
        self._whole_batch_group = [
            group if group is not None and
            all(count == self._row_plans[index].numel for index, _, count in batch["pieces"]) else None
            for group, batch in zip(one_group, self._batch_layout)]
        self._lean_batches = [_lean_batch(batch["pieces"], self._row_plans, group)
                              for group, batch in zip(one_group, self._batch_layout)]
        self._split_params = sorted({index for batch in self._batch_layout for index, _, count in batch["pieces"]
                                     if count != self._row_plans[index].numel})
        opt._param_ids = [id(p) for p in params]
        opt._group_sizes = [len(g["params"]) for g in opt.param_groups]
        opt._data_pointers = _C.data_pointers([_local(p) for p in params])
        self._refresh_state(opt, params)

    def _swap_times_for_budget(self, opt, params: list, states: list, swappable: list, splittable: list,
                               swap_keys: list, temporaries: UpdateTemporaries) -> int:
        """The smallest swap_times whose staging plus torch's update temporaries
        (an estimate, see memory_stats) fit in staging_budget_bytes; refuses,
        naming the smallest budget that works, when none does."""
        budget, num_arenas = opt.config.staging_budget_bytes, opt.config.fixed_num_arenas

        def need(swap_times: int) -> tuple[int, int, int]:
            summary = _C.summarize_rule_staging(params, states, swappable, splittable, swap_keys,
                                                swap_times=swap_times, num_arenas=num_arenas)
            staging = summary.staging_bytes
            return staging + temporaries(summary.batch_layout), staging, summary.finest_swap_times

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
            whole = max((math.prod(_local(p).shape) for p, row, cut in zip(opt._params(), states, splittable)
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
        """An entry to load: torch's form, or (compact states) the store's own
        form for each compact state (8-bit: S_codes and S_absmax)."""
        where = f"SwapOptimizer: the state of param {index} ({type(self.optimizer).__name__})"
        expected, checked = [], []  # checked: (key, shape, dtype or None)
        for s in specs:
            if s.name in (ROUNDING_STEP, COMPENSATION) and s.name not in entry:
                continue  # optional: a plain state dict has none (a compensation then starts at 0)
            if s.form == EIGHT_BIT and s.name not in entry:
                expected += [s.name + CODES, s.name + ABSMAX]
                checked += [(s.name + CODES, tuple(param.shape), torch.uint8),
                            (s.name + ABSMAX, (blocks(_local(param).numel()),), torch.float32)]
                continue
            expected.append(s.name)
            if s.kind != SCALAR:
                checked.append((s.name, tuple(param.shape) if s.kind == ELEMENT else s.shape, None))
        missing = [k for k in expected if k not in entry]
        extra = [k for k in entry if k not in expected and k != ROUNDING_STEP]
        if missing or extra:
            raise ValueError(f"{where} has keys {sorted(entry)}, but under its group's settings it keeps "
                             f"{expected}; a state saved with other settings (momentum, centered) "
                             "loads into an optimizer created with those settings")
        for key, shape, dtype in checked:
            value = entry[key]
            if not torch.is_tensor(value) or value.layout != torch.strided or value.is_meta:
                raise ValueError(f"{where}: '{key}' must be a dense tensor, got {type(value).__name__}")
            if tuple(value.shape) != shape:
                raise ValueError(f"{where}: '{key}' has shape {tuple(value.shape)}, expected {shape}")
            if dtype is not None and value.dtype != dtype:
                raise ValueError(f"{where}: '{key}' has dtype {value.dtype}, expected {dtype}")

    def _refresh_state(self, opt, params: list[torch.Tensor]) -> None:
        """`state` as torch.optim shows it: for each param with a state, its
        views in the store and its scalars."""
        state = opt.__dict__["_state"]
        state.clear()
        self._marks = [None] * len(params)
        self._unedited = None  # (it holds the old entries, and with them the old store's views)
        for i, p in enumerate(params):
            if self._shown[i]:
                self._show(state, i, p)

    def _show(self, state: dict, index: int, param: torch.Tensor) -> None:
        """Puts param `index`'s entry into `state`, and marks what it holds
        (its keys and the identities of its values, held with them so that no
        identity is reused): _sync_edits tells an edit from the mark."""
        entry, shown = state.get(param), self._entry(index)
        if entry is not None and self._marked(index, entry):  # unedited: made again in place, as torch keeps it
            entry.clear()
            entry.update(shown)
        else:
            entry = state[param] = shown
        values = tuple(entry.values())
        self._marks[index] = (tuple(entry), tuple(map(id, values)), values)

    def _marked(self, index: int, entry: dict) -> bool:
        """Whether `entry` holds what param `index`'s was shown with (_show):
        the same keys, the very same values."""
        mark = self._marks[index]
        return mark is not None and tuple(map(id, entry.values())) == mark[1] and tuple(entry) == mark[0]

    def _entry(self, index: int) -> dict:
        """A param's state as `state` shows it: its scalars and its store's
        views (compact states in their stored form)."""
        entry = {}
        for spec in self._layouts_now[index]:
            if spec.kind == SCALAR:
                entry[spec.name] = self._scalars[index][spec.name]
            else:
                for key, _, _ in _store_keys(spec, torch.float32):
                    entry[key] = self._shown_views[index][key]
        return entry

    def _follow(self, opt) -> None:
        """Lays the store out again when the params, the states a param that
        has not stepped yet would keep (param_groups edited, a scheduler that
        turned momentum on before the first step), or whether a 16-bit param
        may be cut on the CPU (Adam's weight decay turned on) changed since. A
        param that has stepped keeps its states, as torch's; a change of
        setting that would need others is refused."""
        params = opt._params()
        followed = _SettingsKey(opt.param_groups)
        if followed == self._followed:  # nothing a layout reads has changed since it was last found current
            return
        layouts = self._layouts(opt)
        same_params = [id(p) for p in params] == opt._param_ids and \
            [len(g["params"]) for g in opt.param_groups] == opt._group_sizes
        if same_params and layouts == self._layouts_now and self._cuts_16_bit_on_cpu(opt) == self._cuts_16_bit_now:
            self._followed = followed
            return
        if same_params:
            for i, (now, then) in enumerate(zip(layouts, self._layouts_now)):
                if self._shown[i] and now != then:
                    raise ValueError(
                        f"SwapOptimizer: param {i} now would keep states {[s.name for s in now]} under its group's "
                        f"settings, but it has stepped with {[s.name for s in then]}; torch.optim keeps a param's "
                        "states from its first step too. Change such settings (momentum, centered) only before the "
                        "first step, or load a state dict saved with the new settings")
        check_params(params, opt._device)
        check_distinct(params)
        opt._refuse_if_torn("step")
        self._lay_out(opt, self._kept_state(opt))

    def _kept_state(self, opt) -> dict:
        """Copies of the state of every param in the groups (param -> entry) as
        torch.optim would step from it, edits of `state` included, to fill a
        new store from."""
        opt._synchronize()
        state = opt.__dict__["_state"]
        index_of = {pid: i for i, pid in enumerate(opt._param_ids)}
        kept = {}
        for p in opt._params():
            entry, i = state.get(p), index_of.get(id(p))
            if i is not None and self._shown[i] and entry is not None and self._marked(i, entry):
                kept[p] = _copied(self._entry(i))  # unedited: the store's (a scalar a failed step replaced)
            elif entry:  # written into `state` since the last step: torch.optim steps from it
                kept[p] = _copied(entry)
        return kept

    def _where_every_row_stepped(self, per_batch: list) -> list:
        """`per_batch` with None for each batch that holds a row whose param
        keeps states and has not stepped yet (such a row goes through the walk)."""
        if all(self._shown):
            return per_batch
        return [value if value is not None and all(self._shown[i] or not self._row_plans[i].kept for i in rows)
                else None for value, rows in zip(per_batch, self._batch_rows)]

    def step(self, opt) -> None:
        """One step of every param with a grad (after SwapOptimizer.step's
        common part: closure, waits, refusals)."""
        _check_groups(self.optimizer, self.declaration)
        amp = {name: value for name in ("grad_scale", "found_inf")
               if (value := getattr(opt, name, None)) is not None}
        not_fused = [g for g, group in enumerate(opt.param_groups) if not group.get("fused")]
        if amp and (not self.declaration.takes_grad_scale or not_fused):
            raise ValueError(f"SwapOptimizer: GradScaler handed step() its scale and inf flag (unscale_in_step), "
                             f"but param group(s) {not_fused} of {type(self.optimizer).__name__} are not fused=True "
                             f"(any more), and only torch's fused {_FUSED_TAKING_SCALE} take them: set fused=True there, or "
                             "wrap with unscale_in_step=False")
        written = self._written_params(opt)
        self._follow(opt)
        params = opt._params()
        locals_ = [_local(p) for p in params] if self._dtensors else params  # a DTensor's: this rank's shard
        data_pointers = _C.data_pointers(locals_)
        if data_pointers != opt._data_pointers:  # .data replaced since the last step
            check_distinct(params)
            opt._data_pointers = data_pointers
        grads, sparse = _C.grads_of(params)  # (per-param loops in C++: the step's host time, issue 32)
        if self._dtensors:
            grads = [None if grad is None else _local(grad) for grad in grads]
        if sparse >= 0:
            raise RuntimeError(f"SwapOptimizer: param {sparse} has a sparse gradient; {type(self.optimizer).__name__} "
                               "runs on dense grads here (torch.optim.SparseAdam is the optimizer for sparse ones)")
        self._sync_edits(opt, params)
        self._zero_written_compensation(opt, written)
        opt._settle_budget_choice()
        # What every batch call starts from: the groups as they are now, copied
        # (a deferred step runs on after step() returns, while a scheduler may
        # write a tensor lr in place).
        self._step_groups = [{k: _fresh(v) for k, v in group.items() if k != "params"} for group in opt.param_groups]
        self._group_of = [g for g, group in enumerate(opt.param_groups) for _ in group["params"]]
        writes = self._step_writes(opt)
        # A vouched-for optimizer's params without state yet are updated whole,
        # one at a time, to learn what they keep; the others go through the store.
        first = [i for i, grad in enumerate(grads) if grad is not None
                 and (not self._shown[i] or id(params[i]) in self._not_updated)
                 and id(params[i]) not in self._stateless] if self.learning else []
        # overlap_forward: the step may run beside the next forward once the
        # probe has made a plan, unless a param steps for the first time (its
        # states and scalars appear during the step) or the rule says no (a
        # vouched-for optimizer: see its _may_defer).
        deferred = opt._overlap is not None and opt._overlap.may_defer() and all(
            self._shown[i] or not self._layouts_now[i] for i, grad in enumerate(grads) if grad is not None) and \
            self._may_defer(params, grads, first)
        # (what the groups hold at step(): a deferred step's group writes land when it is waited for)
        before = _groups_at_step(opt.param_groups) if deferred and writes is not None else None
        with signals_after_the_step():  # raised once the step and its bookkeeping are done
            opt._stepping = True
            try:
                if self.learning:
                    self._probe_contract(opt, params, grads, [i for i, grad in enumerate(grads) if grad is not None])
                if first:
                    self._learn_first_updates(opt, params, grads, first)
                # The step's context, held by the runtime's rule until the step is done
                # (after the first updates: they may lay the store out again).
                self._batch_rule.step = context = _StepContext(
                    optimizer=self.optimizer, batch_layout=self._batch_layout, row_plans=self._row_plans,
                    scalars=self._scalars,
                    # the kept tensors are the last piece's to write
                    scalars_before={i: {k: v.clone() if torch.is_tensor(v) else v for k, v in self._scalars[i].items()}
                                    for i in self._split_params if self._scalars[i]},
                    had_state=list(self._shown), group_of=self._group_of, step_groups=self._step_groups,
                    grad_scale={name: _fresh(value) for name, value in amp.items()},
                    group_writes=writes, rounding_seed=getattr(self, "_rounding_seed", None),
                    global_offsets=self._global_offsets, batch_rows=self._batch_rows,
                    lean_batches=self._where_every_row_stepped(self._lean_batches),
                    whole_batch_group=self._where_every_row_stepped(self._whole_batch_group))
                # (accepts: a class patched since this rule was made runs step() from then on)
                if self._functional is not None and writes is None and self._functional_fits and \
                        self._functional.accepts(self.optimizer):
                    context.functional = self._functional
                    context.functional_keywords = [self._functional.keywords(g) for g in self._step_groups]
                streamed = [None if i in first else grad for i, grad in enumerate(grads)] if first else grads
                if opt._overlap is not None:
                    opt._overlap.before_step(deferred)
                opt._runtime.step(locals_, streamed, [], None, None, deferred=deferred)
                if opt._overlap is not None:
                    opt._overlap.after_step(deferred, opt._runtime, streamed)
                if not deferred:
                    self._groups_written(writes)
            finally:
                opt._stepping = False
                if opt._overlap is not None:
                    opt._overlap.end_enqueuing()  # its pass has begun, or step() raised
                if self.learning and not deferred:  # done: the context need not outlive it
                    self._batch_rule.step = None
            state = opt.__dict__["_state"]
            # A param's entry is made again where the step made its scalars new
            # objects (its first step, a number a step wrote, a first update);
            # otherwise it holds the store's views and the scalars, as before.
            remade = context.scalars_replaced | set(first)
            showing = remade or not all(self._shown)
            stepped = [i for i, grad in enumerate(grads) if grad is not None and self._layouts_now[i]] \
                if showing or deferred else []
            for i in stepped if showing else ():  # (SGD without momentum keeps no state, as in torch)
                if not self._shown[i] or i in remade:
                    self._shown[i] = True
                    self._show(state, i, params[i])
            if deferred:  # its group writes, and its params' entries made again, once it is done (step_waited)
                self._pending = (writes, before, [(i, params[i], state[params[i]]) for i in stepped])

    def _step_writes(self, opt) -> Optional[Any]:
        """What a step's calls start their groups from and what they write
        into them (a vouched-for optimizer's); None: torch's own steps leave
        their groups as they are."""
        return None

    def _may_defer(self, params: list, grads: list, first: list[int]) -> bool:
        """Whether this step may run beside the next forward (overlap_forward),
        beyond what every rule needs (a plan, no param stepping first)."""
        return True

    def _groups_written(self, writes: Optional[Any], before: Optional[_GroupsAtStep] = None) -> None:
        """Into the param groups: what a step's calls wrote there (a
        vouched-for optimizer's; nothing for torch's own)."""

    def step_waited(self, opt, failed: bool = False) -> None:
        """SwapOptimizer.wait() is done: `state` shows the deferred step's
        scalars (a number is a new object, written by the step's last piece
        after step() returned), and its group writes, if any, go into the
        groups (none when it failed)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        writes, before, stepped = pending
        state = opt.__dict__["_state"]
        for i, p, entry in stepped:
            # (an entry replaced or edited meanwhile is an edit, loaded at the next step)
            if state.get(p) is entry and self._marked(i, entry):
                self._show(state, i, p)
        if not failed:
            self._groups_written(writes, before)

    def _sync_edits(self, opt, params: list[torch.Tensor]) -> None:
        """Loads into the store what was written into `state` since the last
        step: an entry replaced or removed (torch starts a removed one anew)."""
        state = opt.__dict__["_state"]
        if _still_unedited(self._unedited, state, params, self._shown, self._marks):
            return
        find = state.get
        # (_marked, inlined: this runs over every param where something changed)
        for p, shown, mark in zip(params, self._shown, self._marks):
            entry = find(p)
            if not shown:
                if entry:
                    break
            elif entry is None or mark is None or tuple(map(id, entry.values())) != mark[1] or \
                    tuple(entry) != mark[0]:
                break
        else:
            self._unedited = _unedited_now(state, params, self._shown, self._marks)
            return
        self._lay_out(opt, self._kept_state(opt))

    def _note_param_versions(self, params: list) -> None:
        """Remembers the version counter of each param with a Kahan compensation."""
        self._param_versions = param_versions(params, [i for i, specs in enumerate(self._layouts_now)
                                                       if any(s.name == COMPENSATION for s in specs)])

    def _written_params(self, opt) -> list:
        """The params with a Kahan compensation written outside step() since
        the store noted them (by identity: a new layout may move them)."""
        if not self._param_versions:
            return []
        by_id = {id(p): p for p in opt._params()}
        noted = [by_id.get(pid) for pid in opt._param_ids]
        versions = {i: version for i, version in self._param_versions.items() if noted[i] is not None}
        return [noted[i] for i in written_since(noted, versions)]

    def _zero_written_compensation(self, opt, written: list) -> None:
        """The compensation of each param in `written` (written outside step()
        since the last one: in place, model.load_state_dict) is zeroed: what
        the old value lost does not belong to the new one."""
        if not written and not self._param_versions:  # no param has a compensation (the store may be new)
            return
        params = opt._params()
        index_of = {id(p): i for i, p in enumerate(params)}
        indices = [index_of[id(p)] for p in written if id(p) in index_of]
        if indices:
            opt._synchronize()  # the host store is written: the last step's copies out must have landed
            with torch.no_grad():
                for i in indices:
                    if COMPENSATION in self._views[i]:
                        self._views[i][COMPENSATION].zero_()
            opt._runtime.order_writes()
        self._note_param_versions(params)

    def _state_forms(self) -> dict[str, dict]:
        """Per compact state name: its form, and for 8-bit ones the map and
        rounding of its codes (what a state dict's FORMAT_KEY says)."""
        forms: dict[str, dict] = {}
        for specs in self._layouts_now:
            for spec in specs:
                if spec.form is not None and spec.name not in forms:
                    code_map, rounding = STATE_CODE_FORMS[spec.code] if spec.form == EIGHT_BIT else (None, "stochastic")
                    forms[spec.name] = {"form": spec.form, "kind": spec.code, "code_map": code_map,
                                        "rounding": rounding}
        return forms

    def state_dict_extras(self, opt, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's own format, scalars as torch keeps them; with
        compact states, each state in its stored form (bf16, or 8-bit S_codes
        and S_absmax) and each param group saying how (FORMAT_KEY: the forms,
        per state its map and rounding, the rounding seed; see
        swap_optimizer.compact.dequantize_state_dict). With Kahan, the same tag
        (so a SwapOptimizer without Kahan, or dequantize_state_dict, drops the
        compensation), each 16-bit param's compensation and float32 states."""
        if getattr(self, "_compact", None) is None and not getattr(self, "_kahan", False):
            return
        form = state_format(opt.config.state_dtype, getattr(self, "_rounding_seed", None))
        form.pop("code_maps", None)  # Adam's moments' maps; here per state
        form["states"] = self._state_forms()
        if self._compact == EIGHT_BIT:
            form["code_maps"] = {name: named_map(name).tolist() for name in ("signed", "unsigned")}
        for group in state_dict["param_groups"]:
            group[FORMAT_KEY] = copy.deepcopy(form)

    def _set_aside(self, opt, state_dict: dict[str, Any]) -> tuple[dict, dict]:
        """A copy of `state_dict` for torch's load without what its casts would
        spoil (8-bit codes and scales, bf16 states, the rounding's step count,
        with Kahan float32 states and scalars of 16-bit params) or what it
        does not know (FORMAT_KEY, a Kahan compensation), and those values by
        param."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("SwapOptimizer.load_state_dict: expected an optimizer state dict with 'state' and "
                             "'param_groups'")
        aside, plain, seed = {}, {}, None
        groups = []
        maps: dict = {}
        for g, group in enumerate(state_dict["param_groups"]):
            group = dict(group)
            form = group.pop(FORMAT_KEY, None)
            if isinstance(form, dict):
                for name, values in (form.get("code_maps") or {}).items():
                    if name in ("signed", "unsigned") and list(values) != named_map(name).tolist():
                        raise ValueError(f"SwapOptimizer.load_state_dict: param group {g}'s {FORMAT_KEY} has another "
                                         f"{name} code map than this version of swap_optimizer; decode the state dict "
                                         "with the version that saved it (dequantize_state_dict) and load that")
                seed = form.get("rounding_seed", seed)
                for name, spec in (form.get("states") or {}).items():
                    if isinstance(spec, dict) and spec.get("code_map"):
                        for pid in group.get("params", ()):
                            maps.setdefault(pid, {})[name] = spec["code_map"]
            groups.append(group)
        for pid, entry in state_dict["state"].items():
            check_state_entry(pid, entry)
            kept, rest = {}, {}
            for key, value in entry.items():
                # (a bf16 state is set aside in every compact or Kahan store: one kept in
                # bf16 under 8-bit too, or kept in float32 under Kahan, would lose its small
                # values to torch's cast to an fp16 param's dtype)
                if key.endswith(CODES) or key.endswith(ABSMAX) or key in (ROUNDING_STEP, COMPENSATION) or \
                        ((getattr(self, "_compact", None) is not None or getattr(self, "_kahan", False))
                         and torch.is_tensor(value) and value.dtype == torch.bfloat16 and key != "step"):
                    kept[key] = value
                else:
                    rest[key] = value
                    if getattr(self, "_kahan", False) and torch.is_tensor(value) and \
                            value.dtype == torch.float32 and key != "step":
                        kept[key] = value  # (torch's load sees it too: NAdam's checks its mu_product)
            plain[pid] = rest
            if kept:
                aside[pid] = (kept, maps.get(pid, {}))
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
            raise ValueError(f"SwapOptimizer.load_state_dict: {FORMAT_KEY} has rounding_seed {seed!r}; it must be "
                             "an int in [0, 2**63)")
        return {**state_dict, "state": plain, "param_groups": groups}, {"aside": aside, "seed": seed}

    def _put_back(self, loaded: dict, aside: dict, state_dict: dict, layouts: list, params: list) -> None:
        """The set-aside values into the loaded entries: in the store's form
        where this store keeps it, decoded or cast where it keeps another."""
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        index_of = {pid: i for i, pid in enumerate(ids)}
        for pid, (kept, maps) in aside.items():
            if pid not in index_of:
                continue
            i = index_of[pid]
            p = params[i]
            entry = loaded.setdefault(p, {})
            forms, kinds, kahan = self._load_forms(p, layouts[i], kept)
            # A param with Kahan keeps its float32 values as they are (its update runs in float32).
            dtype = torch.float32 if kahan else p.dtype
            for key, value in kept.items():
                if key == COMPENSATION:
                    if kahan:  # (dropped where this store keeps none)
                        entry[key] = value
                    continue
                name = _state_name(key)
                if key.endswith(ABSMAX) and name + CODES in kept:
                    continue  # with its codes
                # (a vouched-for optimizer's kinds may have changed since the save)
                other_map = maps.get(name) not in (None, STATE_CODE_FORMS.get(kinds.get(name), (None,))[0])
                if key.endswith(CODES) and (forms.get(name) != EIGHT_BIT or other_map) and name + ABSMAX in kept:
                    # 8-bit saved, another form or map here: decoded (by the saved map), encoded again by _lay_out
                    values = dequantize(value, kept[name + ABSMAX], name, maps.get(name))
                    entry[name] = values.to(dtype) if p.is_floating_point() else values
                elif key.endswith(CODES):
                    entry[key], entry[name + ABSMAX] = value, kept[name + ABSMAX]
                elif key == ROUNDING_STEP or forms.get(name) == BF16 or kahan:
                    entry[key] = value
                else:  # a bf16 state loaded into another form: torch's cast
                    entry[key] = value.to(p.dtype)

    def _load_forms(self, param: torch.Tensor, layout: tuple, kept: dict) -> tuple[dict, dict, bool]:
        """For a param whose loaded entry sets aside `kept`: each state's form
        and compact kind in this store, and whether the param keeps a Kahan
        compensation (its layout's, for a declared optimizer)."""
        forms = {spec.name: spec.form for spec in layout}
        return forms, {spec.name: spec.code for spec in layout}, COMPENSATION in forms

    def load_state_dict(self, opt, state_dict: dict[str, Any]) -> None:
        """As torch.optim's (torch's own load casts the values, so a resume is
        that of the plain optimizer), then into the store. Compact states load
        from their stored form (set aside from torch's casts) or from torch's
        (a plain state dict: encoded), whichever the state dict holds. Into a
        store of exact states, a compact state dict (this rule's, or the packed
        kernel's with its Kahan buffers) is decoded first, as
        dequantize_state_dict does (except with Kahan: its compensation stays,
        and the set-aside values are decoded by _put_back)."""
        if getattr(self, "_compact", None) is None and not getattr(self, "_kahan", False) and \
                isinstance(state_dict, dict) and \
                any(FORMAT_KEY in group for group in state_dict.get("param_groups", ())):
            state_dict = dequantize_state_dict(state_dict)
        plain, aside = self._set_aside(opt, state_dict)
        for saved_id, entry in state_dict["state"].items():  # before torch's load copies them
            for key, value in entry.items() if isinstance(entry, dict) else ():
                if torch.is_tensor(value):
                    check_readable(value, f"SwapOptimizer.load_state_dict: param id {saved_id}", key)
        inner = self.optimizer
        opt._synchronize()
        saved_state, saved_groups = inner.state, inner.param_groups
        try:
            torch.optim.Optimizer.load_state_dict(inner, plain)  # torch's checks and casts; new groups
            # (torch keeps a state whose id no saved group lists under that id; a store has no place for it)
            stray = [key for key in inner.state if not torch.is_tensor(key)]
            if stray:
                raise ValueError(f"SwapOptimizer.load_state_dict: state for param id(s) {stray}, which no param "
                                 "group of the state dict lists")
            loaded = {p: dict(entry) for p, entry in inner.state.items() if entry}
            inner.state = saved_state
            if aside["aside"]:
                self._put_back(loaded, aside["aside"], plain, self._layouts(opt), opt._params())
            _check_groups(inner, self.declaration)
            self._lay_out(opt, loaded)  # a new store (no torn params), or an error before anything is replaced
            if aside["seed"] is not None and getattr(self, "_rounding_seed", None) is not None:
                self._rounding_seed = aside["seed"]  # resumes the same rounding draws
            self._loaded(loaded)
        except BaseException:
            inner.state, inner.param_groups = saved_state, saved_groups
            raise

    def add_param_group(self, opt, param_group: dict) -> None:
        previous = self._kept_state(opt)
        self.optimizer.add_param_group(param_group)  # validates, and makes eager states (Adagrad's sum)
        state = opt.__dict__["_state"]  # the wrapped optimizer's too: its eager states land here
        added = opt.param_groups[-1]["params"]
        previous.update({p: dict(state[p]) for p in added if state.get(p)})
        try:
            _check_groups(self.optimizer, self.declaration)
            check_params(opt._params(), opt._device)
            check_distinct(opt._params())
            self.check_params(opt._params())
            self._lay_out(opt, previous)
            self._added(added, state)
        except BaseException:
            opt.param_groups.pop()
            for p in added:
                state.pop(p, None)
            raise

    def _learned_from(self, params: list, previous: dict, learned: Optional[dict]) -> Optional[dict]:
        """A vouched-for optimizer's layouts, learned from `previous` unless
        given; declared ones have none."""
        return learned

    def _loaded(self, loaded: dict) -> None:
        """After load_state_dict laid out the loaded states (a vouched-for
        optimizer learns again)."""

    def _added(self, added: list, state: dict) -> None:
        """After add_param_group laid out the added params."""

    def memory_stats(self, opt) -> dict[str, Any]:
        """The state keys that go to host memory;
        host_state_bytes 0 means nothing is swapped (an optimizer that keeps no
        state for its params, such as SGD without momentum). Also
        update_temporary_bytes: an estimate of what torch's update allocates
        on the device beyond the staged states, for the largest batch; and
        largest_whole_param_state_bytes: the swapped states of the largest
        param the rule never cuts (Muon, Adafactor, a whole state), which
        every arena holds at least."""
        stats = {"swapped_state_keys": [k for k, swapped in zip(self._keys, self._swap_keys) if swapped],
                 "update_temporary_bytes": self._temporaries(self._batch_layout)}
        params = opt._params()
        stats["largest_whole_param_state_bytes"] = max(
            (sum(row_bytes(kind, unit, _local(params[i]).numel(), True)
                 for (_, kind, unit, _, _), swapped in zip(rows, self._swap_keys) if swapped)
             for i, rows in enumerate(self._state_rows) if self._moves_whole[i]), default=0)
        return stats

    # ------------------------------------------------ moves of the store
    def bookkeeping(self) -> dict:
        """What a store's layout does not hold: which params show a state, and their scalars."""
        return dict(shown=list(self._shown), scalars=self._scalars)

    def restore_bookkeeping(self, opt, kept: dict) -> None:
        self._shown, self._scalars = kept["shown"], kept["scalars"]
        self._refresh_state(opt, opt._params())

    def release(self) -> None:
        """Drops every view of the store."""
        self._views = self._shown_views = self._unedited = None

    def lay_out_empty(self, opt) -> None:
        self._lay_out(opt, {}, learned=self._learned_from([], {}, None))
