"""The rule for an optimizer the user vouches for (trust_per_param_step):
torch's update as for a declared optimizer, with the states each param keeps
learned from its first update, and the contract probed before it."""

from __future__ import annotations

import copy
import math
import numbers
import warnings
from typing import Any, Optional

import torch

from ..compact import ROUNDING_STEP
from ..distributed import _global_offset, _is_dtensor, _like_param, _local
from .compact_states import (ABSMAX, BF16, CODES, COMPENSATION, BatchCodec, blocks, compacts, form_for, kahan_applies,
                             kahan_round, kahan_stand_in, update_dtype)
from .declarations import ELEMENT, SCALAR, WHOLE, Declaration
from .torch_update import (TorchUpdateRule, _copied, _fingerprint, _fresh, _GroupsAtStep, _immutable, _keep_scalar,
                           _Kept, _state_name, _store_keys, run_torch_update)



def _validate_trusted(optimizer):
    name = type(optimizer).__name__
    # Schedule-free optimizers swap their params and states in train() and
    # eval(), outside step(), where the states are in host memory.
    touching = [method for method in ("train", "eval") if callable(getattr(type(optimizer), method, None))]
    if touching:
        raise TypeError(f"SwapOptimizer cannot wrap {name}: its {' and '.join(m + '()' for m in touching)} "
                        "read or write its states outside step() (as schedule-free optimizers do), and "
                        "between steps SwapOptimizer keeps them in host memory; keep this optimizer's state "
                        "on the device")


def trusted_declaration(optimizer: torch.optim.Optimizer, elementwise: bool) -> Declaration:
    """An optimizer SwapOptimizer has no declaration for, wrapped on the
    user's word (trust_per_param_step): its states are learned per param,
    and its params are cut only on the second word (trust_elementwise_step)."""
    return Declaration((type(optimizer),), None, elementwise, _validate_trusted)


def _learn_layout(index: int, param: torch.Tensor, entry: dict, name: str,
                  check_device: bool = False) -> tuple[_Kept, ...]:
    """The states of a trusted optimizer's param, read from what it keeps:
    param-shaped tensors are element states, other tensors whole ones, 0-dim
    tensors and numbers scalars (kept where they are). check_device: the
    entry comes from the optimizer itself (not from the host store), so its
    tensors must be on the param's device. A DTensor param's (FSDP2) states
    are learned from its local shard's update (shaped like the shard) or
    from what torch.optim holds for it (DTensors like the param, or whole
    tensors from a full state dict); a state shaped otherwise would be this
    rank's alone, and is refused."""
    kept = []
    sharded = _is_dtensor(param)
    shard = _local(param)
    for key, value in entry.items():
        where = f"SwapOptimizer: state '{key}' of param {index} ({name})"
        if value is None or isinstance(value, numbers.Number):  # None: timm's SGDW without momentum
            kept.append(_Kept(key, SCALAR, None))
            continue
        if not torch.is_tensor(value):
            raise TypeError(f"{where} is a {type(value).__name__}; a trusted optimizer's states must be plain "
                            "tensors, numbers or None. Keep this optimizer's state on the device")
        if sharded and _is_dtensor(value) and value.dim() > 0 and value.shape == param.shape:
            kept.append(_Kept(key, ELEMENT, tuple(param.shape), value.dtype))  # as torch.optim holds it under FSDP2
            continue
        if type(value) is not torch.Tensor or value.layout != torch.strided:
            raise TypeError(f"{where} is a {type(value).__name__} with layout {value.layout}, not a plain strided "
                            "tensor (a tensor subclass, such as torchao's 8-bit states, keeps its own storage that "
                            "SwapOptimizer cannot stream). Use the optimizer's plain states, or keep its state on "
                            "the device")
        if value.dim() == 0:
            kept.append(_Kept(key, SCALAR, None))
        elif check_device and value.device != shard.device:
            raise TypeError(f"{where} is on {value.device}, its param on {shard.device}; SwapOptimizer streams "
                            "states kept on their param's device. Keep this optimizer's state as it is")
        elif value.shape == param.shape or (sharded and value.shape == shard.shape):
            kept.append(_Kept(key, ELEMENT, tuple(param.shape), value.dtype))
        elif sharded:
            raise ValueError(f"{where} has shape {tuple(value.shape)}, neither its param's {tuple(param.shape)} nor "
                             f"its local shard's {tuple(shard.shape)}: under FSDP2 (DTensor params) SwapOptimizer "
                             "updates each rank's local shard, and a state not shaped like the param would be this "
                             "rank's alone, not the plain optimizer's. Keep this optimizer's state on the device")
        else:
            kept.append(_Kept(key, WHOLE, tuple(value.shape), value.dtype))
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


