"""The device budget: which params keep their state resident, and swap_times
and num_arenas, chosen by a cost model of one step to be the fastest plan that
fits in the device bytes the user gives (docs/design.md, "Device budget")."""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from .devices import DeviceLike, resolve_device

if TYPE_CHECKING:
    from ._C import StagingSummary  # what _C.summarize_staging and _C.summarize_rule_staging return

# torch's CUDA caching allocator rounds every block up to a multiple of this,
# and max_memory_allocated counts the rounded sizes.
ALLOCATOR_GRANULE = 512
# Swap counts the planner tries (up to the finest split worth asking for):
# finer steps where a batch more changes the most.
_SWAP_TIMES_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
# Past the ladder (thousands of batches, each paying a fixed cost far above
# its copy of 64 KiB) counts double, up to the finest split, and are weighed
# only when nothing on the ladder fits.
_ARENA_CHOICES = (2, 3, 4)
# Params the planner tries one by one, with a plan each, after its greedy fill.
_EXACT_TRIES = 16
_LINK_PROBE_BYTES = 32 << 20


def allocated(nbytes: int) -> int:
    """Device bytes an allocation of `nbytes` takes, as the allocator counts it."""
    return 0 if nbytes <= 0 else -(-nbytes // ALLOCATOR_GRANULE) * ALLOCATOR_GRANULE


@functools.lru_cache(maxsize=None)
def _measured_link(device: torch.device) -> tuple[float, float, float]:
    from . import _C
    return _C.measure_copy_bandwidth(device, _LINK_PROBE_BYTES, 3)


_UPDATE_PROBE_NUMEL = 1 << 21  # an fp32 param of 8 MiB: 16 MiB of AdamW state (8x on a GPU)


@functools.lru_cache(maxsize=None)
def _measured_update(device: torch.device) -> float:
    """Bytes of state the fused AdamW update goes through per second on
    `device` (median of 3 calls on one packed arena)."""
    from .ops import fused_adam_packed, plan_packed_layout
    numel = _UPDATE_PROBE_NUMEL * (8 if device.type == "cuda" else 1)  # on a GPU, long enough to outlast a launch
    generator = torch.Generator(device=device).manual_seed(0)  # the global one is the user's
    param = torch.randn(numel, device=device, generator=generator)
    grad = torch.randn(numel, device=device, generator=generator)
    layout, arena_bytes = plan_packed_layout([param])
    arena = torch.zeros(arena_bytes, dtype=torch.uint8, device=device)
    steps = torch.zeros(1, dtype=torch.float32, device=device)
    timings = []
    for _ in range(4):  # the first call warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fused_adam_packed([param], [grad], arena, layout, steps, lr=1e-3)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - start)
    return arena_bytes / max(statistics.median(timings[1:]), 1e-9)


@dataclass(frozen=True)
class StepCostModel:
    """What one step costs: the link's bandwidths (bytes per second host to
    device, device to host, and both directions at once in all), the update's
    throughput (bytes of staged state updated per second), and a fixed cost per
    batch (copy set-up and launches) and per step (the step table, events).

    StepCostModel.for_device(device) measures the link (through the runtime's
    own transport) and the fused AdamW update once per process, and takes the
    fixed costs from defaults; pass your own to SwapOptimizer(cost_model=...)
    to plan for other figures."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    both_bytes_per_s: float
    update_bytes_per_s: float
    batch_seconds: float
    step_seconds: float

    def __post_init__(self) -> None:
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "both_bytes_per_s", "update_bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(f"StepCostModel.{name} must be a positive finite number, got {value!r}")
        for name in ("batch_seconds", "step_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise ValueError(f"StepCostModel.{name} must be a finite number >= 0, got {value!r}")

    # The fixed costs are defaults: a batch costs a few copies and kernel
    # launches (on the CPU backend, hand-offs between threads).
    @classmethod
    def for_device(cls, device: DeviceLike) -> "StepCostModel":
        """Measured on `device` ("cuda" is the current GPU, "cuda:N" that one)."""
        device = resolve_device(device)
        h2d, d2h, both = _measured_link(device)
        update = _measured_update(device)
        if device.type == "cuda":
            return cls(h2d, d2h, both, update_bytes_per_s=update, batch_seconds=20e-6, step_seconds=100e-6)
        return cls(h2d, d2h, both, update_bytes_per_s=update, batch_seconds=50e-6, step_seconds=200e-6)

    def describe(self) -> str:
        return (f"link {self.h2d_bytes_per_s / 1e9:.1f} GB/s in, {self.d2h_bytes_per_s / 1e9:.1f} GB/s out, "
                f"{self.both_bytes_per_s / 1e9:.1f} GB/s both at once; update {self.update_bytes_per_s / 1e9:.1f} "
                f"GB/s of state; {self.batch_seconds * 1e6:.0f} us per batch, {self.step_seconds * 1e6:.0f} us "
                "per step")

    def predict(self, summary: StagingSummary, num_arenas: int) -> dict:
        """Predicted seconds of one step of the store layout `summary`
        (summarize_staging's), replaying the pipeline's order: batch b is
        copied in once the arena of batch b - num_arenas is copied out, updated
        once copied in, copied out once updated; with 2 arenas copies in and
        out share one queue, with 3 or more they run on two, sharing the link's
        both-ways bandwidth while both move. The resident batch updates first,
        beside the first copies in."""
        rotating = [b for b in summary.batch_layout if not b["resident"]]
        # Resident batches (one per group) use the store at absolute offsets: the last one ends where it does.
        resident = max((b["arena_bytes"] for b in summary.batch_layout if b["resident"]), default=0)
        compute_free = resident / self.update_bytes_per_s + (self.batch_seconds if resident else 0.0)
        update_seconds = compute_free
        shared_queue = min(num_arenas, len(rotating)) < 3  # as the runtime: two queues from 3 arenas in use
        rate_in, rate_out = self.h2d_bytes_per_s, self.d2h_bytes_per_s
        if not shared_queue:  # both directions move at once for most of the step
            both = self.h2d_bytes_per_s + self.d2h_bytes_per_s
            rate_in, rate_out = (min(self.h2d_bytes_per_s, self.both_bytes_per_s * self.h2d_bytes_per_s / both),
                                 min(self.d2h_bytes_per_s, self.both_bytes_per_s * self.d2h_bytes_per_s / both))
        in_free = out_free = 0.0
        unstaged: list[float] = []
        updated: list[float] = []
        staged: list[float] = []

        def copy_in(b: int) -> None:
            nonlocal in_free, out_free
            start = max(out_free if shared_queue else in_free, unstaged[b - num_arenas] if b >= num_arenas else 0.0)
            end = start + rotating[b]["host_bytes"] / rate_in + self.batch_seconds
            staged.append(end)
            if shared_queue:
                out_free = end
            else:
                in_free = end

        def update_and_copy_out(b: int) -> None:
            nonlocal compute_free, out_free, update_seconds
            seconds = rotating[b]["arena_bytes"] / self.update_bytes_per_s + self.batch_seconds
            compute_free = max(compute_free, staged[b]) + seconds
            update_seconds += seconds
            updated.append(compute_free)
            out_free = max(out_free, compute_free) + rotating[b]["host_bytes"] / rate_out + self.batch_seconds
            unstaged.append(out_free)

        ahead = min(num_arenas, len(rotating))
        for b in range(ahead):
            copy_in(b)
        for b in range(len(rotating)):
            update_and_copy_out(b)
            if b + ahead < len(rotating):
                copy_in(b + ahead)
        moved = sum(b["host_bytes"] for b in rotating)
        seconds = max([compute_free, out_free, in_free]) + self.step_seconds
        return dict(seconds=seconds, update_seconds=update_seconds,
                    link_seconds=moved / self.h2d_bytes_per_s + moved / self.d2h_bytes_per_s)


def device_bytes(summary: StagingSummary, num_arenas: int, extra_bytes: int) -> dict:
    """The device bytes a plan takes, as the budget counts them: the resident
    store, min(num_arenas, batches) arenas, the step table (each one
    allocation, rounded as the allocator rounds), what the update allocates
    beside them where the plan's summary says (torch's temporaries; the fused
    Adam op's device table), and `extra_bytes` (contiguous copies of strided
    params and their grads, GradScaler's clones)."""
    arenas = min(num_arenas, summary.batches) * allocated(summary.largest_arena_bytes)
    parts = dict(resident_state=allocated(summary.resident_state_bytes), arenas=arenas,
                 step_table=allocated(summary.step_table_bytes),
                 update_temporaries=summary.update_temporary_bytes, copies=extra_bytes)
    parts["total"] = sum(parts.values())
    return parts


def resident_share(summary: StagingSummary) -> float:
    """Device state bytes / all state bytes (min_numel and state_keys residents
    included; exact element bytes, without the regions' alignment)."""
    total = sum(summary.param_state_bytes)
    return 1.0 - summary.swapped_state_bytes / total if total else 1.0


@dataclass
class BudgetChoice:
    """One plan the planner weighed: its settings, the params it keeps
    resident beyond min_numel and state_keys, its device bytes and predicted
    step time."""

    swap_times: int
    num_arenas: int
    swappable: list[bool]
    resident_params: tuple[int, ...]
    summary: StagingSummary = field(repr=False)
    device: dict = field(repr=False)
    prediction: dict = field(repr=False)

    @property
    def row(self) -> dict:
        return dict(swap_times=self.swap_times, num_arenas=self.num_arenas,
                    resident_share=resident_share(self.summary), resident_params=len(self.resident_params),
                    batches=self.summary.batches, predicted_step_seconds=self.prediction["seconds"],
                    device_bytes=self.device["total"], moved_bytes_each_way=self.summary.moved_bytes)


LayOut = Callable[[list[bool], int, int], "StagingSummary"]


def evaluate(lay_out: LayOut, swappable: list[bool], swap_times: int, num_arenas: int, base: Sequence[bool],
             extra_bytes: int, cost_model: StepCostModel) -> BudgetChoice:
    summary = lay_out(swappable, swap_times, num_arenas)
    # Past the finest split the plan is the finest one: name it by that count.
    swap_times = max(1, min(swap_times, summary.finest_swap_times))
    return BudgetChoice(swap_times, num_arenas, list(swappable),
                        tuple(i for i, (b, s) in enumerate(zip(base, swappable)) if b and not s), summary,
                        device_bytes(summary, num_arenas, extra_bytes), cost_model.predict(summary, num_arenas))


def _fill(lay_out: LayOut, base: list[bool], start: list[bool], priority: Sequence[int], budget: int,
          swap_times: int, num_arenas: int, staging_cap: Optional[int], extra_bytes: int,
          cost_model: StepCostModel) -> Optional[BudgetChoice]:
    """The plan at (swap_times, num_arenas) that keeps resident the params
    `start` does not swap and then, in priority order, every param whose state
    still fits beside the staging; None if none fits."""
    swappable = list(start)
    choice = evaluate(lay_out, swappable, swap_times, num_arenas, base, extra_bytes, cost_model)
    candidates = [i for i in priority if swappable[i]]
    # Over the staging cap or the budget: params kept resident shrink the
    # arenas (with num_arenas near swap_times, by about what they take).
    while True:
        over_cap = staging_cap is not None and choice.summary.staging_bytes > staging_cap
        if not over_cap and choice.device["total"] <= budget:
            break
        if not candidates:
            return None
        swappable[candidates.pop(0)] = False
        trial = evaluate(lay_out, swappable, swap_times, num_arenas, base, extra_bytes, cost_model)
        if not over_cap and trial.device["total"] >= choice.device["total"]:
            return None  # residents no longer pay for themselves
        choice = trial
    state_bytes = choice.summary.param_state_bytes
    added: list[int] = []
    for _ in range(3):  # adding residents shrinks the arenas, which may make room for more
        room = budget - choice.device["total"]
        grown = False
        for i in candidates:
            # A param's regions in the resident store are 256-byte aligned: one
            # more alignment per state at most (8 keys).
            need = state_bytes[i] + 8 * 256
            if swappable[i] and need <= room:
                swappable[i] = False
                added.append(i)
                room -= need
                grown = True
        if not grown:
            break
        trial = evaluate(lay_out, swappable, swap_times, num_arenas, base, extra_bytes, cost_model)
        while trial.device["total"] > budget:  # a re-balanced split may need larger arenas: give back the last ones
            swappable[added.pop()] = True
            trial = evaluate(lay_out, swappable, swap_times, num_arenas, base, extra_bytes, cost_model)
        choice = trial
    # What a resident param costs beyond its states (torch's update temporaries
    # for the resident batch's call, a larger arena) shows only in a plan:
    # params given back above, or passed over, are tried one by one.
    tries = 0
    for i in candidates:
        if not swappable[i] or state_bytes[i] + 8 * 256 > budget - choice.device["total"]:
            continue
        if tries == _EXACT_TRIES:
            break
        tries += 1
        swappable[i] = False
        trial = evaluate(lay_out, swappable, swap_times, num_arenas, base, extra_bytes, cost_model)
        if trial.device["total"] <= budget:
            choice = trial
        else:
            swappable[i] = True
    return choice


def swap_times_ladder(finest: int) -> tuple[list[int], list[int]]:
    """(the counts weighed first, those weighed only if none of them fits)."""
    first = sorted({s for s in _SWAP_TIMES_LADDER if s < finest} | ({finest} if finest <= _SWAP_TIMES_LADDER[-1]
                                                                     else set()) | {1})
    rest, count = [], _SWAP_TIMES_LADDER[-1] * 2
    while count < finest:
        rest.append(count)
        count *= 2
    return first, rest + ([finest] if finest > _SWAP_TIMES_LADDER[-1] else [])


def choose_for_budget(lay_out: LayOut, base: list[bool], priority: Sequence[int], budget: int, *,
                      swap_times: Optional[int], num_arenas: Optional[int], staging_cap: Optional[int],
                      extra_bytes: int, cost_model: StepCostModel) -> tuple[Optional[BudgetChoice], list[BudgetChoice]]:
    """(the plan with the least predicted step time within `budget`, every
    plan weighed). swap_times / num_arenas, when given, are kept; the others
    are searched over a ladder of counts and 2-4 arenas. `base` says which
    params may be swapped at all (min_numel, contiguity, state kept); the
    planner keeps more of them resident, in `priority` order."""
    finest = lay_out(list(base), 1, 2).finest_swap_times
    counts, more_counts = ([swap_times], []) if swap_times is not None else swap_times_ladder(finest)
    arenas = [num_arenas] if num_arenas is not None else list(_ARENA_CHOICES)
    weighed: list[BudgetChoice] = []
    seen = set()

    def weigh(start: list[bool]) -> None:
        for a in arenas:
            for s in counts:
                choice = _fill(lay_out, base, start, priority, budget, s, a, staging_cap, extra_bytes, cost_model)
                if choice is None:
                    continue
                key = (choice.summary.batches, min(a, max(1, choice.summary.batches)),
                       choice.resident_params, choice.summary.largest_arena_bytes)
                if key not in seen:  # the same layout under another count (all resident, or past the finest split)
                    seen.add(key)
                    weighed.append(choice)

    def fastest() -> BudgetChoice:
        return min(weighed, key=lambda c: (round(c.prediction["seconds"], 9), c.device["total"], c.swap_times,
                                           c.num_arenas))

    weigh(list(base))
    for count in more_counts if not weighed else []:  # finer, the first that fits: later ones only add batches
        counts = [count]
        weigh(list(base))
        if weighed:
            break
    if not weighed:
        return None, []
    # Filling greedily at each count may keep a large param resident at one
    # count and not at another: the best residents are tried at every count.
    weigh(fastest().swappable)
    return fastest(), weighed


def smallest_device_bytes(lay_out: LayOut, base: list[bool], extra_bytes: int, swap_times: Optional[int],
                          num_arenas: Optional[int]) -> tuple[int, int]:
    """(the least device bytes a plan keeping only the `base` residents takes
    at the given or the finest counts, the bytes of those residents alone),
    for the error when a budget is too small."""
    finest = lay_out(list(base), 1, 2).finest_swap_times
    least = None
    residents = 0
    for a in [num_arenas] if num_arenas is not None else [2]:
        for s in [swap_times] if swap_times is not None else range(max(1, finest - 2), finest + 1):
            summary = lay_out(list(base), s, a)
            total = device_bytes(summary, a, extra_bytes)
            residents = total["resident_state"]
            least = total["total"] if least is None else min(least, total["total"])
    return least, residents


class PlanReport(dict):
    """plan_report()'s dict, which prints as a table."""

    def __str__(self) -> str:
        lines = [f"device budget: {self['budget_bytes'] if self['budget_bytes'] is not None else 'none'} bytes; "
                 f"cost model: {self['cost_model']}"]
        header = ("", "swap_times", "num_arenas", "resident share", "batches", "moved each way (B)",
                  "device bytes", "predicted step (ms)", "fits")
        rows = [header]
        for name, row in [("chosen", self["chosen"])] + [("neighbour", r) for r in self["neighbours"]]:
            rows.append((name, str(row["swap_times"]), str(row["num_arenas"]), f"{row['resident_share']:.1%}",
                         str(row["batches"]), str(row["moved_bytes_each_way"]), str(row["device_bytes"]),
                         f"{row['predicted_step_seconds'] * 1e3:.3f}", "yes" if row["fits"] else "no"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
        lines += [f"advice: {line}" for line in self["advice"]]
        return "\n".join(lines)


def neighbours(lay_out: LayOut, chosen: BudgetChoice, base: list[bool], budget: Optional[int], extra_bytes: int,
               cost_model: StepCostModel) -> list[BudgetChoice]:
    """The plans next to `chosen`: half and twice its swap_times, one arena
    fewer and more, no extra resident param, and (with a budget) every
    candidate resident kept resident."""
    finest = chosen.summary.finest_swap_times
    out = []

    def layout_key(c: BudgetChoice) -> tuple:
        return (c.summary.batches, c.summary.largest_arena_bytes, min(c.num_arenas, c.summary.batches))

    for s, a in ((chosen.swap_times // 2, chosen.num_arenas), (chosen.swap_times * 2, chosen.num_arenas),
                 (chosen.swap_times, chosen.num_arenas - 1), (chosen.swap_times, chosen.num_arenas + 1)):
        if 1 <= s <= max(1, finest) and a >= 2:
            other = evaluate(lay_out, chosen.swappable, s, a, base, extra_bytes, cost_model)
            if layout_key(other) != layout_key(chosen):  # not the same plan under another count
                out.append(other)
    if chosen.resident_params:
        out.append(evaluate(lay_out, list(base), chosen.swap_times, chosen.num_arenas, base, extra_bytes, cost_model))
    return out


def report(chosen: BudgetChoice, others: list[BudgetChoice], budget: Optional[int], cost_model: StepCostModel,
           advice: list[str]) -> PlanReport:
    def row(choice: BudgetChoice) -> dict:
        values = choice.row
        values["fits"] = budget is None or choice.device["total"] <= budget
        values["device_bytes_by_part"] = dict(choice.device)
        return values
    return PlanReport(budget_bytes=budget, cost_model=cost_model.describe(), chosen=row(chosen),
                      neighbours=[row(c) for c in others], advice=advice)


def fused_op_table_bytes(plan: Sequence[dict]) -> int:
    """A bound on the device table the fused Adam op's CUDA kernel copies up
    for its call on a batch (csrc/kernels/cuda/fused_adam_cuda.cu: per row a
    step reference, step scalars and a descriptor of at most 136 bytes, 8
    bytes per chunk of 16,384 elements, the 8-bit code maps, alignment), for
    the largest batch, twice: the next call's table may be allocated before the
    last one's is freed in stream order."""
    largest = 0
    for batch in plan:
        rows = len(batch["pieces"])
        chunks = sum(-(-count // 16384) for _, _, count in batch["pieces"])
        largest = max(largest, 1024 + 164 * rows + 8 * chunks + 2048)
    return 2 * allocated(largest) if plan else 0


def copy_bytes(params: Sequence[torch.Tensor], amp_clones: bool) -> int:
    """Device bytes beyond the stores that a step may hold at once: contiguous
    copies of a strided param and its grad (only resident params are strided;
    counted for all of them, as one call may hold them together), and
    GradScaler's scale and inf flag cloned for the step."""
    strided = sum(2 * allocated(p.numel() * p.element_size()) for p in params if not p.is_contiguous())
    return strided + (2 * ALLOCATOR_GRANULE if amp_clones else 0)


def choice_for_budget(config, budget: int, lay_out: LayOut, base: list[bool], extra_bytes: int,
                      device: torch.device, priority: Optional[Sequence[int]] = None) -> BudgetChoice:
    """The plan for a device budget (config.device_budget_bytes, or what
    "auto" made of it): the fastest predicted one that fits; refuses, saying
    what takes the room, when none does."""
    cost_model = config.cost_model or StepCostModel.for_device(device)
    priority = range(len(base)) if priority is None else priority
    best, _ = choose_for_budget(lay_out, base, priority, budget, swap_times=config.swap_times,
                                num_arenas=config.num_arenas, staging_cap=config.staging_budget_bytes,
                                extra_bytes=extra_bytes, cost_model=cost_model)
    if best is not None:
        return best
    least, residents = smallest_device_bytes(lay_out, base, extra_bytes, config.swap_times, config.num_arenas)
    if residents + extra_bytes > budget:
        raise ValueError(f"SwapOptimizerConfig.device_budget_bytes={budget} is too small: the states that "
                         f"min_numel={config.min_numel} and state_keys keep on the device alone take {residents} "
                         f"bytes (with {extra_bytes} bytes of contiguous copies and GradScaler clones); raise the "
                         "budget, lower min_numel, or let state_keys swap more states")
    cap = "" if config.staging_budget_bytes is None else \
        f" (and staging_budget_bytes={config.staging_budget_bytes} caps the staging)"
    at = "at the finest split" if config.swap_times is None else f"at swap_times={config.swap_times}"
    raise ValueError(f"SwapOptimizerConfig.device_budget_bytes={budget} is too small{cap}: the smallest plan takes "
                     f"{least} bytes (the resident states, arenas {at}, pieces of at least 64 KiB, the step table "
                     "and copies); raise the budget" + ("" if config.swap_times is None else
                                                        ", or leave swap_times to the planner"))


def budget_stats(stats: dict, planning: "Planning", auto: Optional["AutoBudget"]) -> dict:
    """memory_stats()'s entries for the device budget and the plan."""
    stats["resident_share"] = resident_share(planning.summary)
    stats["device_budget_bytes"] = planning.budget
    if auto is not None:
        stats["auto_budget"] = dict(warmup_steps=auto.warmup_steps, headroom_bytes=auto.headroom_bytes,
                                    measured=auto.measured)
    choice = planning.choice
    if choice is not None:
        stats["plan"] = dict(swap_times=choice.swap_times, num_arenas=choice.num_arenas,
                             resident_params=list(choice.resident_params),
                             predicted_step_seconds=choice.prediction["seconds"],
                             device_bytes=dict(choice.device))
    return stats


@dataclass
class Planning:
    """How a store was planned, for memory_stats() and plan_report():
    `lay_out` weighs a plan of the current params, `base` says which may be
    swapped at all, `choice` is the budget's plan (None without a budget)."""

    lay_out: LayOut
    base: list[bool]
    copy_bytes: int
    budget: Optional[int]
    choice: Optional[BudgetChoice]
    swap_times: int
    num_arenas: int
    # (chosen plan, cost model) -> advice on compact states, which only the user may choose
    advice: Callable[[BudgetChoice, StepCostModel], list[str]] = lambda chosen, cost_model: []

    @classmethod
    def make(cls, config, budget: Optional[int], lay_out: LayOut, base: list[bool], copies: int,
             device: torch.device, staging_budget_swap_times: Callable[[], int], advice=None,
             priority: Optional[Sequence[int]] = None) -> "Planning":
        """The plan for `config` and a device budget (None: none yet): the
        budget's choice (keeping params resident in `priority` order, else
        param order), staging_budget_bytes's swap_times, or the settings as
        given."""
        swap_times, num_arenas = config.fixed_swap_times, config.fixed_num_arenas
        choice = None
        if budget is not None:
            choice = choice_for_budget(config, budget, lay_out, base, copies, device, priority)
            swap_times, num_arenas = choice.swap_times, choice.num_arenas
        elif config.staging_budget_bytes is not None and config.swap_times is None:  # ("auto" before its budget)
            swap_times = staging_budget_swap_times()
        return cls(lay_out, base, copies, budget, choice, swap_times, num_arenas,
                   **({} if advice is None else dict(advice=advice)))

    @property
    def swappable(self) -> list[bool]:
        return self.base if self.choice is None else self.choice.swappable

    @functools.cached_property
    def summary(self) -> StagingSummary:
        """The summary of the plan the store follows."""
        if self.choice is not None:
            return self.choice.summary
        return self.lay_out(self.swappable, self.swap_times, self.num_arenas)

    def report(self, config, device: torch.device) -> PlanReport:
        cost_model = config.cost_model or StepCostModel.for_device(device)
        chosen = evaluate(self.lay_out, self.swappable, self.swap_times, self.num_arenas, self.base,
                          self.copy_bytes, cost_model)
        others = neighbours(self.lay_out, chosen, self.base, self.budget, self.copy_bytes, cost_model)
        return report(chosen, others, self.budget, cost_model, self.advice(chosen, cost_model))


_log = logging.getLogger("swap_optimizer")


@dataclass
class AutoBudget:
    """device_budget_bytes="auto": counts the steps; at the step after the
    warm-up, derives the budget once from what the device has free."""

    warmup_steps: int
    headroom_bytes: int
    steps_seen: int = 0
    measured: Optional[dict] = None  # what the budget was derived from, once it was
    # Tests: {free_bytes, peak_bytes, allocated_bytes} in place of the device's.
    simulated: Optional[dict] = None

    def due(self) -> bool:
        """Counts a step about to run: True for the one after the warm-up."""
        due = self.measured is None and self.steps_seen == self.warmup_steps
        self.steps_seen += 1
        return due

    def derive(self, device: torch.device, held_bytes: int) -> Optional[int]:
        """The budget: what the device could still allocate (free memory and
        the allocator's cached blocks) plus what is allocated now, less the
        peak of the warm-up iterations (params, grads, activations and this
        optimizer's staging where they met) net of the `held_bytes` this
        optimizer holds throughout (its resident store), less the headroom.
        Every rank takes the least of all ranks'. None where nothing was
        measured (the CPU backend, without a simulation)."""
        device = resolve_device(device)
        if self.simulated is not None:
            free, peak, now = (self.simulated[k] for k in ("free_bytes", "peak_bytes", "allocated_bytes"))
        elif device.type == "cuda":
            from . import _C
            free, peak = _C.free_device_bytes(device), torch.cuda.max_memory_allocated(device)
            now = torch.cuda.memory_allocated(device)
        else:
            free = peak = now = None
        budget = self.least_over_ranks(-1 if free is None else
                                       max(0, now + free - (peak - held_bytes) - self.headroom_bytes), device)
        self.measured = dict(at_step=self.steps_seen, free_bytes=free, peak_bytes=peak, allocated_bytes=now,
                             held_bytes=held_bytes, budget_bytes=None if budget < 0 else budget)
        return None if budget < 0 else budget

    @staticmethod
    def least_over_ranks(value: int, device: DeviceLike) -> int:
        """The least `value` of all ranks of the default process group (every
        rank must reach this step with an "auto" optimizer); `value` alone
        without torch.distributed."""
        device = resolve_device(device)
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return value
        on = device if device.type == "cuda" and torch.distributed.get_backend() == "nccl" else "cpu"
        least = torch.tensor([value], dtype=torch.int64, device=on)
        torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
        return int(least.item())
