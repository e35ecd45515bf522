"""Runs the benchmark's modes side by side and measures each one.

A mode is one optimizer set-up on a fresh copy of the same model: resident
(torch's fused AdamW), SwapOptimizer at one (swap_times, num_arenas, master
weights) setting, possibly with a device budget that keeps a target share of its
state resident, or a peer (torchao's CPUOffloadOptimizer, when importable).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from .. import _C
from ..devices import resolve_device
from ..optimizer import SwapOptimizer
from ..overlap import hooks_suspended
from .model import GPT, GPTConfig

LR = 3e-4


@dataclass(frozen=True)
class Mode:
    name: str
    kind: str  # "resident", "swap" or "torchao"
    swap_times: int = 0
    num_arenas: int = 0
    master_weights: bool = False
    state: str = "default"  # a key of STATE_MODES
    overlap: bool = False   # overlap_forward=True: the step runs beside the next forward
    optimizer: str = "adamw"  # a key of OPTIMIZERS
    target_share: Optional[float] = None  # a device budget keeping this share of the swappable state resident


# The optimizers --optimizer picks: (class, hyper-parameters). The resident
# mode runs the class itself (AdamW fused, the others torch's default path).
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=LR)),
    "sgd": (torch.optim.SGD, dict(lr=LR, momentum=0.9)),
    "adagrad": (torch.optim.Adagrad, dict(lr=LR)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=LR)),
    "adadelta": (torch.optim.Adadelta, dict(lr=LR)),
    "adamax": (torch.optim.Adamax, dict(lr=LR)),
    "nadam": (torch.optim.NAdam, dict(lr=LR)),
    "radam": (torch.optim.RAdam, dict(lr=LR)),
    "asgd": (torch.optim.ASGD, dict(lr=LR)),
    "rprop": (torch.optim.Rprop, dict(lr=LR)),
    "adafactor": (torch.optim.Adafactor, dict(lr=LR)),
    # Muon steps the blocks' weight matrices; a plain AdamW, resident in every
    # mode, steps the embeddings, norms and biases (MuonWithAdamW).
    "muon": (torch.optim.Muon, dict(lr=LR)),
}

# How a swap mode stores its state: SwapOptimizer fields ("default": as torch).
STATE_MODES = {
    "default": {},
    "bf16": dict(state_dtype=torch.bfloat16),
    "8bit": dict(state_dtype=torch.uint8),
    "kahan+bf16": dict(state_dtype=torch.bfloat16, kahan_summation=True),
    "kahan+8bit": dict(state_dtype=torch.uint8, kahan_summation=True),
}


@dataclass
class Bandwidth:
    """Bytes per second through the runtime's own transport and host memory."""

    host_to_device: float
    device_to_host: float
    both_directions: float

    def floor_seconds(self, h2d_bytes: int, d2h_bytes: int, two_way: bool) -> float:
        """The least time the link needs to move these bytes: one after the other
        on one copy stream, or both directions at once on two."""
        one_way = h2d_bytes / self.host_to_device + d2h_bytes / self.device_to_host
        if not two_way:
            return one_way
        return max(h2d_bytes / self.host_to_device, d2h_bytes / self.device_to_host,
                   (h2d_bytes + d2h_bytes) / self.both_directions)


@dataclass
class Result:
    mode: Mode
    peak_train_bytes: int
    peak_step_bytes: int
    step_seconds: float
    train_seconds: float
    h2d_bytes: int
    d2h_bytes: int
    host_bytes: int
    floor_seconds: Optional[float]
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        row = {"mode": self.mode.name, "kind": self.mode.kind, "overlap": self.mode.overlap,
               "swap_times": self.mode.swap_times,
               "num_arenas": self.mode.num_arenas, "master_weights": self.mode.master_weights,
               "state": self.mode.state, "target_share": self.mode.target_share,
               "peak_train_bytes": self.peak_train_bytes, "peak_step_bytes": self.peak_step_bytes,
               "step_ms": self.step_seconds * 1e3, "train_step_ms": self.train_seconds * 1e3,
               "h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes, "host_bytes": self.host_bytes,
               "floor_ms": None if self.floor_seconds is None else self.floor_seconds * 1e3,
               "step_over_floor": None if not self.floor_seconds else self.step_seconds / self.floor_seconds}
        row.update(self.extra)
        return row


def torchao_offload_class():
    """torchao's CPUOffloadOptimizer, or None when torchao is not installed."""
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        return None
    return CPUOffloadOptimizer


