"""python -m swap_optimizer.bench --host-overhead: what the host costs around
the update and around the forward.

On a GPU the update of a batch takes microseconds and the link milliseconds,
so the Python around each batch and each module call decides whether a step
runs at the link's floor. Tiny tensors on the CPU backend stand in for a
launch-bound GPU: every figure is a ratio to the plain run (the wrapped
optimizer alone, the forward without overlap's hooks) measured side by side
in the same process, round by round, with the min and median over rounds.

- step(): each optimizer path (the packed kernel, torch's update of a
  declared optimizer, the learned path of one vouched for) over a shape set
  (1000 params of 64 elements; GPT-2 124M's 148 tensors shrunk, counts kept):
  ms a step at swap_times 16, the ratio, and the extra time split into
  microseconds per batch (from a second run at swap_times 4) and per param
  (the rest), from each run's fastest round; and a floor: the plain optimizer
  with a param group per batch, whose step calls torch's update once per
  batch as any per-batch update must, with no swapping.
- overlap_forward: a model of tiny ops (24 x LayerNorm, Linear(64), GELU), its
  forward (no grad) with the hooks idle and with a pass pending (the step done,
  so every wait finds its batch ready and only the checks cost, the pass kept
  on as for a step in flight): the model's own forward, its blocks called from
  a script loop, and another model's forward while the pass is pending; and
  the own and another model's forward once the pass retires (its first check
  finds the step done). The pending pass is armed (its params watch
  themselves); the same three pending rows again with the hooks and the read
  watch, the pass a model that cannot arm keeps. Floor rows, overlap's hooks off: the own and the other
  model under a torch function mode that only calls each op, its
  __torch_function__ in C (`_C.torch_function_call_through`), and the own
  forward with global module hooks that do nothing: what torch itself charges
  any read watch and any module hook, before either does anything.
- compact states: the step of a SwapOptimizer whose states are bf16 or 8-bit
  against the same SwapOptimizer with the default states, over 8 params of
  500k elements at swap_times 8 (one thread: the CPU loops' own speed), for
  the packed kernel (AdamW) and torch's update with the codec ops (SGD with
  momentum).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import types
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import _C
from ..optimizer import SwapOptimizer
from ..overlap import hooks_suspended
from ..presets import PRESETS

SWAP_TIMES = 16
COARSER_SWAP_TIMES = 4  # a second batching, to split the extra time into per batch and per param
WIDTH = 64  # the tiny ops' width, and the elements of each param of the "1000 x 64" set
BLOCKS = 24
SHRINK = 16  # GPT-2 124M's dims divided by this (counts kept)


class Lion(torch.optim.Optimizer):
    """Lion written by hand: an optimizer SwapOptimizer has no declaration
    for, wrapped on the user's word (its states learned at each param's
    first update); one param-shaped state, elementwise."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def grad_of(self, p):
        return p.grad

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = self.grad_of(p)
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = state["exp_avg"].mul(beta1).add_(grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                state["exp_avg"].mul_(beta2).add_(grad, alpha=1 - beta2)


# name -> (the wrapped optimizer over params, SwapOptimizer settings it needs)
OPTIMIZER_PATHS: dict[str, tuple[Callable, dict]] = {
    "AdamW fused (torch's update)": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), {}),
    "AdamW foreach (torch's update)": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), {}),
    "AdamW bf16 states (packed kernel)": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
                                          dict(state_dtype=torch.bfloat16)),
    "SGD momentum foreach": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True), {}),
    "NAdam foreach": (lambda ps: torch.optim.NAdam(ps, lr=1e-3, foreach=True), {}),
    "Adafactor": (lambda ps: torch.optim.Adafactor(ps, lr=1e-2), {}),
    "Lion (vouched for, learned)": (lambda ps: Lion(ps, lr=1e-4),
                                    dict(trust_per_param_step=True, trust_elementwise_step=True)),
}


# name -> the wrapped optimizer, for the compact states' rows
COMPACT_PATHS: dict[str, Callable] = {
    "AdamW (packed kernel)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "SGD momentum (torch's update, codec ops)": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
}
COMPACT_STATES = {"bf16": torch.bfloat16, "8-bit": torch.uint8}
COMPACT_PARAMS, COMPACT_SWAP_TIMES = 8, 8


def gpt2_shrunk_shapes() -> list[tuple[int, ...]]:
    """GPT-2 124M's param shapes (148 tensors), each dim divided by SHRINK."""
    return [tuple(max(1, -(-dim // SHRINK)) for dim in shape) for shape in PRESETS["gpt2-124m"][1].param_shapes()]


SHAPE_SETS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "1000 x 64": lambda: [(WIDTH,)] * 1000,
    "GPT-2 124M shrunk": gpt2_shrunk_shapes,
}


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values)}


def _make_params(shapes: list[tuple[int, ...]], device: torch.device) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=generator).to(device)) for shape in shapes]


