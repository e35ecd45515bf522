"""SwapOptimizer in a Hugging Face Accelerate loop: accelerator.prepare(model,
optimizer, loader, scheduler), clip_grad_norm_, save_state and load_state.

    python examples/accelerate_loop.py            # CPU, or the GPU if there is one
    accelerate launch examples/accelerate_loop.py  # the same under accelerate's launcher
"""

import os
import sys

import torch
from torch.utils.data import DataLoader

# common.py is beside this script, and `python -P examples/...` leaves the
# script's folder off sys.path: put it there.
HERE = os.path.dirname(os.path.realpath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from common import arguments, print_memory, require, save_final, tiny_lm, token_data  # noqa: E402

accelerate = require("accelerate")
from swap_optimizer import SwapOptimizer  # noqa: E402


def build(args):
    """A fresh accelerator, model, optimizer, loader and scheduler, prepared."""
    accelerator = accelerate.Accelerator(cpu=args.device == "cpu")
    model = tiny_lm()
    optimizer = SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), swap_times=4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    loader = DataLoader(list(token_data(args.steps).flatten(0, 1)), batch_size=4, shuffle=False)  # a batch per step
    return accelerator, *accelerator.prepare(model, optimizer, loader, scheduler)


def train(accelerator, model, optimizer, loader, scheduler, first_step, last_step, checkpoint=None):
    """Steps first_step+1 .. last_step; saves the whole state after the last one if given a folder."""
    for batch in accelerator.skip_first_batches(loader, first_step):  # the batches already trained on
        loss = model(batch)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        first_step += 1
        print(f"step {first_step}: loss {loss.item():.4f}, lr {scheduler.get_last_lr()[0]:.2e}")
        if first_step == last_step:
            break
    if checkpoint is not None:
        accelerator.save_state(checkpoint)  # model, optimizer (a torch.optim state dict), scheduler, RNG


def main():
    args = arguments(__doc__.splitlines()[0])
    checkpoint = os.path.join(args.output_dir, "checkpoint")
    accelerator, model, optimizer, loader, scheduler = build(args)
    if args.phase == "straight":
        train(accelerator, model, optimizer, loader, scheduler, 0, args.steps)
    if args.phase in ("all", "first"):
        train(accelerator, model, optimizer, loader, scheduler, 0, args.stop_at, checkpoint)
        print_memory(optimizer.optimizer, "before the checkpoint")
        if args.phase == "first":
            return
        accelerator, model, optimizer, loader, scheduler = build(args)  # as a new process would
    if args.phase in ("all", "resume"):
        accelerator.load_state(checkpoint)
        train(accelerator, model, optimizer, loader, scheduler, scheduler.scheduler.last_epoch, args.steps)
    print_memory(optimizer.optimizer, "at the end")
    save_final(os.path.join(args.output_dir, "final.pt"), accelerator.unwrap_model(model).named_parameters(),
               optimizer.state_dict())


if __name__ == "__main__":
    main()
