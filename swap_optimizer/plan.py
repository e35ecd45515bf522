"""Plan before training: what an optimizer (AdamW unless --optimizer) with
SwapOptimizer needs on the device and in pinned host memory for a model, before
it is built (no weights, no GPU).

    python -m swap_optimizer.plan llama-3.1-8b --device-memory 80
    python -m swap_optimizer.plan --config path/to/config.json --device-memory 24 --state-mode 8bit
    python -m swap_optimizer.plan llama-3.1-8b --optimizer sgd --optimizer-args momentum=0.9
    python -m swap_optimizer.plan llama-3.1-8b      # counts and bytes only: no device fit, no budget's plan

Every SwapOptimizer figure comes from the runtime's own layout on meta tensors
(memory_stats() of a real step equals it): the rule SwapOptimizer chooses for
the optimizer in each state mode (rules.choose_rule, its check_wrap) lays the
store out with `_C.summarize_rule_staging` from the rows the rule itself builds
(torch's own update: TorchUpdateRule.layouts_for and store_rows, compact
states and Kahan included) or `_C.summarize_staging` (the packed Adam kernel:
Adam/AdamW's compact states, master weights, Kahan); then the device budget's
planner and its cost model (swap_optimizer.budget). The activations are an
estimate (see activation_bytes)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import math
import os
import sys
import textwrap
import warnings
from typing import Callable, Optional

import torch

from . import _C
from .budget import (StepCostModel, allocated, choose_for_budget, device_bytes, fused_op_table_bytes, resident_share,
                     smallest_device_bytes)
from .compact import MIN_QUANTIZED_NUMEL
from .config import SwapOptimizerConfig
from .presets import PRESETS, DecoderShape, from_hf_config
from .rules import DECLARATIONS, REFUSED, PackedKernelRule, choose_rule, keeps_adam_step
from .rules.declarations import ELEMENT, SCALAR, WHOLE
from .rules.torch_update import StoreRows, UpdateTemporaries, row_bytes, store_rows

GIB = 1 << 30
DEFAULTS = SwapOptimizerConfig()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# --state-mode -> SwapOptimizer settings (docs/usage.md, "Fewer bytes over the link: compact states").
STATE_MODES = {
    "default": {},
    "bf16": dict(state_dtype=torch.bfloat16),
    "8bit": dict(state_dtype=torch.uint8),
    "master": dict(master_weights=True, state_dtype=torch.float32),
    "kahan": dict(kahan_summation=True),
    "kahan+8bit": dict(kahan_summation=True, state_dtype=torch.uint8),
}
SIXTEEN_BIT_MODES = ("master", "kahan", "kahan+8bit")  # they keep what rounding a 16-bit param loses
# --optimizer -> the torch.optim class: those SwapOptimizer declares, and those it refuses (REFUSED says why).
OPTIMIZERS = {cls.__name__.lower(): cls for declaration in DECLARATIONS for cls in declaration.classes}
OPTIMIZERS.update({cls.__name__.lower(): cls for cls in REFUSED})
# torch's update on the planned device: its default path there (foreach for most, Adafactor's for-loop).
PLANNED_DEVICE = torch.device("cuda")
# Both directions of a PCIe link at once carry about 1.6x one direction (an
# assumption: full duplex, less the DMA engines' and root complex's limits).
BOTH_WAYS_FACTOR = 1.6
# A batch's copy set-up and launches, and a step's table and events, on a GPU (as StepCostModel.for_device).
BATCH_SECONDS, STEP_SECONDS = 20e-6, 100e-6
# Host RAM the pinned states leave to everything else (the OS and its page
# cache, data loading, each rank's own process and CUDA context): pinned pages
# cannot be swapped out, so a plan that pins nearly all RAM is not one that fits.
HOST_RESERVE_MIN, HOST_RESERVE_SHARE = 2 * GIB, 0.10

LayOut = Callable[[list, int, int], dict]


def rank_shape(shape: tuple[int, ...], world_size: int) -> tuple[int, ...]:
    """A param's largest local shard under FSDP2 (Shard(0)): ceil(rows / world_size) rows."""
    return (-(-shape[0] // world_size),) + tuple(shape[1:])


def activation_bytes(model: DecoderShape, batch: int, seq: int, itemsize: int, attention: str) -> int:
    """An estimate of the activations one rank's step keeps for backward,
    without recomputation (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models"): per layer s*b*h*34 bytes of
    16-bit activations, plus 5*a*s*s*b for eager attention's scores, softmax
    and dropout mask (SDPA's flash and memory-efficient kernels keep none),
    scaled by itemsize / 2; plus fp32 logits and their grad, 2 * b*s*vocab*4.
    It ignores SwiGLU's wider MLP, GQA's narrower k and v and the framework's
    temporaries: a figure to size a budget with, not a measurement."""
    s, b, h = seq, batch, model.hidden_size
    per_layer = s * b * h * 34 + (5 * model.num_heads * s * s * b if attention == "eager" else 0)
    return model.num_layers * per_layer * itemsize // 2 + 2 * b * s * model.vocab_size * 4


def host_reserve_bytes(host: int) -> int:
    """The default --host-reserve-gib: max(2 GiB, 10% of host RAM)."""
    return max(HOST_RESERVE_MIN, int(HOST_RESERVE_SHARE * host))


@dataclasses.dataclass(frozen=True)
class Memory:
    """The device and host bytes one rank has, and what the model takes before
    the optimizer: params, grads (the params' dtype) and activations. device
    None: not given (counts and bytes only, no device fit, no budget)."""

    device: Optional[int]
    headroom: int
    host: int
    host_reserve: int
    ranks_per_host: int
    params: int
    activations: int

    @property
    def optimizer_budget(self) -> Optional[int]:
        """What is left for the optimizer: the device_budget_bytes to give SwapOptimizer."""
        return None if self.device is None else self.device - self.headroom - 2 * self.params - self.activations

    @property
    def host_for_states(self) -> int:
        """Host RAM the pinned states of this host's ranks may take: RAM less the reserve."""
        return self.host - self.host_reserve

    def row(self, plan: str, settings: str, optimizer_device: Optional[int], host_state: Optional[int],
            no_plan: Optional[str] = None, **figures) -> dict:
        """A table row; optimizer_device None: no plan fits, for the reason `no_plan`.
        fits_device is None without a device size, fits_host None without a plan;
        why_not says why a row does not fit (None where it does)."""
        planned = optimizer_device is not None
        device_total = 2 * self.params + self.activations + optimizer_device if planned else None
        fits_device = None if self.device is None else planned and optimizer_device <= self.optimizer_budget
        fits_host = None if host_state is None else host_state * self.ranks_per_host <= self.host_for_states
        reasons = [no_plan] if no_plan else []
        if planned and fits_device is False:
            reasons.append(f"device: {gib(device_total)} GiB in all, more than {gib(self.device - self.headroom)} "
                           f"GiB ({gib(self.device)} less {gib(self.headroom)} headroom)")
        if fits_host is False:
            ranks = "" if self.ranks_per_host == 1 else f" x {self.ranks_per_host} ranks"
            reasons.append(f"host: {gib(host_state)} GiB pinned{ranks}, more than {gib(self.host_for_states)} GiB "
                           f"({gib(self.host)} less the {gib(self.host_reserve)} reserve)")
        return dict(plan=plan, settings=settings, params_bytes=self.params, grads_bytes=self.params,
                    activation_bytes=self.activations, optimizer_device_bytes=optimizer_device,
                    device_total_bytes=device_total, host_state_bytes=host_state, fits_device=fits_device,
                    fits_host=fits_host, why_not="; ".join(reasons) or None, **figures)


def muon_matrix(model: DecoderShape, shape: tuple[int, ...]) -> bool:
    """A param Muon takes: a 2-D matrix of a block, not an embedding (vocab or
    position rows) or the head, which go to an AdamW beside it (docs/usage.md)."""
    return len(shape) == 2 and shape[0] not in (model.vocab_size, model.max_positions or -1)


@dataclasses.dataclass(frozen=True)
class Planner:
    """One rank's params (meta tensors: nothing is allocated), the optimizer
    over them (its groups' settings decide the states) and the cost model."""

    params: list[torch.Tensor]
    whole_numels: list[int]  # unsharded sizes: 8-bit moments are decided on the whole param
    cost_model: StepCostModel
    optimizer: torch.optim.Optimizer
    optimizer_args: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def make(cls, model: DecoderShape, dtype: torch.dtype, world_size: int, cost_model: StepCostModel,
             optimizer_class: type = torch.optim.AdamW, optimizer_args: Optional[dict] = None) -> "Planner":
        shapes = [shape for shape in model.param_shapes()
                  if optimizer_class is not torch.optim.Muon or muon_matrix(model, shape)]
        params = [torch.empty(rank_shape(shape, world_size), dtype=dtype, device="meta", requires_grad=True)
                  for shape in shapes]
        args = dict(optimizer_args or {})
        return cls(params, [math.prod(shape) for shape in shapes], cost_model, optimizer_class(params, **args), args)

    @property
    def name(self) -> str:
        return type(self.optimizer).__name__

    @property
    def constructor(self) -> str:
        """The wrapped optimizer as a user writes it."""
        return f"torch.optim.{self.name}(params" + "".join(f", {k}={v!r}" for k, v in self.optimizer_args.items()) \
            + ")"

    def _wrap(self, mode: str) -> tuple:
        """SwapOptimizer's wrap of the optimizer in `mode`, made once: (the
        rule it chooses, its check_wrap passed, or None; its refusal as
        (error type, message), or None; the warnings it gives, a setting that
        does nothing here)."""
        if mode not in self._wraps:
            config = SwapOptimizerConfig(**STATE_MODES[mode])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    rule = choose_rule(self.optimizer, config)
                    rule.check_wrap(config)
                    refusal = None
                except (TypeError, ValueError) as error:
                    rule, refusal = None, (type(error), str(error))
            self._wraps[mode] = (rule, refusal, [str(w.message).removeprefix("SwapOptimizer: ") for w in caught
                                                 if str(w.message).startswith("SwapOptimizer: ")])
        return self._wraps[mode]

    @functools.cached_property
    def _wraps(self) -> dict:
        return {}

    def rule(self, mode: str):
        """The rule SwapOptimizer chooses for the optimizer in `mode`; raises
        SwapOptimizer's TypeError or ValueError where it refuses the optimizer
        or the mode."""
        rule, refusal, _ = self._wrap(mode)
        if refusal is not None:
            error_type, message = refusal
            raise error_type(message)
        return rule

    def wrap_warnings(self, mode: str) -> list[str]:
        """What SwapOptimizer warns when it wraps the optimizer in `mode` (a setting that does nothing here)."""
        return self._wrap(mode)[2]

    def refusal(self, mode: str) -> Optional[str]:
        """Why SwapOptimizer refuses the optimizer in `mode`, or None where it takes it."""
        refusal = self._wrap(mode)[1]
        return None if refusal is None else refusal[1].removeprefix("SwapOptimizer: ")

    @functools.cached_property
    def declaration(self):
        return self.rule("default").declaration

    def accepts(self, mode: str) -> bool:
        """Whether SwapOptimizer takes the optimizer in `mode`."""
        return self.refusal(mode) is None

    def torch_update(self, mode: str) -> bool:
        """Whether `mode` runs torch's own update (TorchUpdateRule), not the packed kernel."""
        return not isinstance(self.rule(mode), PackedKernelRule)

    def layouts(self, mode: str) -> list[tuple]:
        """Per param, the states torch's update rule keeps in `mode` (8-bit forms
        decided on the whole param's numel, as the rule decides on a DTensor's)."""
        if mode not in self._layouts:
            self._layouts[mode] = self.rule(mode).layouts_for(self.optimizer.param_groups, self.whole_numels)
        return self._layouts[mode]

    @functools.cached_property
    def _layouts(self) -> dict:
        return {}

    def same_store(self, mode: str) -> Optional[str]:
        """The earlier mode whose store `mode` keeps as it is under torch's update
        (its states all stay as there: Rprop's under 8-bit, Adagrad's sum under
        bf16, bf16 params' states under bf16, Kahan without 16-bit params), or None."""
        if not self.torch_update(mode):
            return None
        earlier = [m for m in STATE_MODES if m == mode or self.accepts(m)]
        return next((m for m in earlier[:earlier.index(mode)]
                     if self.torch_update(m) and self.layouts(m) == self.layouts(mode)), None)

    def modes(self) -> list[str]:
        """The state modes planned: every mode SwapOptimizer takes the optimizer
        in (the packed kernel's for Adam/AdamW, torch's update with compact
        states or Kahan for every other elementwise optimizer), less those
        that keep an earlier mode's store as it is (left_out)."""
        return [mode for mode in STATE_MODES if self.accepts(mode) and self.same_store(mode) is None]

    def left_out(self) -> dict[str, str]:
        """The modes SwapOptimizer takes that are no row: mode -> the mode whose store it keeps."""
        return {mode: same for mode in STATE_MODES if self.accepts(mode)
                for same in [self.same_store(mode)] if same is not None}

    def store_mode(self, mode: str) -> str:
        """The mode whose torch-update store `mode` has (the packed kernel's modes: default's, torch's own)."""
        return mode if self.torch_update(mode) else "default"

    def store(self, mode: str = "default") -> StoreRows:
        """The store torch's update rule lays out in `mode` (default: torch's
        own states): its keys, per param its (key, kind, unit bytes, dtype,
        shape) rows, compact scratch bytes per element and 8-bit scale keys,
        built by the rule's own store_rows."""
        mode = self.store_mode(mode)
        if mode not in self._stores:
            self._stores[mode] = store_rows(self.params, self.layouts(mode))
        return self._stores[mode]

    @functools.cached_property
    def _stores(self) -> dict:
        return {}

    def kept_names(self) -> list[str]:
        """The names of the states the store keeps (element and whole), in the store's order."""
        return self.store().keys

    def state_bytes_per_param(self, mode: str = "default") -> float:
        """Bytes of state per param element under torch's update in `mode` (default: torch's own states)."""
        numel = sum(p.numel() for p in self.params)
        rows = self.store(mode).rows
        return sum(row_bytes(kind, unit, p.numel(), True) for row, p in zip(rows, self.params)
                   for _, kind, unit, _, _ in row) / numel if numel else 0.

    def swappable(self, mode: str = "default") -> list[bool]:
        """The params SwapOptimizer may swap: those that keep a state, min_numel on the local shard, as it checks."""
        return [p.numel() >= DEFAULTS.min_numel and any(kind != "absent" for _, kind, *_ in row)
                for p, row in zip(self.params, self.store(mode).rows)]

    def lay_out(self, mode: str) -> LayOut:
        """The store's layout as the rule SwapOptimizer chooses in `mode` makes it."""
        rule = self.rule(mode)
        if self.torch_update(mode):  # torch's own update on the staged states (compact ones decoded around it)
            store = self.store(mode)
            splittable = [rule.declaration.elementwise and all(kind != "whole" for _, kind, *_ in row)
                          for row in store.rows]
            swap_keys = [True] * len(store.keys)
            temporaries = UpdateTemporaries(rule.declaration, self.optimizer.param_groups, store.rows, PLANNED_DEVICE,
                                            store.scratch)

            def lay_out_states(swappable: list, swap_times: int, num_arenas: int) -> _C.StagingSummary:
                summary = _C.summarize_rule_staging(self.params, store.rows, swappable, splittable, swap_keys,
                                                    swap_times=swap_times, num_arenas=num_arenas)
                return summary.with_update_temporary_bytes(temporaries(summary.batch_layout))
            return lay_out_states
        config = SwapOptimizerConfig(**STATE_MODES[mode])
        quantized = [n >= MIN_QUANTIZED_NUMEL for n in self.whole_numels] if config.state_dtype == torch.uint8 else []

        def lay_out(swappable: list, swap_times: int, num_arenas: int) -> _C.StagingSummary:
            summary = _C.summarize_staging(self.params, [0] * len(self.params), [False], swappable,
                                           swap_times=swap_times, num_arenas=num_arenas, state_dtype=config.state_dtype,
                                           master_weights=config.master_weights, swap_keys=config.runtime_swap_keys(),
                                           kahan_summation=config.kahan_summation, quantized_params=quantized)
            # as SwapOptimizer counts
            return summary.with_update_temporary_bytes(fused_op_table_bytes(summary.batch_layout))
        return lay_out

    def best_plan(self, mode: str, budget: int, swap_times: Optional[int], num_arenas: Optional[int]):
        """choose_for_budget's choice within `budget`, as SwapOptimizer(device_budget_bytes=budget) makes it."""
        swappable = self.swappable(mode)
        best, _ = choose_for_budget(self.lay_out(mode), swappable, range(len(swappable)), budget,
                                    swap_times=swap_times, num_arenas=num_arenas, staging_cap=None, extra_bytes=0,
                                    cost_model=self.cost_model)
        return best

    def swap_row(self, memory: Memory, plan: str, settings: str, summary: _C.StagingSummary, swap_times: int,
                 num_arenas: int, mode: str) -> dict:
        numel = sum(p.numel() for p in self.params)
        return memory.row(plan, settings, device_bytes(summary, num_arenas, 0)["total"], summary.host_state_bytes,
                          update="torch" if self.torch_update(mode) else "packed kernel",
                          state_bytes_per_param=sum(summary.param_state_bytes) / numel if numel else 0.,
                          update_temporary_bytes=summary.update_temporary_bytes,
                          swap_times=swap_times, num_arenas=num_arenas, batches=summary.batches,
                          resident_state_bytes=summary.resident_state_bytes, staging_bytes=summary.staging_bytes,
                          step_table_bytes=summary.step_table_bytes, moved_bytes_each_way=summary.moved_bytes,
                          resident_share=resident_share(summary),
                          predicted_step_seconds=self.cost_model.predict(summary, num_arenas)["seconds"])

    def rows(self, memory: Memory, dtype: torch.dtype, swap_times: Optional[int], num_arenas: Optional[int],
             state_mode: str) -> list[dict]:
        """The torch optimizer with its state resident; SwapOptimizer in each
        state mode that applies to the optimizer and `dtype` at swap_times /
        num_arenas (its defaults where None); and the device budget's plan in
        `state_mode`."""
        # torch keeps each element or whole state a tensor of the param's dtype (its scalars: 0-dim tensors);
        # its update streams them as SwapOptimizer's resident store does.
        torch_state = sum(allocated(row_bytes(kind, unit, p.numel(), True))
                          for row, p in zip(self.store().rows, self.params) for _, kind, unit, _, _ in row
                          if kind != "absent")
        all_resident = self.lay_out("default")([False] * len(self.params), 1, 2)
        rows = [memory.row(f"resident {self.name}", self.constructor, torch_state, 0,
                           update="torch", state_bytes_per_param=self.state_bytes_per_param(),
                           resident_state_bytes=torch_state, staging_bytes=0, moved_bytes_each_way=0,
                           resident_share=1.0,
                           predicted_step_seconds=self.cost_model.predict(all_resident, 2)["seconds"])]
        fixed_times = DEFAULTS.fixed_swap_times if swap_times is None else swap_times
        fixed_arenas = DEFAULTS.fixed_num_arenas if num_arenas is None else num_arenas
        for mode in self.modes():
            if mode in SIXTEEN_BIT_MODES and dtype == torch.float32:
                continue
            summary = self.lay_out(mode)(self.swappable(mode), fixed_times, fixed_arenas)
            rows.append(self.swap_row(memory, "swapped" + ("" if mode == "default" else f" {mode}"),
                                      self.settings(mode, swap_times, num_arenas), summary, fixed_times,
                                      fixed_arenas, mode))
        budget = memory.optimizer_budget
        if budget is None:  # no --device-memory: counts and bytes only
            return rows
        best = self.best_plan(state_mode, budget, swap_times, num_arenas) if budget > 0 else None
        name = "best resident share" + ("" if state_mode == "default" else f" {state_mode}")
        if best is None:
            rows.append(memory.row(name, "no plan", None, None,
                                   no_plan=self.no_plan_reason(memory, state_mode, swap_times, num_arenas)))
        else:
            rows.append(dict(self.swap_row(memory, name, self.settings(state_mode, swap_times, num_arenas, budget),
                                           best.summary, best.swap_times, best.num_arenas, state_mode),
                             resident_params=len(best.resident_params)))
        return rows

    def no_plan_reason(self, memory: Memory, mode: str, swap_times: Optional[int],
                       num_arenas: Optional[int]) -> str:
        """Why no plan fits the optimizer's budget."""
        budget = memory.optimizer_budget
        if budget <= 0:
            need = memory.headroom + 2 * memory.params + memory.activations
            return (f"no room for the optimizer: headroom {gib(memory.headroom)} + params {gib(memory.params)} + "
                    f"grads {gib(memory.params)} + activations {gib(memory.activations)} = {gib(need)} GiB, more than "
                    f"the device's {gib(memory.device)} GiB")
        least, _ = smallest_device_bytes(self.lay_out(mode), self.swappable(mode), 0, swap_times, num_arenas)
        return (f"the smallest plan (all swapped, at the finest split) takes {least:,} bytes on the device, more "
                f"than the optimizer's budget of {budget:,} bytes")

    def settings(self, mode: str, swap_times: Optional[int], num_arenas: Optional[int],
                 budget: Optional[int] = None) -> str:
        """The SwapOptimizer keywords a row stands for."""
        parts = [f"{key}={value}" for key, value in (("swap_times", swap_times), ("num_arenas", num_arenas),
                                                     ("device_budget_bytes", budget)) if value is not None]
        parts += [f"{key}={value}" for key, value in STATE_MODES[mode].items()]
        return f"SwapOptimizer({self.constructor}" + "".join(f", {part}" for part in parts) + ")"


def gib(nbytes: Optional[int]) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f}"


def seconds(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.2f} ms"


def table(rows: list[dict], device_given: bool = True) -> list[str]:
    """The rows as text; without a device size, no 'fits device' column."""
    header = ("plan", "swap_times", "arenas", "params", "grads", "res. state", "resident", "staging",
              "device total", "pinned host", "each way", "step", "fits device", "fits host")
    yes_no = {True: "yes", False: "no", None: "-"}
    cells = [header]
    for row in rows:
        rotating = row.get("batches", 0) > 0  # swap_times and num_arenas mean nothing with every state resident
        share = row.get("resident_share")
        cells.append((row["plan"], str(row["swap_times"]) if rotating else "-",
                      str(row["num_arenas"]) if rotating else "-",
                      gib(row["params_bytes"]), gib(row["grads_bytes"]), gib(row.get("resident_state_bytes")),
                      "-" if share is None else f"{share:.0%}", gib(row.get("staging_bytes")),
                      gib(row["device_total_bytes"]), gib(row["host_state_bytes"]),
                      gib(row.get("moved_bytes_each_way")), seconds(row.get("predicted_step_seconds")),
                      yes_no[row["fits_device"]], yes_no[row["fits_host"]]))
    if not device_given:
        cells = [line[:-2] + line[-1:] for line in cells]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            for line in cells]


