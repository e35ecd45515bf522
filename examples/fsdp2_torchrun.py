"""SwapOptimizer under FSDP2 with torchrun: fully_shard the model, wrap the
optimizer of the local shards, save and load with torch.distributed.checkpoint.

    torchrun --nproc-per-node 2 examples/fsdp2_torchrun.py   # gloo on CPU, NCCL on GPUs
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

# common.py is beside this script, and `python -P examples/...` leaves the
# script's folder off sys.path: put it there.
HERE = os.path.dirname(os.path.realpath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from common import arguments, print_memory, save_final, tiny_lm, token_data  # noqa: E402
from swap_optimizer import SwapOptimizer  # noqa: E402


def build(device):
    """The model with each block and the root sharded, and SwapOptimizer on its
    DTensor params: each rank keeps the state of its own shards in host memory."""
    model = tiny_lm().to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), swap_times=4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, data, first_step, last_step, rank):
    for step in range(first_step, last_step):
        loss = model(data[step, rank::dist.get_world_size()])  # each rank its part of the batch
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # a global norm over the shards
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}")


def save(model, optimizer, scheduler, step, folder):
    """Sharded: each rank writes its shards of the params and of the optimizer
    state (torch.optim's state dict, keyed by param name)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state,
              "scheduler": scheduler.state_dict(), "step": step}, checkpoint_id=folder)


def load(model, optimizer, scheduler, folder) -> int:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "step": 0}
    dcp.load(loaded, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    return loaded["step"]


def main():
    args = arguments(__doc__.splitlines()[0])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    on_gpus = args.device == "cuda"
    if on_gpus:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if on_gpus else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank) if on_gpus else torch.device("cpu")
    checkpoint = os.path.join(args.output_dir, "checkpoint")
    data = token_data(args.steps, batch=2 * dist.get_world_size()).to(device)
    try:
        model, optimizer, scheduler = build(device)
        if args.phase == "straight":
            train(model, optimizer, scheduler, data, 0, args.steps, rank)
        if args.phase in ("all", "first"):
            train(model, optimizer, scheduler, data, 0, args.stop_at, rank)
            save(model, optimizer, scheduler, args.stop_at, checkpoint)
            if rank == 0:
                print_memory(optimizer, "rank 0, before the checkpoint")
            if args.phase == "first":
                return
            model, optimizer, scheduler = build(device)  # as a new process would
        if args.phase in ("all", "resume"):
            step = load(model, optimizer, scheduler, checkpoint)
            train(model, optimizer, scheduler, data, step, args.steps, rank)
        if rank == 0:
            print_memory(optimizer, "rank 0, at the end")
        save_final(os.path.join(args.output_dir, f"final_rank{rank}.pt"), model.named_parameters(),
                   optimizer.state_dict())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
