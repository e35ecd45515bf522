"""Staging share of the optimizer state for the parameter shapes of public models.

For each model shape and swap_times, the device memory that a SwapOptimizer step
allocates for staging (arenas and the step table), as a share of the optimizer
state in host memory, beside the ideal num_arenas / swap_times and beside the
least any layout keeping params whole would need (num_arenas arenas holding the
largest param's states). AdamW on bf16 params, states in bf16 (torch's default
for bf16 params), min_numel 1024, as `SwapOptimizer(torch.optim.AdamW(...))`
would lay them out.

The figures come from the runtime's own store layout (`_C.summarize_staging`, on meta
tensors: no memory is allocated). With --real-step the shapes whose state fits
in host memory also run one real step on the CPU host backend and report
`memory_stats()` of that step, which must equal the layout.

    python -P benchmarks/staging_share.py [--swap-times 8 16 32] [--num-arenas 2]
                                          [--real-step gpt2-124m|all|none] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from swap_optimizer import SwapOptimizer, _C
from swap_optimizer.presets import PRESETS


# The public shapes this benchmark reports (swap_optimizer.presets has more).
MODELS = ("gpt2-124m", "qwen2.5-0.5b", "llama-3.2-1b")
MIN_NUMEL = 1024


def summarize(shapes, swap_times, num_arenas):
    params = [torch.empty(shape, dtype=torch.bfloat16, device="meta") for shape in shapes]
    return _C.summarize_staging(params, [0] * len(params), [False], [p.numel() >= MIN_NUMEL for p in params],
                                swap_times=swap_times, num_arenas=num_arenas, state_dtype=None, master_weights=False,
                                swap_keys=[True] * 8)


def real_step(shapes, swap_times, num_arenas):
    """One SwapOptimizer step on bf16 CPU params of these shapes; its memory_stats()."""
    params = [torch.zeros(shape, dtype=torch.bfloat16).requires_grad_() for shape in shapes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = SwapOptimizer(torch.optim.AdamW(params, lr=1e-4), swap_times=swap_times, num_arenas=num_arenas,
                              min_numel=MIN_NUMEL)
    optimizer.step()
    return optimizer.memory_stats()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swap-times", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--num-arenas", type=int, default=2)
    parser.add_argument("--real-step", choices=[*MODELS, "all", "none"], default="gpt2-124m",
                        help="also run one real CPU step for these shapes (all: about 10 GB of host memory)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    if args.num_arenas < 2 or any(s < 1 for s in args.swap_times):
        parser.error("--num-arenas must be >= 2 and every --swap-times >= 1")

    rows = []
    print(f"AdamW, bf16 params and states, min_numel {MIN_NUMEL}, num_arenas {args.num_arenas}; "
          "staging = peak device bytes of a step (arenas + step table) / host state bytes")
    print("| model shape | params | largest tensor | swap_times | staging share | ideal | over ideal "
          "| whole-param floor | batches | split params | host copies per batch (max) | real step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in MODELS:
        title, model = PRESETS[key]
        shapes = model.param_shapes()
        numels = [torch.Size(s).numel() for s in shapes]
        total, largest = sum(numels), max(numels)
        for swap_times in args.swap_times:
            summary = summarize(shapes, swap_times, args.num_arenas)
            host = summary.host_state_bytes
            share = summary.staging_bytes / host
            ideal = args.num_arenas / swap_times
            floor = args.num_arenas * largest * 4 / host  # two bf16 states per element
            copies = max(b["host_copies"] for b in summary.batch_layout)
            real = "-"
            if args.real_step == "all" or args.real_step == key:
                stats = real_step(shapes, swap_times, args.num_arenas)
                real_share = stats["peak_staging_bytes"] / stats["host_state_bytes"]
                if stats["peak_staging_bytes"] != summary.staging_bytes or stats["host_state_bytes"] != host:
                    print(f"error: the real step of {key} at swap_times {swap_times} does not match the layout",
                          file=sys.stderr)
                    return 1
                real = f"{real_share:.5f}"
            rows.append(dict(model=key, params=total, largest=largest, swap_times=swap_times,
                             num_arenas=args.num_arenas, staging_bytes=summary.staging_bytes, host_state_bytes=host,
                             share=share, ideal=ideal, whole_param_floor=floor, batches=summary.batches,
                             split_params=summary.split_params, max_host_copies=copies,
                             real_step_share=None if real == "-" else float(real)))
            print(f"| {title} | {total / 1e6:.0f}M | {largest / total:.0%} | {swap_times} | {share:.5f} | "
                  f"{ideal:.5f} | {share - ideal:+.5f} | {floor:.2f} | {summary.batches} | "
                  f"{summary.split_params} | {copies} | {real} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