def dtype_name(dtype: torch.dtype) -> str:
    """The --dtype name of a torch dtype."""
    return next(name for name, value in DTYPES.items() if value == dtype)


def state_names(planner: Planner) -> str:
    """The optimizer's states here, by kind, from its declaration (e.g. 'exp_avg, exp_avg_sq (element) + step
    (scalar)')."""
    kinds: dict[str, list[str]] = {}
    for group in planner.optimizer.param_groups:
        for p in group["params"]:
            for spec in planner.declaration.states(p, group):
                if spec.name not in kinds.setdefault(spec.kind, []):
                    kinds[spec.kind].append(spec.name)
    kept = [f"{', '.join(kinds[kind])} ({kind})" for kind in (ELEMENT, WHOLE) if kind in kinds]
    scalars = f"{', '.join(kinds[SCALAR])} (scalar, kept where torch keeps it)" if SCALAR in kinds else ""
    return " + ".join(part for part in (", ".join(kept), scalars) if part) or "none"


def muon_note(model: DecoderShape, planner: Planner) -> str:
    """What Muon leaves out of the plan: the params it does not take."""
    if planner.optimizer.__class__ is not torch.optim.Muon:
        return ""
    others = model.numel() - sum(planner.whole_numels)
    return (f". Muon takes the blocks' 2-D matrices only ({sum(planner.whole_numels):,} params in "
            f"{len(planner.params)} tensors): the embeddings, norms, biases and head ({others:,} params) go to an "
            "AdamW beside it, whose state these rows do not count (plan it with --optimizer adamw)")


