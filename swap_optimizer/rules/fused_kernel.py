"""The rule that updates each batch with the packed fused Adam/AdamW kernel
(csrc/kernels): the update wherever torch has no path, so for compact states
(bf16 with stochastic rounding, blockwise 8-bit), fp32 states of 16-bit params,
fp32 master weights and Kahan summation. Adam's state-dict conversions:
swap_optimizer.state_dicts."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Optional

import torch

from .. import _C
from ..budget import Planning, copy_bytes, fused_op_table_bytes
from ..compact import FORMAT_KEY, MIN_QUANTIZED_NUMEL, MOMENTS, code_map, state_format
from ..config import SwapOptimizerConfig
from ..distributed import (_check_fsdp_8bit, _global_offset, _is_dtensor, _like_param, _local,
                           _shared_default_seed, _sharded_scales)
from ..params import check_distinct, check_overlap_params, check_params, param_versions, written_since
from ..state_dicts import check_state_entry, checked_adam_state, write_adam_states
from .compact_states import warn_if_no_16_bit
from .declarations import Declaration

# Flags that choose how torch runs the update, not what it computes: loading a
# state dict keeps this optimizer's own.
_EXECUTION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def needs_packed_kernel(config: SwapOptimizerConfig) -> bool:
    """Settings torch's Adam has no update for: compact states, fp32 states of
    16-bit params, master weights, Kahan summation."""
    return config.state_dtype is not None or config.master_weights or config.kahan_summation


def _check_group_flags(group: dict, index: int) -> None:
    # foreach and fused only choose how torch would run the update, which the
    # packed kernel replaces: both are accepted.
    for flag, fix in (("capturable", "capturable=False"), ("differentiable", "differentiable=False")):
        if group.get(flag):
            raise ValueError(f"SwapOptimizer: param group {index} has {flag}=True, which SwapOptimizer does not "
                             f"support (it runs its own fused update); create the optimizer with {fix}")


class PackedKernelRule:
    """Adam/AdamW by the packed fused kernel, which the C++ runtime calls per
    batch: the store holds Adam's keys in the configured form; the rule keeps
    which params show a state, and the versions of params with a master copy
    or a Kahan buffer. SwapOptimizer hands itself (`opt`) to each call; the
    rule holds no reference to it."""

    def __init__(self, optimizer: torch.optim.Optimizer, declaration: Declaration) -> None:
        self.optimizer = optimizer
        self.declaration = declaration
        self._views: Optional[list[dict]] = None
        self._rounding_seed = None

    # ------------------------------------------------------- settings
    def check_wrap(self, config: SwapOptimizerConfig) -> None:
        """What this rule cannot run under `config`, refused (with the reason)
        before anything is built."""
        config.check_adam_state_keys()
        if config.rounding_seed is not None and config.state_dtype != torch.bfloat16:
            raise ValueError("SwapOptimizer: rounding_seed seeds the stochastic rounding of bf16 states, and "
                             f"{type(self.optimizer).__name__}'s states under state_dtype={config.state_dtype} keep "
                             "none in bf16 (its 8-bit moments round to nearest); set state_dtype=torch.bfloat16 or "
                             "drop rounding_seed")
        for index, group in enumerate(self.optimizer.param_groups):
            _check_group_flags(group, index)
        warn_if_no_16_bit([p for g in self.optimizer.param_groups for p in g["params"]], config.kahan_summation)

    def check_params(self, params: list) -> None:
        """DTensor params are this rank's shards (8-bit ones: checked at lay-out)."""

    def unscales_in_step(self, setting: Optional[bool]) -> bool:
        """The kernel takes GradScaler's scale and inf flag on the device, fused
        or not; None follows the wrapped optimizer (fused: yes), as torch's
        GradScaler does with the plain one."""
        return any(bool(g.get("fused")) for g in self.optimizer.param_groups) if setting is None else setting

    def start(self, opt, existing: dict) -> None:
        """Lays out the first store, filled from the wrapped optimizer's state."""
        if opt.config.state_dtype == torch.bfloat16:  # stochastic rounding; the seed is saved in state dicts
            self._rounding_seed = opt.config.rounding_seed
            if self._rounding_seed is None:
                self._rounding_seed = _shared_default_seed()
        self._lay_out(opt, existing, "the wrapped optimizer's state")

    @property
    def views(self) -> Optional[list[dict]]:
        """Per param, its state views in the store (None while there is no store)."""
        return self._views

    def memory_stats(self, opt) -> dict[str, Any]:
        return {}

    def _follow_param_groups(self, opt, caller: str) -> None:
        """Rebuilds the store when the params in param_groups are no longer those
        it was laid out for (groups reassigned, or params added by hand). A torn
        state is refused, in `caller`'s name, except by load_state_dict, which
        rewrites every state (and so may rebuild over it)."""
        params = opt._params()
        if [id(p) for p in params] == opt._param_ids and \
                [len(g["params"]) for g in opt.param_groups] == opt._group_sizes:
            return
        for index, group in enumerate(opt.param_groups):
            _check_group_flags(group, index)
        check_params(params, opt._device)
        check_distinct(params)
        if caller != "load_state_dict":
            opt._refuse_if_torn(caller)
        previous = {p: entry for p, entry in opt.state.items() if entry}  # waits for the last step
        self._lay_out(opt, previous, "the state carried over to the new param_groups")

    @torch.no_grad()
    def _lay_out(self, opt, previous: dict, source: str) -> None:
        """Lays out the stores for the current params (this rank's parts of
        DTensors) and fills them from `previous` (param -> state dict), zeros
        where absent."""
        params = opt._params()
        if opt._overlap is not None:  # refused before anything is built or written: the old store stays whole
            check_overlap_params(params)
            opt._overlap.check_params(params)
        group_of_param = opt._group_of_param()
        group_amsgrad = [bool(group["amsgrad"]) for group in opt.param_groups]
        index_of = {p: i for i, p in enumerate(params)}
        updates = [(index_of[p], checked_adam_state(p, entry, group_amsgrad[group_of_param[index_of[p]]],
                                                      f"{source}, param {index_of[p]}"))
                   for p, entry in previous.items() if p in index_of and entry]
        local_params = [_local(p) for p in params]
        swappable = [p.numel() >= opt.config.min_numel and p.is_contiguous() for p in local_params]
        swap_keys = opt.config.runtime_swap_keys()
        global_offsets = []
        if self._rounding_seed is not None:
            global_offsets = [_global_offset(p, i) for i, p in enumerate(params)]
        quantized_params = []
        if opt.config.state_dtype == torch.uint8:
            for i, p in enumerate(params):
                if _is_dtensor(p):
                    _check_fsdp_8bit(p, f"SwapOptimizer: param {i}")
            # On the whole param (a DTensor's numel), so every rank's shard of it agrees.
            quantized_params = [p.numel() >= MIN_QUANTIZED_NUMEL for p in params]
        lay_out_as = functools.partial(_C.summarize_staging, local_params, group_of_param, group_amsgrad,
                                       master_weights=opt.config.master_weights, swap_keys=swap_keys,
                                       kahan_summation=opt.config.kahan_summation)

        # (the closures keep no reference to the optimizer)
        config, state_dtype = opt.config, opt.config.state_dtype

        def lay_out(swappable: list[bool], swap_times: int, num_arenas: int) -> _C.StagingSummary:
            summary = lay_out_as(swappable, swap_times=swap_times, num_arenas=num_arenas, state_dtype=state_dtype,
                                 quantized_params=quantized_params)
            return summary.with_update_temporary_bytes(fused_op_table_bytes(summary.batch_layout))

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
                local_params, group_of_param, group_amsgrad, swappable, state_dtype=config.state_dtype,
                master_weights=config.master_weights, swap_keys=swap_keys,
                num_arenas=config.fixed_num_arenas, budget_bytes=config.staging_budget_bytes,
                kahan_summation=config.kahan_summation)
            if swap_times < 0:
                raise ValueError(f"SwapOptimizerConfig.staging_budget_bytes={config.staging_budget_bytes} is too "
                                 f"small: the smallest budget that works is {smallest} bytes (the finest split, "
                                 "pieces of at least 64 KiB of state); raise the budget, or keep more params "
                                 "resident with a larger min_numel")
            return swap_times

        copies = copy_bytes(local_params, opt.__dict__["_unscale_in_step"] or opt._overlap is not None)
        planning = Planning.make(opt.config, opt._budget_now(), lay_out, swappable, copies, opt._device,
                                 staging_budget_swap_times, advice, opt._resident_priority())
        runtime = _C.SwapRuntime(local_params, group_of_param, group_amsgrad, planning.swappable,
                                 swap_times=planning.swap_times, num_arenas=planning.num_arenas, state_dtype=opt.config.state_dtype,
                                 master_weights=opt.config.master_weights, pin_memory=opt.config.pin_memory,
                                 keep_arenas=opt.config.keep_arenas, swap_keys=swap_keys,
                                 kahan_summation=opt.config.kahan_summation, rounding_seed=self._rounding_seed,
                                 global_offsets=global_offsets, quantized_params=quantized_params,
                                 resident_groups=opt._resident_groups())
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
        state = opt.__dict__["_state"]
        state.clear()
        state.update((p, dict(entry)) for p, entry, shown in zip(params, self._entries, self._shown) if shown)
        if opt._overlap is not None:
            opt._overlap.lay_out(params)
        opt._runtime = runtime
        opt._planning = planning
        opt._group_sizes = [len(g["params"]) for g in opt.param_groups]
        opt._param_ids = [id(p) for p in params]
        opt._data_pointers = _C.data_pointers(local_params)
        self._note_param_versions(opt)

    def _note_param_versions(self, opt) -> None:
        """Remembers the version counter of each param that has a master copy or
        a Kahan buffer."""
        self._param_versions = param_versions(opt._params(), [
            i for i, view in enumerate(self._views) if "master_param" in view or "compensation" in view])

    def _sync_outside_changes(self, opt, params: list[torch.Tensor]) -> None:
        """Brings the store up to date with what changed outside step(): a master
        copy follows its param when the param was written since the last step
        (model.load_state_dict, say); a state entry that was replaced, edited or
        removed in `state` is loaded into the store (removed: reset and hidden, as
        torch starts it anew at the param's next grad)."""
        state = opt.__dict__["_state"]
        edits, group_of_param = {}, None  # the latter only once something was edited
        for i, p in enumerate(params):
            entry, ours = state.get(p), self._entries[i]
            if not entry and not self._shown[i]:
                continue  # no state yet, as in torch (an empty entry: a read of the defaultdict)
            if entry is not None and len(entry) == len(ours) and all(entry.get(k) is v for k, v in ours.items()):
                continue
            group_of_param = group_of_param or opt._group_of_param()
            amsgrad = bool(opt.param_groups[group_of_param[i]]["amsgrad"])
            edits[i] = checked_adam_state(p, entry, amsgrad, f"SwapOptimizer.state[param {i}]") if entry else {}
        followed = [i for i in written_since(params, self._param_versions) if i not in edits]
        if edits or followed:
            # The host store is written: the last step's copies out must have landed (on CUDA they may not).
            opt._runtime.synchronize()
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
            opt._runtime.order_writes()

    def step(self, opt) -> None:
        """One step of every param with a grad, by the packed kernel (after
        SwapOptimizer.step's common part: closure, waits, refusals)."""
        opt._stepping = True  # from here a signal handler may read, not change, the store
        stepped = False
        try:
            self._follow_param_groups(opt, "step")
            groups = opt.param_groups
            group_args = []
            for index, group in enumerate(groups):
                _check_group_flags(group, index)
                beta1, beta2 = group["betas"]
                decoupled = group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
                group_args.append((float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                                   float(group["weight_decay"]), bool(group["amsgrad"]), bool(group["maximize"]),
                                   bool(decoupled)))
            params = [p for g in groups for p in g["params"]]
            data_pointers = _C.data_pointers([_local(p) for p in params])
            if data_pointers != opt._data_pointers:  # .data replaced since the last step: aliasing is possible again
                check_distinct(params)
                opt._data_pointers = data_pointers
            self._sync_outside_changes(opt, params)
            opt._settle_budget_choice()  # may move the (synced) store to a new store layout
            deferred = opt._overlap is not None and opt._overlap.may_defer()  # after any rebuild or move
            grads = [None if p.grad is None else _local(p.grad) for p in params]
            state = opt.__dict__["_state"]
            for i, (p, grad) in enumerate(zip(params, grads)):
                if grad is not None and not self._shown[i]:  # its first step: the state appears, as torch makes it
                    self._shown[i] = True
                    state[p] = dict(self._entries[i])
            stepped = True
            if opt._overlap is not None:
                opt._overlap.before_step(deferred)
            opt._runtime.step([_local(p) for p in params], grads, group_args, getattr(opt, "grad_scale", None),
                              getattr(opt, "found_inf", None), deferred=deferred)
            if opt._overlap is not None:
                opt._overlap.after_step(deferred, opt._runtime, grads)
        finally:
            opt._stepping = False
            if opt._overlap is not None:
                opt._overlap.end_enqueuing()  # its pass has begun, or step() raised
            # A stopped step leaves each param and its master consistent too.
            # (The step bumps no version counter, deferred or not: any later
            # bump is a write made outside step().)
            if stepped:
                self._note_param_versions(opt)

    def add_param_group(self, opt, param_group: dict) -> None:
        opt.wait()
        self._follow_param_groups(opt, "add_param_group")
        params = param_group["params"]
        # A generator can be read once: keep the list, as torch's add_param_group does.
        param_group["params"] = params = [params] if isinstance(params, torch.Tensor) else list(params)
        check_params(params, opt._device, first_index=sum(opt._group_sizes))
        _check_group_flags(param_group, len(opt.param_groups))
        check_distinct(opt._params() + params)
        opt._refuse_if_torn("add_param_group")
        previous = dict(opt.state)  # waits for the last step; views stay valid after the rebuild
        self.optimizer.add_param_group(param_group)  # validates and appends to the shared param_groups
        try:
            self._lay_out(opt, previous, "the current state")
        except BaseException:
            opt.param_groups.pop()
            raise

    def state_dict_extras(self, opt, state_dict: dict[str, Any]) -> None:
        """Steps are CPU float32 tensors. With compact states, each param
        group also says how they are stored (FORMAT_KEY: the moments' form,
        the code maps and block size of 8-bit ones, the rounding seed of bf16
        ones; see dequantize_state_dict), and 8-bit scales of sharded params
        get a place per rank."""
        if opt.config.state_dtype == torch.uint8:  # scales of sharded params get a place per rank
            params = opt._params()
            for index, entry in state_dict["state"].items():
                if _is_dtensor(params[index]):
                    entry = state_dict["state"][index] = dict(entry)  # torch's state dict shares our entries
                    for key in [k for k in entry if k.endswith("_absmax")]:
                        entry[key] = _sharded_scales(entry[key], params[index])
        if opt.config.state_dtype in (torch.bfloat16, torch.uint8) or opt.config.kahan_summation:
            form = state_format(opt.config.state_dtype, self._rounding_seed)
            for group in state_dict["param_groups"]:
                group[FORMAT_KEY] = copy.deepcopy(form)

    def load_state_dict(self, opt, state_dict: dict[str, Any]) -> None:
        """Checked whole (groups, amsgrad, code maps, every entry) before
        anything is written; then into the store, in its form."""
        opt.wait()
        self._follow_param_groups(opt, "load_state_dict")
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        groups = opt.param_groups
        if len(saved_groups) != len(groups):
            raise ValueError(f"SwapOptimizer.load_state_dict: the state dict has {len(saved_groups)} param groups "
                             f"but this optimizer has {len(groups)}")
        params = opt._params()
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
            new_group = {**opt.defaults, **saved, "params": group["params"]}
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
        group_of_param = opt._group_of_param()
        values = {}
        for saved_id, entry in state_dict["state"].items():
            check_state_entry(saved_id, entry)
            if saved_id not in index_of_id:
                raise ValueError(f"SwapOptimizer.load_state_dict: state for param id {saved_id!r}, which no param "
                                 "group of the state dict lists")
            i = index_of_id[saved_id]
            if entry:
                values[i] = checked_adam_state(params[i], entry, bool(groups[group_of_param[i]]["amsgrad"]),
                                                f"SwapOptimizer.load_state_dict: param {i}")
        # Everything is checked: write.
        opt._runtime.synchronize()
        if saved_seed is not None:
            self._rounding_seed = saved_seed
            opt._runtime.set_rounding_seed(saved_seed)
        groups[:] = new_groups
        write_adam_states(params, self._views, values)
        opt._runtime.order_writes()
        opt._runtime.clear_torn()  # every param's state is rewritten, the torn ones' included
        state = opt.__dict__["_state"]
        self._shown = [i in values for i in range(len(params))]
        for p, entry, shown in zip(params, self._entries, self._shown):
            if shown:
                state[p] = dict(entry)
            else:
                state.pop(p, None)
        self._note_param_versions(opt)

    def step_waited(self, opt, failed: bool = False) -> None:
        """Nothing: the kernel's step writes no param group."""

    def bookkeeping(self) -> dict:
        """What a store's layout does not hold: which params show a state."""
        return dict(shown=list(self._shown))

    def restore_bookkeeping(self, opt, kept: dict) -> None:
        self._shown = kept["shown"]
        state = opt.__dict__["_state"]
        state.clear()
        state.update((p, dict(entry)) for p, entry, shown in zip(opt._params(), self._entries, self._shown)
                     if shown)

    def release(self) -> None:
        """Drops every view of the store."""
        self._views = self._entries = None

    def lay_out_empty(self, opt) -> None:
        self._lay_out(opt, {}, "no state (it is moved in after)")