def make_modes(device: torch.device, dtype: torch.dtype, swap_times: list[int], num_arenas: list[int],
               states: tuple[str, ...] = ("default",), overlap: bool = False, optimizer: str = "adamw",
               resident_shares: Sequence[float] = ()) -> list[Mode]:
    """Resident, then each swap setting (with overlap: followed by its
    overlapped twin), then one swap mode per resident share at the first
    swap_times and num_arenas (default state, no overlap: the share is all
    that changes), then peers. Master weights, compact states and the torchao
    peer are AdamW's only."""
    adamw = optimizer == "adamw"
    modes = [Mode("resident", "resident", optimizer=optimizer)]
    for state in states:
        masters = [False, True] if dtype != torch.float32 and state == "default" and adamw else [False]
        for master in masters:
            for arenas in num_arenas:
                for times in swap_times:
                    suffix = ("+master" if master else "") + ("" if state == "default" else f" {state}")
                    modes.append(Mode(f"swap s{times} a{arenas}{suffix}", "swap", times, arenas, master, state,
                                      optimizer=optimizer))
                    if overlap:
                        modes.append(replace(modes[-1], name=modes[-1].name + " overlap", overlap=True))
    for share in resident_shares:
        modes.append(Mode(f"swap s{swap_times[0]} a{num_arenas[0]} share {share:g}", "swap", swap_times[0],
                          num_arenas[0], optimizer=optimizer, target_share=share))
    if device.type == "cuda" and adamw and torchao_offload_class() is not None:
        modes.append(Mode("torchao CPUOffloadOptimizer", "torchao"))
    return modes


def measure_bandwidth(device: torch.device, nbytes: int, repeats: int) -> Bandwidth:
    return Bandwidth(*_C.measure_copy_bandwidth(resolve_device(device), nbytes, repeats))