class _GroupWrites:
    """A vouched-for optimizer's param groups over one step: each call starts
    from a copy of its group as it was at step() (call_group), and what the
    calls write into it must be the same from every call (note); the groups
    get it once the step is done. A step's context holds this, never the
    rule: a deferred step runs on without it."""

    def __init__(self, name: str, groups: list[dict], step_groups: list[dict]) -> None:
        self.name = name
        self.groups = groups            # the param groups themselves, which get the writes
        self.step_groups = step_groups  # copies of their values at step()
        self.written: dict[int, dict] = {}

    def call_group(self, g: int, params: list) -> tuple[dict, dict]:
        """A call's copy of param group `g` as it was before the step, holding
        `params`, and what it started from (key -> value)."""
        group = {key: _fresh(value) for key, value in self.step_groups[g].items()}
        start = dict(group)
        group["params"] = params
        return group, start

    def note(self, g: int, call_group: dict, start: dict) -> None:
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
                    (torch.is_tensor(value) or isinstance(value, (list, tuple, dict, set))) and not _immutable(value)
                    and not _same_value(value, self.step_groups[g][key])):
                written[key] = value
        removed = sorted(set(start) - set(call_group))
        if removed:
            raise RuntimeError(f"SwapOptimizer: {self.name}'s step removed {removed} from param group {g}; "
                               "SwapOptimizer runs the step batch by batch and cannot follow that. This "
                               "optimizer cannot be wrapped; keep its state on the device")
        first = self.written.setdefault(g, written)  # the first call's writes: every other must match
        for key in first.keys() | written.keys():
            unwritten = self.step_groups[g].get(key, "(no value)")  # what a call that did not write it leaves
            a, b = first.get(key, unwritten), written.get(key, unwritten)
            if a is not b and not _same_value(a, b):
                raise RuntimeError(
                    f"SwapOptimizer: {self.name}'s step wrote param group {g}'s '{key}' as "
                    f"{a!r} in one call and {b!r} in another: the value is computed over the params of the call "
                    "(as Prodigy's d is), so the step combines params and cannot run batch by batch. This "
                    "optimizer cannot be wrapped; keep its state on the device")

    def any(self) -> bool:
        """Whether a call wrote a value into its group."""
        return any(self.written.values())

    def apply(self, before: Optional[_GroupsAtStep] = None) -> None:
        """Into the groups, what the calls wrote (a tensor copied again: one
        made in a call is an inference tensor). before: the groups' values at
        step(), for a deferred step whose writes land when it is waited for:
        a value changed since step() was changed after the step in the plain
        optimizer's order, and is kept."""
        for g, written in self.written.items():
            group = self.groups[g]
            for key, value in written.items():
                if before is not None and \
                        (_fingerprint(group[key]) if key in group else None) != before.shown[g].get(key):
                    continue
                group[key] = value.clone() if torch.is_tensor(value) else value


