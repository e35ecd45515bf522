"""SwapOptimizer in a plain training loop with overlap_forward=True (the step's
updates run during the next forward) and compact states (8-bit or bf16
moments), saved and resumed with torch.save / load_state_dict.

    python examples/overlap_and_compact.py                   # 8-bit moments
    python examples/overlap_and_compact.py --state-dtype bf16   # bf16 moments, stochastic rounding
"""

import os
import sys

import torch

# common.py is beside this script, and `python -P examples/...` leaves the
# script's folder off sys.path: put it there.
HERE = os.path.dirname(os.path.realpath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from common import arguments, print_memory, save_final, tiny_lm, token_data  # noqa: E402
from swap_optimizer import SwapOptimizer, dequantize_state_dict  # noqa: E402

STATE_DTYPES = {"8bit": torch.uint8, "bf16": torch.bfloat16, "fp32": torch.float32}


def build(device, state_dtype):
    model = tiny_lm().to(device)
    optimizer = SwapOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
        swap_times=4,
        state_dtype=STATE_DTYPES[state_dtype],  # how the moments are stored in host memory
        overlap_forward=True,  # the update of step n runs while forward n+1 reads the params it has finished
        model=model,  # the module the loop calls: its calls are what waits for the update
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, data, first_step, last_step):
    for step in range(first_step, last_step):
        loss = model(data[step])  # waits, module by module, for the previous step's updates
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()  # returns once the update is enqueued; the next forward overlaps it
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step + 1}: loss {loss.item():.4f}")


def main():
    args = arguments(__doc__.splitlines()[0], more=lambda parser: parser.add_argument(
        "--state-dtype", choices=STATE_DTYPES, default="8bit", help="how the moments are stored"))
    state_dtype = args.state_dtype
    checkpoint = os.path.join(args.output_dir, "checkpoint.pt")
    data = token_data(args.steps).to(args.device)
    model, optimizer, scheduler = build(args.device, state_dtype)
    if args.phase == "straight":
        train(model, optimizer, scheduler, data, 0, args.steps)
    if args.phase in ("all", "first"):
        train(model, optimizer, scheduler, data, 0, args.stop_at)
        # Reading params or state after step() waits for the pending update by itself.
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": args.stop_at}, checkpoint)
        print_memory(optimizer, "before the checkpoint")
        if args.phase == "first":
            return
        model, optimizer, scheduler = build(args.device, state_dtype)  # as a new process would
    if args.phase in ("all", "resume"):
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        # The same checkpoint's optimizer state, dequantized, loads into plain torch.optim.AdamW too.
        plain = torch.optim.AdamW(tiny_lm().parameters(), lr=1e-3, weight_decay=0.1)
        plain.load_state_dict(dequantize_state_dict(saved["optimizer"]))
        train(model, optimizer, scheduler, data, saved["step"], args.steps)
    print_memory(optimizer, "at the end")
    save_final(os.path.join(args.output_dir, "final.pt"), model.named_parameters(), optimizer.state_dict())


if __name__ == "__main__":
    main()
