"""Bytes per second of the fused packed op, of torch's fused AdamW on the same
parameters and device, and of a plain copy of as many bytes (the memory ceiling).

    python benchmarks/kernel_bench.py [--device cpu|cuda] [--json PATH]

Each figure is the median of several rounds; in each round the three are timed
one after another, so they see the same machine state. Bytes moved per step:
the param read and written, the grad read, each state read and written.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import swap_optimizer as so

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_SIZES = {"cpu": [1 << 16, 1 << 20, 1 << 22], "cuda": [1 << 20, 1 << 24, 1 << 26]}
PARAMS_PER_SIZE = 8  # the work is spread over several tensors, as in a model


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, iters):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / iters
        begin = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - begin) / iters


def split_sizes(numel):
    base = numel // PARAMS_PER_SIZE
    return [base + 1] * (PARAMS_PER_SIZE - 1) + [numel - (base + 1) * (PARAMS_PER_SIZE - 1)]


def bench_one(device, dtype, numel, rounds, iters):
    gen = torch.Generator().manual_seed(numel)
    params = [torch.randn(n, generator=gen).to(device=device, dtype=dtype) for n in split_sizes(numel)]
    grads = [torch.randn(p.shape, generator=gen).to(device=device, dtype=dtype) for p in params]
    layout, nbytes = so.plan_packed_layout(params)
    arena = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    steps = torch.zeros(len(params), device=device)

    def ours():
        so.fused_adam_packed(params, grads, arena, layout, steps, lr=1e-4, weight_decay=0.01)

    ref = [p.clone().requires_grad_() for p in params]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    torch_opt = torch.optim.AdamW(ref, lr=1e-4, weight_decay=0.01, fused=True)

    item = dtype.itemsize
    moved = numel * (2 * item + item + 4 * item)
    src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)

    timer = Timer(torch.device(device))
    for fn in (ours, torch_opt.step, copy):  # warm-up, states allocated
        timer(fn, 2)
    samples = {"ours": [], "torch": [], "copy": []}
    for _ in range(rounds):
        samples["ours"].append(timer(ours, iters))
        samples["torch"].append(timer(torch_opt.step, iters))
        samples["copy"].append(timer(copy, iters))
    seconds = {k: statistics.median(v) for k, v in samples.items()}
    gbps = {k: moved / s / 1e9 for k, s in seconds.items()}
    return {
        "device": device,
        "dtype": str(dtype).replace("torch.", ""),
        "numel": numel,
        "tensors": len(params),
        "bytes_moved": moved,
        "ours_ms": seconds["ours"] * 1e3,
        "torch_fused_ms": seconds["torch"] * 1e3,
        "ours_gbps": gbps["ours"],
        "torch_fused_gbps": gbps["torch"],
        "copy_gbps": gbps["copy"],
        "ratio_vs_torch": gbps["ours"] / gbps["torch"],
        "fraction_of_copy": gbps["ours"] / gbps["copy"],
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--sizes", nargs="+", type=int, help="total elements per case (default: by device)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        if not so.built_with_cuda():
            parser.error("this build of swap_optimizer has no CUDA kernels; reinstall with nvcc available")
        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA GPU")
    if args.sizes and min(args.sizes) < PARAMS_PER_SIZE:
        parser.error(f"--sizes must be at least {PARAMS_PER_SIZE} elements")
    if args.rounds < 1 or args.iters < 1:
        parser.error("--rounds and --iters must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    sizes = args.sizes or DEFAULT_SIZES[args.device]
    rows = []
    header = f"{'dtype':>8} {'numel':>10} {'ours GB/s':>10} {'torch fused':>12} {'copy GB/s':>10} {'ours/torch':>11} {'ours/copy':>10}"
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"
    print(f"kernel_bench on {args.device} ({where}), torch {torch.__version__}")
    print(header)
    for dtype_name in args.dtypes:
        for numel in sizes:
            row = bench_one(args.device, DTYPES[dtype_name], numel, args.rounds, args.iters)
            rows.append(row)
            print(f"{dtype_name:>8} {numel:>10} {row['ours_gbps']:>10.2f} {row['torch_fused_gbps']:>12.2f} "
                  f"{row['copy_gbps']:>10.2f} {row['ratio_vs_torch']:>11.2f} {row['fraction_of_copy']:>10.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