def _seconds_per_step(optimizer, steps: int, device: torch.device) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps


def _rounds(optimizers: dict, rounds: int, steps: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds a step of each optimizer, a round each in turn, per measured
    round; round 0 warms up (a vouched-for optimizer learns there)."""
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for number in range(rounds + 1):
        measured = {name: _seconds_per_step(optimizer, steps, device) for name, optimizer in optimizers.items()}
        if number:
            for name, seconds in measured.items():
                times[name].append(seconds)
    return times


def _groups_per_batch(params: list[nn.Parameter], batches: int) -> list[dict]:
    """The params in order, cut into `batches` param groups of about equal
    elements, whole params: as many groups as the runtime's batches, so that
    a step makes as many calls of torch's update (the runtime cuts large
    params across batches; the groups hold them whole)."""
    total = sum(p.numel() for p in params)
    groups: list[list[nn.Parameter]] = [[]]
    elements = 0
    for p in params:
        if groups[-1] and elements >= total * len(groups) / batches and len(groups) < batches:
            groups.append([])
        groups[-1].append(p)
        elements += p.numel()
    return [{"params": group} for group in groups]


def measure_step(path: str, shapes: list[tuple[int, ...]], device: torch.device, rounds: int, steps: int) -> dict:
    """One optimizer path over one shape set: the plain optimizer and its
    SwapOptimizer (swap_times 16, every param swapped) on the same params and
    fixed grads, a round each in turn after a warm-up round. The floor: the
    plain optimizer with one param group per batch, so that its step calls
    torch's update once per batch as the SwapOptimizer must, with no swapping."""
    make, settings = OPTIMIZER_PATHS[path]
    plain_params, swapped_params, floor_params = (_make_params(shapes, device) for _ in range(3))
    generator = torch.Generator().manual_seed(1)
    for p, q, f in zip(plain_params, swapped_params, floor_params):
        p.grad = torch.randn(p.shape, generator=generator).to(device)
        q.grad, f.grad = p.grad.clone(), p.grad.clone()
    plain = make(plain_params)
    per_batch_groups = make(_groups_per_batch(floor_params, SWAP_TIMES))
    # (a second SwapOptimizer with fewer batches tells the cost of a batch from that of a param)
    swapped, coarser = (SwapOptimizer(make(ps), swap_times=swap_times, min_numel=0, **settings)
                        for ps, swap_times in ((swapped_params, SWAP_TIMES), (_make_params(shapes, device),
                                                                               COARSER_SWAP_TIMES)))
    for p, q in zip(swapped_params, coarser.param_groups[0]["params"]):
        q.grad = p.grad.clone()
    times = {name: [seconds * 1e6 for seconds in measured] for name, measured in
             _rounds({"plain": plain, "swapped": swapped, "coarser": coarser, "floor": per_batch_groups}, rounds,
                     steps, device).items()}
    batches, coarser_batches = (o.memory_stats()["batches"] for o in (swapped, coarser))
    # The extra time a step, split into a cost per batch (from the two batch
    # counts) and the rest per param, from each run's fastest round (the one
    # least disturbed by anything else on the machine).
    plain_us, swapped_us, coarser_us = (min(times[name]) for name in ("plain", "swapped", "coarser"))
    per_batch = (swapped_us - coarser_us) / (batches - coarser_batches) if batches != coarser_batches else 0.0
    return {"path": path, "params": len(shapes), "batches": batches,
            "plain_ms": _summary([t / 1e3 for t in times["plain"]]),
            "swapped_ms": _summary([t / 1e3 for t in times["swapped"]]),
            "ratio": _summary([b / a for a, b in zip(times["plain"], times["swapped"])]),
            "floor_ratio": _summary([b / a for a, b in zip(times["plain"], times["floor"])]),
            "extra_us_per_param": (swapped_us - plain_us - batches * per_batch) / len(shapes),
            "extra_us_per_batch": per_batch}