class Timer:
    """Wall time of a region: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, work: Callable[[], None]) -> Callable[[], float]:
        """Runs work; returns a function that gives its seconds once read."""
        if not self.cuda:
            start = time.perf_counter()
            work()
            seconds = time.perf_counter() - start
            return lambda: seconds
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        work()
        end.record()
        return lambda: (end.synchronize(), begin.elapsed_time(end) / 1e3)[1]


class MuonWithAdamW:
    """Muon's usual recipe: Muon (plain, or a SwapOptimizer) for the blocks'
    weight matrices beside a resident fused AdamW for the rest; stepped,
    zeroed and measured as one optimizer (the swap modes' stats are Muon's,
    with AdamW's state counted as resident)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw

    @property
    def state(self) -> dict:
        return {**self.muon.state, **self.adamw.state}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def wait(self) -> None:
        if isinstance(self.muon, SwapOptimizer):
            self.muon.wait()

    def memory_stats(self) -> dict:
        stats = dict(self.muon.memory_stats())
        stats["resident_state_bytes"] += resident_state_bytes(self.adamw)
        return stats


def budget_for_share(probe: SwapOptimizer, share: float) -> int:
    """The device budget that keeps about `share` of the swappable state
    resident at the probe's swap_times and num_arenas: the device bytes of the
    probe's plan (nothing resident beyond min_numel and state_keys) plus that
    share of the state it swaps (its host store less the step table), twice
    for torch's update, which makes a param's states on the device at its
    first step before they go into the store (the budget counts them). The
    planner fills the room param by param, and what it adds shrinks the
    arenas, so the share it reaches is near the target, not equal."""
    stats = probe.memory_stats()
    swappable_bytes = stats["host_state_bytes"] - stats["step_table_bytes"]
    made_at_first_step = "swapped_state_keys" in stats  # (torch's update reports its swapped keys)
    return probe.plan_report()["chosen"]["device_bytes"] + round(share * swappable_bytes) * (1 + made_at_first_step)


def swap_optimizer(make_inner: Callable[[], torch.optim.Optimizer], mode: Mode, **fields) -> SwapOptimizer:
    """SwapOptimizer over make_inner() at the mode's swap_times and num_arenas;
    with a target share, under the budget read off a probe built without one
    (unpinned: the plan does not depend on it, and pinning a large store takes
    seconds)."""
    settings = dict(fields, swap_times=mode.swap_times, num_arenas=mode.num_arenas)
    if mode.target_share is not None:
        probe = SwapOptimizer(make_inner(), **settings, pin_memory=False)
        settings["device_budget_bytes"] = budget_for_share(probe, mode.target_share)
    return SwapOptimizer(make_inner(), **settings)


def _muon_and_adamw(mode: Mode, model: GPT) -> MuonWithAdamW:
    matrices = [p for name, p in model.named_parameters() if p.dim() == 2 and not name.endswith("embedding.weight")]
    taken = {id(p) for p in matrices}
    adamw = torch.optim.AdamW([p for p in model.parameters() if id(p) not in taken], lr=LR, fused=True)
    if mode.kind == "swap":
        return MuonWithAdamW(swap_optimizer(lambda: torch.optim.Muon(matrices, lr=LR), mode), adamw)
    return MuonWithAdamW(torch.optim.Muon(matrices, lr=LR), adamw)


def build_optimizer(mode: Mode, model: GPT):
    if mode.optimizer == "muon" and mode.kind in ("resident", "swap"):
        return _muon_and_adamw(mode, model)
    cls, hyper = OPTIMIZERS[mode.optimizer]
    if mode.kind == "resident":
        return cls(model.parameters(), **hyper, **(dict(fused=True) if mode.optimizer == "adamw" else {}))
    if mode.kind == "torchao":
        return torchao_offload_class()(model.parameters(), torch.optim.AdamW, lr=LR, fused=True)
    fields = STATE_MODES[mode.state] or (dict(master_weights=mode.master_weights,
                                              state_dtype=torch.float32 if mode.master_weights else None)
                                         if mode.optimizer == "adamw" else {})
    if mode.overlap:
        fields = dict(fields, model=model, overlap_forward=True)
    return swap_optimizer(lambda: cls(model.parameters(), **hyper), mode, **fields)


def resident_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the state tensors a plain torch optimizer keeps per param after
    the timed steps (0-dim scalars such as step counts left out)."""
    return sum(value.numel() * value.element_size() for entry in optimizer.state.values()
               for value in entry.values() if torch.is_tensor(value) and value.dim() > 0)


def time_training_loop(model: GPT, optimizer, tokens: torch.Tensor, timer: "Timer",
                       iterations: int) -> tuple[float, Optional[int]]:
    """Seconds per training step (zero_grad, forward and backward, step) over
    `iterations` back to back, synchronised once at the end: an overlapped
    step runs beside the next forward, which a sync per step would forbid.
    And on CUDA the loop's peak torch.cuda.max_memory_allocated: with the host
    running ahead, as in training, what an overlapped step still holds during
    the next forward and backward shows there (None on the CPU)."""
    cuda = tokens.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(tokens.device)
        torch.cuda.reset_peak_memory_stats(tokens.device)

    def loop():
        for _ in range(iterations):
            optimizer.zero_grad(set_to_none=True)
            model.loss(tokens).backward()
            optimizer.step()
        if isinstance(optimizer, (SwapOptimizer, MuonWithAdamW)):
            optimizer.wait()  # the last step's end (CUDA: a stream wait, inside the timed region)
    seconds = timer(loop)() / iterations  # reading the timer synchronises
    return seconds, torch.cuda.max_memory_allocated(tokens.device) if cuda else None


def time_overlap_checks(model: GPT, optimizer: SwapOptimizer, tokens: torch.Tensor, timer: "Timer",
                        repeats: int) -> dict:
    """What overlap_forward's checks cost a forward (no grad), as medians of
    interleaved runs: the plain forward (its global hooks suspended), with the
    hooks installed and nothing pending, and in a pass whose step has already
    finished (every call is compared with the probe's and its waits find
    their batches ready). Seconds on the device (the timer) and of the host
    call (no sync), medians of up to 5 rounds."""
    def forward():
        with torch.no_grad():
            model(tokens[:, :-1])

    def timed():
        start = time.perf_counter()
        elapsed = timer(forward)
        return time.perf_counter() - start, elapsed

    def finished_pass():
        optimizer.zero_grad(set_to_none=True)
        model.loss(tokens).backward()
        optimizer.step()
        optimizer._runtime.synchronize()  # the step is done; the pass still checks every call

    samples = {"plain": [], "hooks_idle": [], "pass_pending": []}
    for _ in range(min(repeats, 5) + 1):  # the first round warms up; 5 rounds: each costs 3 training steps
        for key in samples:  # each after the same step, so that caches start alike
            finished_pass()
            if key != "pass_pending":
                optimizer.wait()
            with hooks_suspended() if key == "plain" else contextlib.nullcontext():
                samples[key].append(timed())
    optimizer.wait()
    return {key: {"host": statistics.median(host for host, _ in runs[1:]),
                  "device": statistics.median(device() for _, device in runs[1:])}
            for key, runs in samples.items()}


def record_timeline(model: GPT, optimizer: SwapOptimizer, tokens: torch.Tensor, cuda: bool) -> dict:
    """One step and the next forward and backward, with each batch's copies and
    update (the runtime's stamps) and each block's forward, in seconds after
    step() began."""
    optimizer._set_timeline(True)
    blocks, handles = [], []

    def mark():
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    for index, block in enumerate(model.blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=index: blocks.append([i, mark(), None])))
        handles.append(block.register_forward_hook(lambda m, a, o, i=index: blocks[-1].__setitem__(2, mark())))
    try:
        optimizer.zero_grad(set_to_none=True)
        model.loss(tokens).backward()  # the grads of the step below; its blocks are not plotted
        if cuda:
            torch.cuda.synchronize()
        blocks.clear()
        begin = mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.loss(tokens).backward()
        optimizer.wait()
        if cuda:
            torch.cuda.synchronize()
        spans = optimizer._timeline()
    finally:
        for handle in handles:
            handle.remove()
        optimizer._set_timeline(False)
    seconds = (lambda mark_: begin.elapsed_time(mark_) / 1e3) if cuda else (lambda mark_: mark_ - begin)
    spans += [dict(lane="forward", batch=i, start=seconds(start), end=seconds(end)) for i, start, end in blocks]
    return {"spans": spans}


def run_mode(mode: Mode, config: GPTConfig, dtype: torch.dtype, device: torch.device, batch_size: int,
             warmup: int, repeats: int, bandwidth: Bandwidth, loop: bool = False,
             timeline: bool = False) -> Result:
    """Measures one mode. loop: also the back-to-back training step time
    (time_training_loop); timeline: also record_timeline (swap modes)."""
    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: a 1.3B model initialised on the CPU takes minutes
        model = GPT(config).to(dtype=dtype)
    tokens = torch.randint(0, config.vocab, (batch_size, config.seq_len + 1), device=device,
                           generator=torch.Generator(device=device).manual_seed(1))
    timer = Timer(device)
    cuda = device.type == "cuda"
    optimizer = build_optimizer(mode, model)

    def forward_backward():
        model.loss(tokens).backward()

    def optimizer_step():
        optimizer.step()

    step_times, train_times, train_peaks, step_peaks = [], [], [], []
    for iteration in range(warmup + repeats):
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        backward_seconds = timer(forward_backward)
        if cuda:
            backward_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        step_seconds = timer(optimizer_step)
        if cuda:
            torch.cuda.synchronize(device)
            step_peak = torch.cuda.max_memory_allocated(device)
            train_peaks.append(max(backward_peak, step_peak))
            step_peaks.append(step_peak)
        if iteration >= warmup:
            step_times.append(step_seconds())
            train_times.append(backward_seconds() + step_times[-1])

    h2d = d2h = host = 0
    extra = {}
    if loop:
        seconds, extra["loop_peak_bytes"] = time_training_loop(model, optimizer, tokens, timer, repeats)
        extra["loop_step_ms"] = seconds * 1e3
    if mode.overlap:
        extra["forward_seconds"] = time_overlap_checks(model, optimizer, tokens, timer, repeats)
    if timeline and mode.kind == "swap":
        extra["timeline"] = record_timeline(model, optimizer, tokens, cuda)
    two_way = False
    if mode.kind == "swap":
        stats = optimizer.memory_stats()
        h2d, d2h, host = stats["h2d_bytes"], stats["d2h_bytes"], stats["host_state_bytes"]
        two_way = stats["num_arenas"] >= 3
        extra.update({"peak_staging_bytes": stats["peak_staging_bytes"],
                      "resident_state_bytes": stats["resident_state_bytes"],
                      "bytes_per_param_each_way": stats["bytes_per_param_each_way"],
                      "batches": stats["batches"], "arenas_used": stats["num_arenas"], "pinned": stats["pinned"],
                      "step_table_bytes": stats["step_table_bytes"], "resident_share": stats["resident_share"]})
        if mode.target_share is not None:
            extra.update({"device_budget_bytes": stats["device_budget_bytes"], "plan": stats["plan"],
                          "predicted_step_ms": stats["plan"]["predicted_step_seconds"] * 1e3})
    elif mode.kind == "torchao":
        # It moves grads to the host and updated params back, and keeps fp32 params and states there.
        numel = sum(p.numel() for p in model.parameters())
        h2d = d2h = numel * dtype.itemsize
        host = numel * 4 * 3
        two_way = True

    if cuda:
        peak_train, peak_step = max(train_peaks), max(step_peaks)
    else:
        # The runtime's own accounting: params, grads and what the optimizer keeps
        # on the "device" (the CPU here); activations are not counted.
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if mode.kind == "swap":
            on_device = extra["peak_staging_bytes"] + extra["resident_state_bytes"]
        else:
            on_device = resident_state_bytes(optimizer)
        peak_train = peak_step = 2 * model_bytes + on_device
    # An overlapped step() only enqueues: its time says nothing against the copy floor.
    # The copy floor bounds a step that streams its state; a sweep row updates part of it resident, and has
    # the cost model's prediction instead.
    floor = bandwidth.floor_seconds(h2d, d2h, two_way) if (h2d or d2h) and not mode.overlap \
        and mode.target_share is None else None
    return Result(mode, peak_train, peak_step, statistics.median(step_times), statistics.median(train_times),
                  h2d, d2h, host, floor, extra)