def row_notes(rows: list[dict], dtype: torch.dtype, planner: Planner, state_mode: str = "default") -> list[str]:
    """What the rows do not say by themselves."""
    ratio = planner.state_bytes_per_param() / dtype.itemsize
    times = {1.0: "the params' bytes", 2.0: "twice the params' bytes", 3.0: "three times the params' bytes"}.get(
        ratio, f"{ratio:.3g} x the params' bytes")
    named = {row["plan"]: row for row in rows}
    if keeps_adam_step(planner.optimizer):
        kept = " and ".join(", ".join(planner.kept_names()).rsplit(", ", 1))
        notes = [f"Note: resident {planner.name} counts its state only, {kept} ({times}). torch's update allocates "
                 "more during step(): its foreach path (the default on CUDA) one more param-sized set at once "
                 "(exp_avg_sq's square root), the for-loop one param's worth, fused=True none. The swapped rows "
                 "count their update's allocations: 'swapped' runs torch's own update (an estimate of its foreach "
                 "temporaries, as memory_stats()['update_temporary_bytes'], no step table), the compact, master and "
                 "kahan rows the packed kernel (its step table and row table)."]
    elif planner.state_bytes_per_param() == 0:
        notes = [f"Note: {planner.constructor} keeps no state here: nothing to swap (SGD: momentum=0.9 through "
                 "--optimizer-args keeps a momentum_buffer)"
                 + ("; with kahan_summation=True it keeps each 16-bit param's compensation." if any(
                     mode.startswith("kahan") for mode in planner.modes()) else ".")]
    else:
        notes = [f"Note: resident {planner.name} counts its state only ({times}). torch's update allocates more "
                 "during step() (foreach intermediates, Adafactor's variance estimate, Muon's Newton-Schulz "
                 "products): the swapped rows count an estimate of them for torch's default path on CUDA "
                 "(memory_stats()['update_temporary_bytes'])"
                 + ("; the compact and kahan rows also the scratch torch's update runs on (compact states "
                    "decoded, a float32 copy of each bf16 one for 16-bit params, Kahan's float32 stand-in param "
                    "and grad)." if len(planner.modes()) > 1 else ".")]
    shown = [mode for mode in STATE_MODES if not (mode in SIXTEEN_BIT_MODES and dtype == torch.float32)]
    refused: dict[str, list[str]] = {}  # SwapOptimizer's refusal -> the modes (and their settings) it refuses so
    for mode in shown:
        if planner.refusal(mode) is not None:
            refused.setdefault(planner.refusal(mode), []).append(f"'swapped {mode}' ({settings_of(mode)})")
    notes += [f"Note: no {', '.join(modes)} row{'s' if len(modes) > 1 else ''}: SwapOptimizer refuses "
              f"{planner.name} so: {sentence(refusal)}" for refusal, modes in refused.items()]
    left_out = planner.left_out()
    for mode in shown:
        same = left_out.get(mode)
        if same is not None:
            notes.append(f"Note: no 'swapped {mode}' row: SwapOptimizer takes {planner.name} with {settings_of(mode)} "
                         f"and keeps the store of 'swapped{'' if same == 'default' else ' ' + same}' "
                         f"({', '.join(planner.store(mode).keys) or 'no state'}): the same bytes and update, as "
                         f"{same_store_reason(planner, mode, dtype)}.")
    if state_mode != "default" and not (state_mode in shown and state_mode in left_out):
        # (a left-out mode's note says them)
        notes += [f"Note: --state-mode {state_mode}: {sentence(warning)}"
                  for warning in planner.wrap_warnings(state_mode)]
    if "swapped bf16" in named and dtype != torch.float32 and \
            named["swapped bf16"]["state_bytes_per_param"] == named["swapped"]["state_bytes_per_param"]:
        change = "only their rounding (stochastic instead of to nearest)" if dtype == torch.bfloat16 else \
            "their format (bf16: fp32's range, fewer mantissa bits) and rounding (stochastic)"
        fewer = [row for row in ("8bit", "kahan+8bit") if f"swapped {row}" in named]
        notes.append(f"Note: swapped bf16 stores and moves the same bytes as swapped here: the states of "
                     f"{dtype_name(dtype)} params are 2 bytes already (kept in the param's dtype, as torch keeps "
                     f"them), and state_dtype=torch.bfloat16 changes {change}. It halves the state of fp32 params"
                     + (f"; for 16-bit params, {' and '.join(fewer)} move fewer bytes." if fewer else "."))
    return notes