def measure_compact(path: str, device: torch.device, rounds: int, steps: int, numel: int) -> dict:
    """One optimizer with the default states and with each compact form, on
    the same params and grads, a round each in turn after a warm-up round."""
    shapes = [(numel // COMPACT_PARAMS,)] * COMPACT_PARAMS
    optimizers = {}
    for name, state_dtype in {"default": None, **COMPACT_STATES}.items():
        params = _make_params(shapes, device)
        generator = torch.Generator().manual_seed(1)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(device)
        settings = {} if state_dtype is None else {"state_dtype": state_dtype}
        optimizers[name] = SwapOptimizer(COMPACT_PATHS[path](params), swap_times=COMPACT_SWAP_TIMES, min_numel=0,
                                         **settings)
    times = {name: [seconds * 1e3 for seconds in measured]
             for name, measured in _rounds(optimizers, rounds, steps, device).items()}
    row = {"path": path, "elements": numel, "default_ms": _summary(times["default"])}
    for name in COMPACT_STATES:
        row[name] = {"ms": _summary(times[name]),
                     "ratio": _summary([b / a for a, b in zip(times["default"], times[name])])}
    return row


class TinyOpBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.linear, self.act = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(self.norm(x)))


def tiny_op_model(device: torch.device, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[TinyOpBlock() for _ in range(BLOCKS)]).to(device)


# situation -> (what it runs: "own" forward, a "loop" over its blocks, or the
# "other" model's forward; whether a pass is pending; whether it keeps watching
# once every batch is updated; whether it keeps the hooks and the read watch
# where it could arm its params). The step is done before each forward: pending
# situations that keep watching measure what the checks cost while a step is in
# flight, whose batches are ready (no wait blocks); the others what a forward
# costs once the pass retires (its first check finds the step done).
SITUATIONS = {
    "hooks idle": ("own", False, False, False),
    "pending, own forward": ("own", True, True, False),
    "pending, script loop": ("loop", True, True, False),
    "pending, another model": ("other", True, True, False),
    "step done, own forward": ("own", True, False, False),
    "step done, another model": ("other", True, False, False),
    "hooks and mode: pending, own forward": ("own", True, True, True),
    "hooks and mode: pending, script loop": ("loop", True, True, True),
    "hooks and mode: pending, another model": ("other", True, True, True),
}
# floor situation -> (what it runs, under what: a CallThroughMode, or a global
# forward pre-hook and hook that do nothing), overlap's hooks off, no step
# pending: what torch itself charges any read watch and any module hook.
FLOOR_SITUATIONS = {
    "floor: a mode that only calls each op, own forward": ("own", "mode"),
    "floor: a mode that only calls each op, another model": ("other", "mode"),
    "floor: global module hooks that do nothing, own forward": ("own", "hooks"),
}


@contextlib.contextmanager
def _floor(under: str):
    if under == "mode":
        with CallThroughMode():
            yield
        return
    handles = [nn.modules.module.register_module_forward_pre_hook(lambda module, args: None),
               nn.modules.module.register_module_forward_hook(lambda module, args, output: None, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class CallThroughMode(TorchFunctionMode):
    """A torch function mode whose __torch_function__ only calls the op, in C
    (no Python frame of its own): the cost of any read watch's mode."""

    def __init__(self) -> None:
        super().__init__()
        # (torch takes a mode's __torch_function__ only as a method bound to the mode)
        self.__torch_function__ = types.MethodType(_C.torch_function_call_through, self)


def measure_forward(device: torch.device, rounds: int, repeats: int) -> list[dict]:
    """The tiny-op model's forward (no grad) in each situation against the same
    forward with overlap's hooks suspended, a sample of each per round after
    the same training step (so that caches start alike)."""
    model, other = tiny_op_model(device, 0), tiny_op_model(device, 1)
    x = torch.randn(8, WIDTH, device=device)
    optimizer = SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), swap_times=4, min_numel=0,
                              model=model, overlap_forward=True)

    def forward(kind: str) -> None:
        with torch.no_grad():
            if kind == "own":
                model(x)
            elif kind == "loop":
                y = x
                for block in model:
                    y = block(y)
            else:
                other(x)

    def timed(kind: str) -> float:
        start = time.perf_counter()
        forward(kind)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def step(pending: bool) -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer._runtime.synchronize()  # the step is done; a pending pass still checks every call
        if not pending:
            optimizer.wait()

    for _ in range(2):  # the first step's next forward is the probe's (it makes the wait schedule)
        step(False)
    samples: dict[str, dict[str, list[float]]] = {name: {"plain": [], "overlap": []}
                                                  for name in [*SITUATIONS, *FLOOR_SITUATIONS]}
    for number in range(rounds + 1):  # round 0 warms up (and runs the probe)
        for name, (kind, under) in FLOOR_SITUATIONS.items():
            plain, floor = [], []
            for _ in range(repeats):  # each forward right after a step, as in SITUATIONS
                step(False)
                with hooks_suspended():
                    plain.append(timed(kind))
                step(False)
                with hooks_suspended(), _floor(under):
                    floor.append(timed(kind))
            if number:
                samples[name]["plain"].append(statistics.median(plain))
                samples[name]["overlap"].append(statistics.median(floor))
        for name, (kind, pending, keep_watching, mode_watch) in SITUATIONS.items():
            plain, overlap = [], []
            for _ in range(repeats):
                step(False)
                with hooks_suspended():
                    plain.append(timed(kind))
                optimizer._overlap.set_test_hooks(keep_watching=keep_watching, mode_watch=mode_watch)
                step(pending)
                overlap.append(timed(kind))
            if number:
                samples[name]["plain"].append(statistics.median(plain))
                samples[name]["overlap"].append(statistics.median(overlap))
    optimizer.wait()
    calls = sum(1 for _ in model.modules())  # module calls of one forward (the Sequential included)
    rows = []
    for name, runs in samples.items():
        ratios = [b / a for a, b in zip(runs["plain"], runs["overlap"])]
        extra = statistics.median([(b - a) * 1e6 for a, b in zip(runs["plain"], runs["overlap"])])
        rows.append({"situation": name, "plain_ms": _summary([s * 1e3 for s in runs["plain"]]),
                     "overlap_ms": _summary([s * 1e3 for s in runs["overlap"]]), "ratio": _summary(ratios),
                     "extra_us_per_module_call": extra / calls})
    return rows


def run(device: torch.device, rounds: int, steps: int, paths: list[str], shape_sets: list[str],
        progress: Callable[[str], None] = lambda line: None, compact_elements: int = 4_000_000) -> dict:
    """Every measurement: {"step": rows, "forward": rows, "compact": rows}, on one CPU thread
    (torch's intra-op threads on tiny tensors add their own noise; the host
    backend's copy and update threads still run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step_rows = []
        for shape_set in shape_sets:
            shapes = SHAPE_SETS[shape_set]()
            for path in paths:
                progress(f"step(): {path}, {shape_set}")
                step_rows.append(dict(measure_step(path, shapes, device, rounds, steps), shapes=shape_set))
        progress("overlap_forward: the tiny-op model")
        forward_rows = measure_forward(device, rounds, repeats=steps)
        compact_rows = []
        for path in COMPACT_PATHS:
            progress(f"compact states: {path}")
            compact_rows.append(measure_compact(path, device, rounds, steps, compact_elements))
    finally:
        torch.set_num_threads(threads)
    return {"step": step_rows, "forward": forward_rows, "compact": compact_rows, "rounds": rounds,
            "steps_per_round": steps, "swap_times": SWAP_TIMES, "torch_threads": 1}


def step_table(rows: list[dict]) -> str:
    lines = ["| shapes | optimizer path | batches | plain ms | SwapOptimizer ms | ratio (median / min) | "
             "floor: a group per batch, no swap (median / min) | extra us per param | extra us per batch |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['shapes']} | {r['path']} | {r['batches']} | {r['plain_ms']['median']:.2f} | "
                     f"{r['swapped_ms']['median']:.2f} | {r['ratio']['median']:.2f} / {r['ratio']['min']:.2f} | "
                     f"{r['floor_ratio']['median']:.2f} / {r['floor_ratio']['min']:.2f} | "
                     f"{r['extra_us_per_param']:.1f} | {r['extra_us_per_batch']:.1f} |")
    return "\n".join(lines)


def forward_table(rows: list[dict]) -> str:
    lines = ["| situation | plain ms | overlap ms (floor rows: under the mode or hooks) | "
             "ratio (median / min) | extra us per module call |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['situation']} | {r['plain_ms']['median']:.3f} | {r['overlap_ms']['median']:.3f} | "
                     f"{r['ratio']['median']:.2f} / {r['ratio']['min']:.2f} | {r['extra_us_per_module_call']:.1f} |")
    return "\n".join(lines)


def compact_table(rows: list[dict]) -> str:
    header = "".join(f" {name} ms | {name} ratio (median / min) |" for name in COMPACT_STATES)
    lines = [f"| optimizer path | elements | default ms |{header}",
             "| --- | ---: | ---: |" + " ---: | ---: |" * len(COMPACT_STATES)]
    for r in rows:
        cells = "".join(f" {r[name]['ms']['median']:.2f} | {r[name]['ratio']['median']:.2f} / "
                        f"{r[name]['ratio']['min']:.2f} |" for name in COMPACT_STATES)
        lines.append(f"| {r['path']} | {r['elements']:,} | {r['default_ms']['median']:.2f} |{cells}")
    return "\n".join(lines)
