"""SwapOptimizer in PyTorch Lightning: configure_optimizers returns it with a
scheduler dict; gradient_clip_val, precision="bf16-mixed", ModelCheckpoint,
and a resume with fit(ckpt_path=...).

    python examples/lightning_module.py    # with lightning or pytorch_lightning installed
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

# Lightning 2 installs as `lightning` (its trainer is lightning.pytorch) or as the
# standalone `pytorch_lightning`, the same classes: either does.
pl = require("lightning", "lightning.pytorch", "pytorch_lightning")
from swap_optimizer import SwapOptimizer  # noqa: E402


class LanguageModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_lm()

    def training_step(self, batch, batch_index):
        loss = self.model(batch)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = SwapOptimizer(torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1), swap_times=4)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class StopAt(pl.Callback):
    """Ends fit after a step, as an interruption would (after its checkpoint)."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.should_stop = True


class PrintLoss(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, *args):
        print(f"step {trainer.global_step}: loss {outputs['loss'].item():.4f}")


def fit(args, checkpoints, stop_at=None, resume_from=None):
    callbacks = [PrintLoss(), pl.callbacks.ModelCheckpoint(
        dirpath=checkpoints, filename="{step}", every_n_train_steps=args.stop_at, save_top_k=-1)]
    if stop_at is not None:
        callbacks.append(StopAt(stop_at))
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="gpu" if args.device == "cuda" else "cpu", devices=1,
        precision="bf16-mixed", gradient_clip_val=1.0, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False)
    module = LanguageModel()
    # An epoch of stop_at batches: the checkpoint falls on an epoch's end, where
    # a plain DataLoader resumes exactly.
    loader = DataLoader(list(token_data(args.stop_at).flatten(0, 1)), batch_size=4, shuffle=False)
    trainer.fit(module, loader, ckpt_path=resume_from)
    return trainer, module


def main():
    args = arguments(__doc__.splitlines()[0])
    if args.steps % args.stop_at:
        raise SystemExit("--steps must be a multiple of --stop-at here (whole epochs)")
    checkpoints = os.path.join(args.output_dir, "checkpoints")
    if args.phase == "straight":
        trainer, module = fit(args, checkpoints)
    if args.phase in ("all", "first"):
        trainer, module = fit(args, checkpoints, stop_at=args.stop_at)
        print_memory(trainer.optimizers[0], "before the checkpoint")
        if args.phase == "first":
            return
    if args.phase in ("all", "resume"):
        # The checkpoint holds the optimizer's torch.optim state dict, the scheduler and the loops' progress.
        trainer, module = fit(args, checkpoints, resume_from=os.path.join(checkpoints, f"step={args.stop_at}.ckpt"))
    optimizer = trainer.optimizers[0]
    print_memory(optimizer, "at the end")
    save_final(os.path.join(args.output_dir, "final.pt"), module.named_parameters(), optimizer.state_dict())


if __name__ == "__main__":
    main()
