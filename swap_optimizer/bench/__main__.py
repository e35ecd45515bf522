"""python -m swap_optimizer.bench: peak device memory and step time of
SwapOptimizer against resident AdamW, the copy floor and peers."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys

import torch

from .. import built_with_cuda
from ..devices import resolve_device
from . import host_overhead
from .model import PRESETS, GPTConfig
from .report import Progress, overlap_check_costs, table, write_json, write_plot, write_timeline
from .runner import OPTIMIZERS, STATE_MODES, make_modes, measure_bandwidth, run_mode, torchao_offload_class

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _device(text: str) -> torch.device:
    """--device as written (checked, resolved once the GPU is known to be there)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return device


def _int_list(minimum: int):
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {minimum}, got {text!r}")
        return values
    return parse


def _state_modes(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in values if v not in STATE_MODES]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated state modes from {', '.join(STATE_MODES)}, "
                                         f"got {text!r}")
    return values


def _names(known: dict):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(";") if v.strip()]
        unknown = [v for v in values if v not in known]
        if not values or unknown:
            raise argparse.ArgumentTypeError(f"expected ';'-separated names from {'; '.join(known)}, got {text!r}")
        return values
    return parse


def _shares(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(0 <= v <= 1 for v in values):  # NaN fails the range too
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions in [0, 1], got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected each share once, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m swap_optimizer.bench",
        description="Peak device memory and step time of SwapOptimizer against torch's fused AdamW with the state "
                    "resident, the measured copy floor and, where importable, torchao's CPUOffloadOptimizer, on an "
                    "embedded GPT-style model with random tokens.")
    p.add_argument("--device", type=_device, default=None,
                   help="cpu, cuda or cuda:N (default: cuda when a GPU is present)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model size (default: tiny; micro with --quick)")
    p.add_argument("--layers", type=_positive_int, help="override the preset's number of blocks")
    p.add_argument("--hidden", type=_positive_int, help="override the preset's width")
    p.add_argument("--heads", type=_positive_int, help="override the preset's attention heads")
    p.add_argument("--vocab", type=_positive_int, help="override the preset's vocabulary size")
    p.add_argument("--seq-len", type=_positive_int, help="override the preset's sequence length")
    p.add_argument("--batch-size", type=_positive_int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="param dtype; bf16 runs SwapOptimizer with and without fp32 master weights")
    p.add_argument("--swap-times", type=_int_list(1), default=[2, 4, 8, 16], help="comma-separated (default 2,4,8,16)")
    p.add_argument("--num-arenas", type=_int_list(2), default=[2, 3], help="comma-separated (default 2,3)")
    p.add_argument("--state-modes", type=_state_modes, default=("default",),
                   help=f"comma-separated state forms of the swap modes, from {', '.join(STATE_MODES)} "
                        "(kahan ones need --dtype bf16 or fp16; default: default)")
    p.add_argument("--resident-shares", type=_shares, default=[], metavar="0,0.25,...",
                   help="add a swap mode per share at the first --swap-times and --num-arenas, with the device budget "
                        "that keeps that fraction of the swappable state resident (the plan's device bytes with no "
                        "extra residents plus the share of the state)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                   help="the optimizer every mode runs (default adamw; master weights, the kahan --state-modes "
                        "and the torchao peer are AdamW's only, bf16 and 8bit run with every elementwise one; "
                        "--overlap runs with all but muon)")
    p.add_argument("--warmup", type=_positive_int, default=3, help="untimed steps per mode")
    p.add_argument("--repeats", type=_positive_int, default=10, help="timed steps per mode (median; at least 10)")
    p.add_argument("--quick", action="store_true", help="the micro model, one warm-up step: about 30 s on a CPU (with --host-overhead: "
                        "compact states over 64k elements instead of 4M)")
    p.add_argument("--overlap", action="store_true",
                   help="add each swap mode with overlap_forward=True (its step runs beside the next forward), and "
                        "time every mode's whole training step over back-to-back steps (one sync at the end)")
    p.add_argument("--timeline", metavar="PATH.png",
                   help="with --overlap: plot the first overlapped mode's step and next forward (per batch: copy "
                        "in, update, copy out; per block: forward)")
    p.add_argument("--host-overhead", action="store_true",
                   help="instead of the memory benchmark: the host's cost around the update and the forward, on tiny "
                        "tensors: step() of each optimizer path against the wrapped optimizer alone, and "
                        "overlap_forward's checks against the plain forward (ratios side by side, --rounds rounds of "
                        "--repeats steps each)")
    p.add_argument("--rounds", type=_positive_int, default=5,
                   help="with --host-overhead: measured rounds (min and median over them; default 5)")
    p.add_argument("--paths", type=_names(host_overhead.OPTIMIZER_PATHS), default=list(host_overhead.OPTIMIZER_PATHS),
                   metavar="NAME;NAME", help="with --host-overhead: the optimizer paths, ';'-separated (default: all)")
    p.add_argument("--shape-sets", type=_names(host_overhead.SHAPE_SETS), default=list(host_overhead.SHAPE_SETS),
                   metavar="NAME;NAME", help="with --host-overhead: the shape sets, ';'-separated (default: all)")
    p.add_argument("--json", metavar="PATH", help="write every figure and the environment as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="plot peak memory against step time")
    return p


def check_arguments(p: argparse.ArgumentParser, args) -> None:
    """The rules on the arguments alone (p.error exits), checked before
    anything runs; tests/tools/test_gpu_check_script.py holds the GPU check's
    invocations to them."""
    if args.plot and not args.plot.endswith(".png"):
        p.error(f"--plot writes a PNG: give a path ending in .png, got {args.plot}")
    if args.timeline and not args.overlap:
        p.error("--timeline plots an overlapped step: add --overlap")
    if args.timeline and not args.timeline.endswith(".png"):
        p.error(f"--timeline writes a PNG: give a path ending in .png, got {args.timeline}")
    if args.repeats < 10 and not args.quick:
        p.error("--repeats must be at least 10: the step time is the median of at least 10 steps")
    adam_only = [mode for mode in args.state_modes if mode.startswith("kahan")]
    if args.optimizer != "adamw" and adam_only:
        p.error(f"--state-modes {','.join(adam_only)} work with --optimizer adamw only, not {args.optimizer}")
    if args.optimizer in ("adafactor", "muon") and args.state_modes != ("default",):
        p.error(f"--state-modes bf16 and 8bit work with elementwise optimizers, not {args.optimizer} "
                "(its states are read whole)")
    if args.optimizer == "muon" and args.overlap:
        p.error("--overlap does not run with --optimizer muon (Muon beside a resident AdamW); use another optimizer")


def model_config(args, p: argparse.ArgumentParser) -> tuple[str, GPTConfig]:
    preset = args.preset or ("micro" if args.quick else "tiny")
    base = PRESETS[preset].as_dict()
    overrides = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
                 "seq_len": args.seq_len}
    base.update({k: v for k, v in overrides.items() if v is not None})
    config = GPTConfig(**base)
    if config.hidden % config.heads:
        p.error(f"--hidden {config.hidden} is not a multiple of --heads {config.heads}")
    return preset, config


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def needed_bytes(config: GPTConfig, dtype: torch.dtype, batch_size: int) -> int:
    """The resident mode's need: params, grads, two fp32-or-dtype states, and
    activations (about 40 values per token and width per block, plus logits)."""
    params = config.param_count()
    per_param = dtype.itemsize * 4
    tokens = batch_size * config.seq_len
    activations = tokens * (config.layers * 40 * config.hidden + 3 * config.vocab) * 4
    return params * per_param + activations


def environment(device: torch.device, bandwidth=None) -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "device": str(device), "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "threads": torch.get_num_threads(), "built_with_cuda": built_with_cuda()}
    if bandwidth is not None:
        env["bandwidth_bytes_per_s"] = {"host_to_device": bandwidth.host_to_device,
                                        "device_to_host": bandwidth.device_to_host,
                                        "both_directions": bandwidth.both_directions}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env


def host_overhead_main(args, device: torch.device) -> int:
    """--host-overhead: the tables, and the JSON with the environment."""
    print(f"swap_optimizer host overhead on {device}: {args.rounds} rounds of {args.repeats} steps (one warm-up "
          "round first); ratios side by side in this process", flush=True)
    report = host_overhead.run(device, args.rounds, args.repeats, args.paths, args.shape_sets,
                               progress=lambda line: print(f"  {line}", flush=True),
                               compact_elements=65_536 if args.quick else 4_000_000)
    print("\nstep(): SwapOptimizer (swap_times 16, every param swapped) against the wrapped optimizer alone, ms a "
          "step; the extra time split into per batch (against swap_times 4) and per param (the rest)")
    print(host_overhead.step_table(report["step"]))
    print("\noverlap_forward: the tiny-op model's forward (no grad) against the same forward without the hooks")
    print(host_overhead.forward_table(report["forward"]))
    print(f"\ncompact states: SwapOptimizer's step with bf16 and 8-bit states against the default states "
          f"(swap_times {host_overhead.COMPACT_SWAP_TIMES}, one thread), ms a step")
    print(host_overhead.compact_table(report["compact"]))
    if args.json:
        write_json(args.json, {"environment": environment(device), **report})
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not (torch.cuda.is_available() and built_with_cuda()):
        p.error("--device cuda needs a GPU and a CUDA build of swap_optimizer")
    try:  # "cuda" is the current GPU, cuda:N that one: the runtime is always given an index
        device = resolve_device(device)
    except ValueError as error:
        p.error(str(error))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the timers' events and streams are the current device's
    check_arguments(p, args)
    if args.host_overhead:
        return host_overhead_main(args, device)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install matplotlib")
    if args.timeline and importlib.util.find_spec("matplotlib") is None:
        p.error("--timeline needs matplotlib: pip install matplotlib")
    preset, config = model_config(args, p)
    dtype = DTYPES[args.dtype]
    need, free = needed_bytes(config, dtype, args.batch_size), free_bytes(device)
    if need > free:
        p.error(f"the {preset} model ({config.param_count() / 1e6:,.0f}M params, batch {args.batch_size}) needs about "
                f"{need / 2**30:,.1f} GiB on {device} for the resident mode but {free / 2**30:,.1f} GiB is free; "
                "pick a smaller --preset or --batch-size")
    warmup = 1 if args.quick else args.warmup

    cpu = device.type == "cpu"
    bandwidth = measure_bandwidth(device, 64 << 20 if not cpu else 16 << 20, 5)
    if dtype == torch.float32 and any(state.startswith("kahan") for state in args.state_modes):
        p.error("--state-modes kahan+...: Kahan summation applies to 16-bit params; add --dtype bf16 or fp16")
    modes = make_modes(device, dtype, args.swap_times, args.num_arenas, args.state_modes, args.overlap,
                       args.optimizer, args.resident_shares)
    timeline_mode = next((m for m in modes if m.overlap), None) if args.timeline else None
    named = OPTIMIZERS[args.optimizer][0].__name__ + (" (+ resident AdamW for the rest)" if args.optimizer == "muon"
                                                      else "")
    print(f"swap_optimizer benchmark: {named} on "
          f"{preset} GPT ({config.param_count() / 1e6:,.1f}M params, {args.dtype}), "
          f"batch {args.batch_size} x {config.seq_len} tokens on {device}; {len(modes)} modes, "
          f"median of {args.repeats} steps after {warmup} warm-up", flush=True)
    if cpu:
        print("On the CPU: times are CPU times of the host backend, and memory is the runtime's own accounting "
              "(params, grads and the optimizer's staging and resident state; activations not counted).", flush=True)
    if device.type == "cuda" and torchao_offload_class() is None:
        print("torchao is not installed: its CPUOffloadOptimizer is left out.", flush=True)
    progress = Progress(len(modes))
    progress.show(modes[0].name)
    rows = []
    for mode in modes:
        rows.append(run_mode(mode, config, dtype, device, args.batch_size, warmup, args.repeats, bandwidth,
                             loop=args.overlap, timeline=mode == timeline_mode).as_dict())
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next mode starts from the same empty device
        progress.advance(mode.name)
    print(f"\ncopy bandwidth measured here: H2D {bandwidth.host_to_device / 1e9:.2f} GB/s, "
          f"D2H {bandwidth.device_to_host / 1e9:.2f} GB/s, both at once {bandwidth.both_directions / 1e9:.2f} GB/s")
    print(table(rows, cpu))
    if args.overlap:
        print("loop train step: zero_grad, forward and backward, and step() over the timed steps back to back, "
              "synchronised once at the end (an overlapped step runs beside the next forward).")
        print(overlap_check_costs(rows))
    report = {"environment": environment(device, bandwidth),
              "model": {"preset": preset, "params": config.param_count(), "dtype": args.dtype,
                        "block_param_bytes": config.block_param_count() * dtype.itemsize,
                        "batch_size": args.batch_size, **config.as_dict()},
              "settings": {"optimizer": args.optimizer, "warmup": warmup, "repeats": args.repeats,
                           "swap_times": args.swap_times,
                           "num_arenas": args.num_arenas, "overlap": args.overlap,
                           "resident_shares": args.resident_shares,
                           "memory": "runtime accounting" if cpu else "torch.cuda.max_memory_allocated",
                           "times": "perf_counter (CPU)" if cpu else "CUDA events"},
              "modes": rows}
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    if timeline_mode is not None:
        row = next(r for r in rows if r["mode"] == timeline_mode.name)
        write_timeline(args.timeline, row["timeline"]["spans"],
                       f"{preset} GPT, {args.dtype}, {device}: {timeline_mode.name}, one step and the next forward")
        print(f"wrote {args.timeline}")
    if args.plot:
        title = f"{preset} GPT, {args.dtype}, {device}" + (" (CPU times, runtime accounting)" if cpu else "")
        write_plot(args.plot, rows, title)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