def _holds_device_tensor(value: Any) -> bool:
    """Whether a group value is or holds a tensor off the CPU (comparing it on
    the host would wait for the device)."""
    if torch.is_tensor(value):
        return value.device.type != "cpu"
    if isinstance(value, (list, tuple, set)):
        return any(_holds_device_tensor(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_device_tensor(item) for item in value.values())
    return False


class VouchedForRule(TorchUpdateRule):
    """torch's update of an optimizer wrapped on the user's word: each param's
    states are learned from what its first update (whole, on its own) keeps,
    and the contract is probed on copies first (see _probe_contract)."""

    learning = True

    def __init__(self, optimizer: torch.optim.Optimizer, declaration: Declaration) -> None:
        super().__init__(optimizer, declaration)
        self._learned: dict = {}
        self._probed: set = set()  # (group, dimensionality) whose contract was probed
        self._stateless: set = set()  # ids of params whose first update kept no state
        # Params with state that no update of ours made (made in the optimizer's
        # __init__, loaded, or eager in add_param_group): their next update
        # runs whole, from that state, to learn all they keep.
        self._not_updated: set = set()
        self._wrote_groups = False  # whether the last step done wrote a value into its param groups
        self._writes: Optional[_GroupWrites] = None  # this step's

    def check_params(self, params: list) -> None:
        """DTensor params (FSDP2): each rank updates its local shard, which is
        the whole update only on the second promise (trust_elementwise_step)."""
        if any(_is_dtensor(p) for p in params) and not self.declaration.elementwise:
            name = type(self.optimizer).__name__
            raise ValueError(f"SwapOptimizer: {name} (wrapped on trust_per_param_step) with DTensor params (FSDP2): "
                             "SwapOptimizer updates each rank's local shard, which is the whole update only if the "
                             "update is elementwise. If it is (each element's update reads only that element of the "
                             "param, its grad and its param-shaped states), pass trust_elementwise_step=True too; "
                             "else keep this optimizer's state on the device")

    def check_wrap(self, config) -> None:
        """As a declared optimizer's; under compact states, trusted_state_kinds
        names the kinds of its states (one that names none compacts nothing:
        a warning)."""
        super().check_wrap(config)
        self._kinds = dict(config.trusted_state_kinds or {})
        if self._compact is not None and not any(compacts(self._compact, kind) for kind in self._kinds.values()):
            warnings.warn(f"SwapOptimizer: state_dtype={config.state_dtype}: trusted_state_kinds "
                          f"{self._kinds} names no state that is stored compact under it (docs/usage.md, 'Compact "
                          "states'); the states of "
                          f"{type(self.optimizer).__name__} stay exact", UserWarning, stacklevel=3)

    def _stores_apart(self, param: torch.Tensor) -> bool:
        """Whether `param`'s store differs from what its optimizer keeps
        (compact states, or Kahan's float32 states and compensation)."""
        return self._compact is not None or kahan_applies(_local(param), self._kahan)

    def _learn(self, index: int, param: torch.Tensor, entry: dict, check_device: bool = False,
               from_update: bool = False) -> tuple[_Kept, ...]:
        """The store's layout of param `index` that keeps `entry`: what the
        optimizer keeps (_learn_layout) in the store's forms (_stored_layout).
        `entry` may be in the store's own form (8-bit codes and scales, bf16,
        a compensation: the store's entries, a compact state dict), read as
        the states it holds. from_update: `entry` is what the optimizer's
        own update kept (not a loaded or stored one)."""
        name = type(self.optimizer).__name__
        if not from_update:
            entry = self._as_kept(param, entry)
        return self._stored_layout(index, param, _learn_layout(index, param, entry, name, check_device),
                                   from_update)

    def _as_kept(self, param: torch.Tensor, entry: dict) -> dict:
        """`entry` with the store's own keys read as the states they hold: an
        8-bit state's codes and scales as the state (a stand-in of its shape),
        the compensation and the rounding's count left out (a state dict
        saved with other settings may hold them: they are no state of the
        optimizer's)."""
        kept = {}
        dtype = update_dtype(_local(param), self._kahan)
        for key, value in entry.items():
            if key == ROUNDING_STEP or (key == COMPENSATION and kahan_applies(_local(param), self._kahan)):
                continue
            state = _state_name(key)
            if self._compact is not None and state != key and state + CODES in entry and state + ABSMAX in entry:
                if key.endswith(CODES):
                    kept[state] = torch.empty(value.shape, dtype=dtype, device="meta")
                continue
            kept[key] = value
        return kept

    def _stored_layout(self, index: int, param: torch.Tensor, learned: tuple[_Kept, ...],
                       from_update: bool) -> tuple[_Kept, ...]:
        """The store's layout of a param whose optimizer keeps `learned`: a
        param-shaped float state compact in the form its kind
        (trusted_state_kinds) gives it, decoded for the update in the dtype
        the update runs the param in; with Kahan every param-shaped float
        state in float32 (the stand-in's dtype, as the declared optimizers
        keep them); the rounding's own count beside bf16 ones, a compensation
        with Kahan. An exact state without Kahan stays in the dtype the
        optimizer keeps it in. The states in name order (a compact state's
        place keys its rounding: it must not depend on the order a state dict
        lists them in)."""
        if not self._stores_apart(param):
            return learned
        name = type(self.optimizer).__name__
        shard = _local(param)
        dtype = update_dtype(shard, self._kahan)
        kahan = kahan_applies(shard, self._kahan)
        specs = []
        for kept in sorted(learned, key=lambda spec: spec.name):
            where = f"SwapOptimizer: {name}'s state '{kept.name}' of param {index}"
            if from_update and kept.name in (ROUNDING_STEP, COMPENSATION):
                raise ValueError(f"{where} has the name of a state SwapOptimizer keeps itself under "
                                 "state_dtype or kahan_summation; leave those settings off for this optimizer")
            if kept.kind != ELEMENT or not kept.dtype.is_floating_point:
                specs.append(kept)
                continue
            code = None
            if self._compact is not None:
                if kept.name not in self._kinds:
                    raise ValueError(f"{where} is param-shaped, and trusted_state_kinds {self._kinds} does not name "
                                     f"it: under a compact state_dtype each param-shaped state needs its kind, e.g. "
                                     f"trusted_state_kinds={{..., '{kept.name}': 'signed'}} for a momentum "
                                     "(docs/usage.md, 'Compact states'), or None to keep it exact")
                code = self._kinds[kept.name]
            form = form_for(self._compact, code, param, dtype)
            if form is None and not kahan:  # exact, as the optimizer keeps it
                specs.append(kept)
                continue
            if from_update and kept.dtype != dtype:
                raise TypeError(f"{where} is {kept.dtype}, but its update ran the param in {dtype}: "
                                + ("Kahan keeps param-shaped states in float32" if kahan else
                                   "a compact state is decoded for the update in that dtype")
                                + ", which would change this optimizer's update. Leave "
                                + ("kahan_summation off" if kahan else "that state exact (None in trusted_state_kinds)")
                                + " for it")
            specs.append(kept._replace(dtype=dtype, form=form, code=code if form else None))
        if any(spec.form == BF16 for spec in specs):
            specs.append(_Kept(ROUNDING_STEP, SCALAR, None))
        if kahan:
            specs.append(_Kept(COMPENSATION, ELEMENT, None, dtype=shard.dtype))
        return tuple(specs)

    def _load_forms(self, param: torch.Tensor, layout: tuple, kept: dict) -> tuple[dict, dict, bool]:
        """The forms and kinds a loaded entry's states take here, by
        trusted_state_kinds (a param that has not stepped yet has no layout
        to ask)."""
        shard = _local(param)
        dtype = update_dtype(shard, self._kahan)
        names = {_state_name(key) for key in kept}
        forms = {name: form_for(self._compact, self._kinds.get(name), param, dtype) for name in names}
        return forms, {name: self._kinds.get(name) for name in names}, kahan_applies(shard, self._kahan)

    def _step_writes(self, opt) -> _GroupWrites:
        self._writes = _GroupWrites(type(self.optimizer).__name__, list(opt.param_groups), self._step_groups)
        return self._writes

    def _may_defer(self, params: list, grads: list, first: list[int]) -> bool:
        """A vouched-for step runs beside the next forward once it learns and
        probes nothing (every param with a grad has stepped, the contract of
        each group and dimensionality is probed), as long as the last step
        wrote nothing into its groups (a step that does, as timm's Adan's
        counter, runs inside step(), so the groups hold its values when
        step() returns) and no group holds a device tensor (the calls compare
        group values on the host)."""
        return not first and not self._wrote_groups and \
            not self._to_probe(params, [i for i, grad in enumerate(grads) if grad is not None]) and \
            not any(_holds_device_tensor(value) for group in self._step_groups for value in group.values())

    def _groups_written(self, writes: Optional[_GroupWrites], before: Optional[_GroupsAtStep] = None) -> None:
        if writes is not None:
            writes.apply(before)
            self._wrote_groups = writes.any()

    def start(self, opt, existing: dict) -> None:
        """The states the optimizer made already (in its __init__) must be on
        their params' devices; their params' next updates learn the rest."""
        self._refuse_foreign_keys(opt)
        index_of = {id(p): i for i, p in enumerate(opt._params())}
        for p, entry in existing.items():
            self._learn(index_of[id(p)], p, entry, check_device=True)
        self._not_updated = {id(p) for p in existing}
        super().start(opt, existing)

    def _layouts(self, opt, learned: Optional[dict] = None) -> list[tuple]:
        """Per param, the states learned from its state (`learned`, else the current ones)."""
        if learned is None:
            return self.layouts_for(opt.param_groups)
        return [learned.get(p, ()) for p in opt._params()]

    def layouts_for(self, param_groups: list[dict], numels: Optional[list[int]] = None) -> list[tuple]:
        """Per param of `param_groups`, the states learned at its first update
        (none before it: a vouched-for optimizer declares none, so no layout is
        known ahead; the planner does not plan such optimizers)."""
        return [self._learned.get(p, ()) for group in param_groups for p in group["params"]]

    def _learned_from(self, params: list, previous: dict, learned: Optional[dict]) -> Optional[dict]:
        if learned is not None:
            return learned
        if not params:  # an empty store for the current params: their layouts as learned
            return self._learned
        return {p: self._learn(i, p, previous[p]) for i, p in enumerate(params) if previous.get(p)}

    def _loaded(self, loaded: dict) -> None:
        self._probed.clear()  # new settings: the contract is checked again
        self._not_updated = {id(p) for p in loaded}
        self._stateless.difference_update(id(p) for p in loaded)  # a loaded state is learned again

    def _added(self, added: list, state: dict) -> None:
        self._not_updated |= {id(p) for p in added if state.get(p)}

    def _learn_first_updates(self, opt, params: list[torch.Tensor], grads: list, first: list[int]) -> None:
        """A trusted optimizer's first update of each param in `first`, whole
        and on its own, on the device: the states it makes tell the param's
        layout, and the store is laid out again with them. With Kahan it runs
        on the float32 stand-in, as a batch's update does, and compact states
        are decoded and encoded as a batch's are: the update is the one the
        pipeline would make. If anything fails (a call breaks the contract, a
        state cannot be streamed, state_keys names a state it does not keep),
        the params updated so far get their values back before the error:
        nothing changed."""
        backups, updated, layouts, stateless = [], {}, {}, []
        had_state = any(self._shown[i] for i in first)
        if had_state:
            opt._synchronize()  # the host store holds the last step's copies
        try:
            for i in first:
                param = params[i]
                start_state = self._start_state(i, param)  # before the param changes
                piece = _local(param).detach()  # a DTensor's: this rank's shard, updated on its own
                backups.append((piece, piece.to("cpu", copy=True)))
                kahan = kahan_applies(piece, self._kahan)
                if kahan:  # (a float32 copy of the grad: the call may change it in place)
                    target = kahan_stand_in(piece, grads[i], self._stored_compensation(i, piece))
                else:
                    target = piece
                    target.grad = grads[i].clone()  # the call may change it in place; a refusal must not
                state = {target: start_state}
                call_group, start = self._writes.call_group(self._group_of[i], [target])
                run_torch_update(self.optimizer, [call_group], state, strict=True)
                self._writes.note(self._group_of[i], call_group, start)
                updated[i] = state[target]
                # (refuses the unstreamable, and under compact states a state of no named kind)
                layouts[i] = self._learn(i, param, updated[i], check_device=True, from_update=True)
                if not updated[i]:
                    stateless.append(id(param))
                if kahan:
                    compensation = torch.empty_like(piece)
                    kahan_round(target, piece, compensation)
                    updated[i] = dict(updated[i], **{COMPENSATION: compensation})
                updated[i] = self._in_stored_form(i, param, layouts[i], updated[i])
            if all(self._shown[i] and updated[i] and layouts[i] == self._layouts_now[i] for i in first):
                self._write_entries(opt, updated)  # a resume: the states the store holds already, new values
            elif had_state or any(updated.values()):
                # (a DTensor param's as torch.optim holds them: DTensors over its shard's)
                entries = {params[i]: {key: _like_param(value.to("cpu", copy=True), params[i])
                                       if torch.is_tensor(value) and value.shape == _local(params[i]).shape
                                       else value.to("cpu", copy=True) if torch.is_tensor(value) and value.dim() > 0
                                       else value
                                       for key, value in entry.items()} for i, entry in updated.items()}
                self._lay_out(opt, {**self._kept_state(opt), **entries})
        except BaseException:
            for piece, backup in backups:
                # (through .data: a version bump would read as a write outside
                # step(), which zeroes a Kahan compensation at the next step)
                piece.data.copy_(backup)
            raise
        self._stateless.update(stateless)
        self._not_updated -= {id(params[i]) for i in first}

    def _stored_compensation(self, index: int, piece: torch.Tensor) -> Optional[torch.Tensor]:
        """A device copy of param `index`'s Kahan compensation (None before its
        first update). The caller has synchronized."""
        if not self._shown[index] or not any(spec.name == COMPENSATION for spec in self._layouts_now[index]):
            return None
        return _local(self._entry(index)[COMPENSATION]).to(piece.device, copy=True)

    def _in_stored_form(self, index: int, param: torch.Tensor, layout: tuple, entry: dict) -> dict:
        """`entry` (what a whole update kept) with its compact states encoded
        into the store's form on the device, as a batch's update encodes them
        (the same rounding keys: param, state, element, the rounding's count),
        and that count advanced."""
        compact = [spec for spec in layout if spec.form is not None]
        if not compact:
            return entry
        piece = _local(param)
        count = (int(self._scalars[index].get(ROUNDING_STEP, 0)) if self._shown[index] else 0) + 1
        codec = BatchCodec(piece.device, self._rounding_seed)
        stored = dict(entry)
        for state_index, spec in enumerate(compact):  # (their place among the compact states keys the rounding)
            outputs = {key: torch.empty(piece.shape if kind == "element" else (blocks(piece.numel()),),
                                        dtype=dtype, device=piece.device)
                       for key, kind, dtype in _store_keys(spec, piece.dtype)}
            codec.write_back(spec.form, spec.code, outputs, spec.name, stored.pop(spec.name), index, state_index,
                             _global_offset(param, index), count)
            stored.update(outputs)
        codec.encode()
        if any(spec.name == ROUNDING_STEP for spec in layout):
            stored[ROUNDING_STEP] = torch.tensor(count, dtype=torch.int64, device="cpu")
        return stored

    def _write_entries(self, opt, updated: dict) -> None:
        """Writes the states of params whose layout did not change (index ->
        its state after a whole update, in the store's form) into the store:
        views copied, scalars in place where they can be (torch keeps their
        identity)."""
        for i, entry in updated.items():
            for spec in self._layouts_now[i]:
                if spec.kind == SCALAR:
                    _keep_scalar(self._scalars[i], spec.name, entry[spec.name])
                else:
                    for key, _, _ in _store_keys(spec, torch.float32):
                        self._views[i][key].copy_(entry[key])
        opt._runtime.order_writes()  # resident states written on this stream
        self._refresh_state(opt, opt._params())

    def _start_state(self, index: int, param: torch.Tensor) -> dict:
        """Copies, on the param's device, of the state param `index` has now
        (none before its first update, unless the optimizer made some in its
        __init__ or it was loaded), as its optimizer keeps it: compact states
        decoded as a batch's update decodes them, without the store's own
        (a compensation, the rounding's count). What a whole update of it
        starts from. The caller has synchronized: the host store holds the
        last step's."""
        if not self._shown[index]:
            return {}
        shard = _local(param)  # a DTensor's states: its local shard's
        stored = self._entry(index)
        kahan = kahan_applies(shard, self._kahan)
        state, codec = {}, None
        for spec in self._layouts_now[index]:
            if spec.name == ROUNDING_STEP or (kahan and spec.name == COMPENSATION):
                continue
            if spec.form is not None:
                if codec is None:
                    codec = BatchCodec(shard.device, self._rounding_seed)
                copies = {key: _local(stored[key]).to(shard.device, copy=True)
                          for key, _, _ in _store_keys(spec, shard.dtype)}
                state[spec.name] = codec.scratch(spec.form, spec.code, copies, spec.name, shard.shape, spec.dtype)
                continue
            value = stored[spec.name]
            state[spec.name] = (_local(value).to(shard.device, copy=True) if value.dim() > 0 else value.clone()) \
                if torch.is_tensor(value) else copy.deepcopy(value)
        if codec is not None:
            codec.decode()
        return state

    def _probe_contract(self, opt, params: list[torch.Tensor], grads: list, candidates: list[int]) -> None:
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
        smallest = self._to_probe(params, candidates)
        # The probe's random draws leave the user's streams as they were.
        devices = sorted({params[i].device.index or 0 for i in smallest.values()
                          if params[i].device.type == "cuda"})
        if any(self._shown[i] for i in smallest.values()):
            opt._synchronize()  # the host store holds the last step's copies (_start_state reads them)
        with torch.random.fork_rng(devices=devices):
            for key, i in smallest.items():
                value, grad = _local(params[i]).detach(), grads[i]  # a DTensor's: its local shard
                if kahan_applies(value, self._kahan):  # as its updates run: on a float32 stand-in
                    value, grad = value.float(), grad.float()
                start = self._start_state(i, params[i])
                # A second grad that is no multiple of the first.
                grads_by_step = [grad, grad.reshape(-1).roll(1).reshape(grad.shape) * 2]
                alone, = self._probe_updates(key[0], [value], [[g] for g in grads_by_step], [start])
                # (refuses the unstreamable, and under compact states a state of no named kind)
                layout = self._learn(i, params[i], alone[1], check_device=True, from_update=True)
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

    def _to_probe(self, params: list, candidates: list[int]) -> dict[tuple, int]:
        """(group, dimensionality) -> the param of `candidates` the probe takes
        for it, for those not probed yet: the smallest, by its local shard
        for a DTensor (an empty shard only where all are)."""
        def size(i: int) -> tuple:
            numel = _local(params[i]).numel()
            return numel == 0, numel

        smallest: dict[tuple, int] = {}
        for i in candidates:
            key = (self._group_of[i], params[i].dim())
            if key not in self._probed and (key not in smallest or size(i) < size(smallest[key])):
                smallest[key] = i
        return smallest

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
        group, _ = self._writes.call_group(g, pieces)  # what one update writes, the next reads
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