def sentence(text: str) -> str:
    """`text` ending with a full stop (SwapOptimizer's messages end without one)."""
    return text if text.endswith(".") else text + "."


def settings_of(mode: str) -> str:
    """A state mode's SwapOptimizer arguments, as a user writes them."""
    return ", ".join(f"{key}={value}" for key, value in STATE_MODES[mode].items())


def same_store_reason(planner: Planner, mode: str, dtype: torch.dtype) -> str:
    """Why `mode` keeps an earlier mode's store (Planner.left_out): what
    SwapOptimizer warns at wrap time, else what the params' dtype or sizes
    leave to compact."""
    warned = planner.wrap_warnings(mode)
    if warned:
        return "SwapOptimizer warns: " + "; ".join(warned)
    if "8bit" in mode and all(numel < MIN_QUANTIZED_NUMEL for numel in planner.whole_numels):
        return f"no param has the {MIN_QUANTIZED_NUMEL} elements 8-bit states need (docs/usage.md, 'Compact states')"
    if mode == "bf16" and dtype == torch.bfloat16:
        return "the element states of bf16 params are bf16 already (docs/usage.md, 'Compact states')"
    return "every state comes out as there (docs/usage.md, 'Compact states')"


def say(text: str, first: str = "", indent: str = "    ") -> None:
    """Prints text wrapped at 118 columns (options whole)."""
    print(textwrap.fill(text, width=118, initial_indent=first, subsequent_indent=indent, break_on_hyphens=False))


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def optimizer_args(text: str) -> dict:
    """'momentum=0.9,centered=True' -> {'momentum': 0.9, 'centered': True}."""
    args = {}
    for part in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = part.partition("=")
        if not equals or not key.strip().isidentifier():
            raise ValueError(f"{part!r} is not KEY=VALUE")
        try:
            args[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"{part!r}: {value.strip()!r} is not a Python literal") from None
    return args


def make_planner(args: argparse.Namespace, parser: argparse.ArgumentParser, model: DecoderShape,
                 dtype: torch.dtype, cost_model: StepCostModel) -> Planner:
    """The planner for --optimizer, or the parser's error where SwapOptimizer (or torch) refuses it."""
    cls = OPTIMIZERS[args.optimizer]
    try:
        planner = Planner.make(model, dtype, args.world_size, cost_model, cls, args.optimizer_args)
        planner.rule("default")
    except (TypeError, ValueError) as error:
        parser.error(f"--optimizer {args.optimizer}: {error}")
    try:
        planner.rule(args.state_mode)  # SwapOptimizer's own refusal of the mode for this optimizer
    except (TypeError, ValueError) as error:
        parser.error(f"--state-mode {args.state_mode} with --optimizer {args.optimizer}: {error}")
    if args.world_size > 1 and not planner.declaration.elementwise:
        parser.error(f"--optimizer {args.optimizer} --world-size {args.world_size}: SwapOptimizer refuses "
                     f"{cls.__name__} with DTensor params (FSDP2): its update needs the whole param, each rank "
                     "holds a shard")
    return planner


def parse_args(argv: Optional[list[str]]) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="python -m swap_optimizer.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", choices=sorted(PRESETS), metavar="PRESET",
                        help=f"a model preset: {', '.join(PRESETS)}")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="the same, as an option")
    parser.add_argument("--config", metavar="PATH", help="a Hugging Face config.json (or its folder) instead")
    parser.add_argument("--device-memory", type=float, metavar="GIB",
                        help="device memory per GPU; without it, counts and bytes only (no device fit, no budget's "
                             "plan)")
    parser.add_argument("--headroom-gib", type=float, default=1.0,
                        help="device memory left free for the allocator's fragmentation and the framework (default 1)")
    parser.add_argument("--host-memory", type=float, metavar="GIB", help="host RAM (default: this machine's)")
    parser.add_argument("--host-reserve-gib", type=float, metavar="GIB",
                        help="host RAM the pinned states must leave to the OS, data loading and the processes "
                             "(default: max(2 GiB, 10%% of host RAM))")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="param dtype (default bf16)")
    parser.add_argument("--world-size", type=int, default=1, help="FSDP2 ranks sharding the params (default 1)")
    parser.add_argument("--ranks-per-host", type=int,
                        help="ranks sharing one host's RAM for the pinned states (default: the world size)")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch per rank, for the activations (default 1)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length, for the activations (default 2048)")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                        help="sdpa (flash or memory-efficient kernels: no s*s scores kept) or eager (default sdpa)")
    parser.add_argument("--activation-gib", type=float, help="the activations per rank, instead of the estimate")
    parser.add_argument("--optimizer", default="adamw", type=str.lower, choices=sorted(OPTIMIZERS), metavar="NAME",
                        help=f"the wrapped torch.optim class, lower case: {', '.join(sorted(OPTIMIZERS))} "
                             "(default adamw)")
    parser.add_argument("--optimizer-args", default="", metavar="K=V,...",
                        help="its keyword arguments, Python literals: momentum=0.9 (SGD, RMSprop), centered=True "
                             "(RMSprop), amsgrad=True (Adam, AdamW); they decide which states it keeps")
    parser.add_argument("--state-mode", choices=tuple(STATE_MODES), default="default",
                        help="the state form of the 'best resident share' row (default: the param's dtype, as torch); "
                             "bf16, 8bit, kahan and kahan+8bit: every elementwise optimizer; master: Adam and AdamW "
                             "only")
    parser.add_argument("--link-gbps", type=float, default=25.0,
                        help="host<->device GB/s each way (default 25: PCIe Gen4 x16, effective)")
    parser.add_argument("--link-both-gbps", type=float,
                        help=f"GB/s both ways at once (default {BOTH_WAYS_FACTOR}x --link-gbps)")
    parser.add_argument("--update-gbps", type=float, default=1000.0,
                        help="GB/s of state the fused update processes (default 1000: a datacenter GPU)")
    parser.add_argument("--swap-times", type=int, help="batches per step (default: 16; the budget's row chooses)")
    parser.add_argument("--num-arenas", type=int, help="staging arenas (default: 2; the budget's row chooses)")
    parser.add_argument("--json", metavar="PATH", help="write the header and rows to this file")
    args = parser.parse_args(argv)
    if sum(x is not None for x in (args.model, args.preset, args.config)) != 1:
        parser.error("name one model: a preset (positional or --preset) or --config PATH/config.json")
    try:
        args.optimizer_args = optimizer_args(args.optimizer_args)
    except ValueError as error:
        parser.error(f"--optimizer-args: {error}")
    for name in ("world_size", "batch", "seq", "swap_times"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_arenas is not None and args.num_arenas < 2:
        parser.error("--num-arenas must be >= 2")
    if args.ranks_per_host is not None and not 1 <= args.ranks_per_host <= args.world_size:
        parser.error("--ranks-per-host must be between 1 and --world-size")
    for name in ("device_memory", "link_gbps", "update_gbps", "link_both_gbps", "host_memory"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    for name in ("headroom_gib", "activation_gib", "host_reserve_gib"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    return args, parser


def main(argv: Optional[list[str]] = None) -> int:
    args, parser = parse_args(argv)
    if args.config is not None:
        try:
            model, title = from_hf_config(args.config), args.config
        except (OSError, ValueError) as error:
            parser.error(str(error))
        description = f"{model.model_type}, vocab {model.vocab_size}, hidden {model.hidden_size}, " \
                      f"{model.num_layers} layers, {'tied' if model.tie_word_embeddings else 'separate'} lm_head"
    else:
        title = args.model or args.preset
        description, model = PRESETS[title]
    description = f"{title}: {description}"
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    link = args.link_gbps * 1e9
    both = args.link_both_gbps * 1e9 if args.link_both_gbps else BOTH_WAYS_FACTOR * link
    cost_model = StepCostModel(link, link, both, args.update_gbps * 1e9, BATCH_SECONDS, STEP_SECONDS)
    planner = make_planner(args, parser, model, dtype, cost_model)
    numel, rank_numel = sum(planner.whole_numels), sum(p.numel() for p in planner.params)
    estimated = args.activation_gib is None
    activations = activation_bytes(model, args.batch, args.seq, itemsize, args.attention) if estimated \
        else int(args.activation_gib * GIB)
    host = int(args.host_memory * GIB) if args.host_memory else host_memory_bytes()
    reserve = host_reserve_bytes(host) if args.host_reserve_gib is None else int(args.host_reserve_gib * GIB)
    if reserve >= host:
        parser.error(f"--host-reserve-gib: {gib(reserve)} GiB leaves nothing of {gib(host)} GiB of host RAM")
    device = None if args.device_memory is None else int(args.device_memory * GIB)
    memory = Memory(device, int(args.headroom_gib * GIB), host, reserve, args.ranks_per_host or args.world_size,
                    rank_numel * itemsize, activations)
    rows = planner.rows(memory, dtype, args.swap_times, args.num_arenas, args.state_mode)
    per_param = planner.state_bytes_per_param()

    if estimated:
        eager = " + 5*a*s*s*b" if args.attention == "eager" else ""
        activation_note = (f"an estimate for micro-batch {args.batch} x seq {args.seq}, {args.attention} attention: "
                           f"34*s*b*h{eager} bytes per 16-bit layer (Korthikanti et al., no recomputation) + fp32 "
                           "logits and their grad; --activation-gib to set it")
    else:
        activation_note = "given: --activation-gib"
    model_bytes = f"params {gib(memory.params)} + grads {gib(memory.params)} + activations {gib(activations)} " \
                  f"({activation_note})"
    if device is None:
        device_line = (f"device: {model_bytes} = {gib(2 * memory.params + activations)} GiB before the optimizer; "
                       "no --device-memory, so no device fit and no budget's plan")
    else:
        device_line = (f"device: {gib(device)} GiB = headroom {gib(memory.headroom)} + {model_bytes} + the "
                       f"optimizer's budget {gib(memory.optimizer_budget)} GiB")
    reserve_note = "given" if args.host_reserve_gib is not None else \
        "max(2 GiB, 10%), for the OS, data loading and the processes themselves; --host-reserve-gib to change"
    header = [
        f"model: {description}",
        f"params: {numel:,} ({args.dtype}) in {len(planner.params)} tensors; world size {args.world_size}"
        + ("" if args.world_size == 1 else f" (FSDP2, dim 0 sharded): {rank_numel:,} per rank; FSDP2's all-gathered "
           "blocks come out of the headroom") + "; every figure is per rank",
        device_line,
        f"host RAM: {gib(host)} GiB ({'given' if args.host_memory else 'this machine, --host-memory to change'}) less "
        f"a reserve of {gib(reserve)} GiB ({reserve_note}) leaves {gib(memory.host_for_states)} GiB for the pinned "
        f"states of {memory.ranks_per_host} rank(s)",
        f"cost model (assumed, not measured): {cost_model.describe()}. Defaults: 25 GB/s each way (PCIe Gen4 x16, "
        f"effective), {BOTH_WAYS_FACTOR}x that both at once, 1000 GB/s update (a datacenter GPU); --link-gbps, "
        "--link-both-gbps, --update-gbps",
        f"optimizer: {planner.constructor}: states {state_names(planner)}: {per_param:.4g} bytes of state per param "
        f"({args.dtype}, as torch keeps them); SwapOptimizer runs torch's own update on them"
        + (", the packed kernel in the other state modes" if not all(map(planner.torch_update, planner.modes()))
           else ", in every state mode (compact states decoded into a scratch around it)"
           if len(planner.modes()) > 1 else "")
        + muon_note(model, planner),
        f"{planner.name}, min_numel {DEFAULTS.min_numel}. 'swapped' rows: swap_times "
        f"{args.swap_times or DEFAULTS.fixed_swap_times}, num_arenas {args.num_arenas or DEFAULTS.fixed_num_arenas} "
        "(SwapOptimizer's defaults unless --swap-times, --num-arenas), one per state form"
        + (" (master and kahan need 16-bit params)" if dtype == torch.float32 else "")
        + ("." if device is None else f". 'best resident share': the plan device_budget_bytes = the optimizer's budget "
           f"chooses ({args.state_mode} states): the fastest predicted one that fits, keeping params' states resident "
           "in param order."),
    ]
    for line in header:
        say(line)
    print()
    print("\n".join(table(rows, device_given=device is not None)))
    print()
    say("GiB. res. state: states on the device; staging: arenas and step table during step(); each way: bytes copied "
        "to the device and back per step; step: the predicted optimizer step; fits host: pinned host x ranks <= host "
        "RAM less the reserve.", indent="")
    for row in rows:
        print(f"  {row['plan']}: {row['settings']}")
        if row["why_not"]:
            say(f"does not fit: {row['why_not']}", first=" " * 6, indent=" " * 8)
    notes = row_notes(rows, dtype, planner, args.state_mode)
    for note in notes:
        say(note)
    if device is None:
        say("For whether each plan fits the device, and the plan a device budget chooses (best resident share), pass "
            "--device-memory GIB.")
    elif rows[-1]["optimizer_device_bytes"] is None:
        say(f"No plan fits {gib(device)} GiB ({rows[-1]['why_not']}); shard with --world-size, lower the activations, "
            "or use a larger device.")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(dict(model=title, params=numel, rank_params=rank_numel, dtype=args.dtype,
                           optimizer=dict(name=planner.name, args={k: repr(v) for k, v in args.optimizer_args.items()},
                                          states=state_names(planner), state_bytes_per_param=per_param,
                                          planned_params=sum(planner.whole_numels)),
                           world_size=args.world_size, memory=dataclasses.asdict(memory),
                           optimizer_budget_bytes=memory.optimizer_budget, activations_estimated=estimated,
                           cost_model=dataclasses.asdict(cost_model), header=header, rows=rows, notes=notes),
                      out, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
