"""SwapOptimizer in the Hugging Face Trainer: passed as optimizers=(optimizer,
scheduler), or built by the Trainer from optimizer_cls_and_kwargs; the
Trainer's own checkpoints, resumed with resume_from_checkpoint.

    python examples/hf_trainer.py                               # optimizers=(opt, scheduler)
    python examples/hf_trainer.py --via optimizer_cls_and_kwargs
"""

import os
import sys

import torch

# common.py is beside this script, and `python -P examples/...` leaves the
# script's folder off sys.path: put it there.
HERE = os.path.dirname(os.path.realpath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from common import arguments, print_memory, require, save_final, token_data  # noqa: E402

transformers = require("transformers")
from swap_optimizer import SwapOptimizer  # noqa: E402


def tiny_gpt2():
    """A 2-layer GPT-2 from a config: nothing is downloaded."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                    bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class SwappedAdamW(SwapOptimizer):
    """For optimizer_cls_and_kwargs, which takes an optimizer class (a plain
    function would be taken for a factory of another shape): built with the
    Trainer's param groups (weight decay off for biases and norms) and the
    kwargs given."""

    def __init__(self, params, swap_times=4, **adamw_kwargs):
        super().__init__(torch.optim.AdamW(params, **adamw_kwargs), swap_times=swap_times)


class StopAt(transformers.TrainerCallback):
    """Ends training after a step, as an interruption would (the checkpoint at
    that step is saved first)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def make_trainer(args, callbacks=()):
    model = tiny_gpt2()
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4,
        learning_rate=1e-3, weight_decay=0.1, warmup_steps=2, lr_scheduler_type="linear", max_grad_norm=1.0,
        save_strategy="steps", save_steps=args.stop_at, logging_steps=1, report_to="none", seed=0,
        use_cpu=args.device == "cpu", dataloader_num_workers=0, disable_tqdm=True)
    tokens = token_data(args.steps).flatten(0, 1)
    dataset = [{"input_ids": sequence, "labels": sequence} for sequence in tokens]
    if args.via == "optimizers":
        optimizer = SwapOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), swap_times=4)
        scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, args.steps)
        kwargs = dict(optimizers=(optimizer, scheduler))
    else:
        kwargs = dict(optimizer_cls_and_kwargs=(SwappedAdamW, {"lr": 1e-3}))  # weight decay comes from args
    return transformers.Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=list(callbacks),
                                **kwargs)


def main():
    args = arguments(__doc__.splitlines()[0], more=lambda parser: parser.add_argument(
        "--via", choices=("optimizers", "optimizer_cls_and_kwargs"), default="optimizers",
        help="how the Trainer gets SwapOptimizer"))
    if args.phase == "straight":
        trainer = make_trainer(args)
        trainer.train()
    if args.phase in ("all", "first"):
        trainer = make_trainer(args, [StopAt(args.stop_at)])
        trainer.train()  # saves checkpoint-<stop_at> in output_dir: model, optimizer.pt (a torch.optim state dict),
        print_memory(trainer.optimizer.optimizer, "before the checkpoint")  # scheduler.pt, RNG and trainer state
        if args.phase == "first":
            return
    if args.phase in ("all", "resume"):
        trainer = make_trainer(args)  # a fresh model and optimizer, as a new process would have
        trainer.train(resume_from_checkpoint=True)  # the last checkpoint in output_dir
    swap = trainer.optimizer.optimizer  # the Trainer wraps it in accelerate's AcceleratedOptimizer
    print_memory(swap, "at the end")
    save_final(os.path.join(args.output_dir, "final.pt"), trainer.model.named_parameters(), swap.state_dict())


if __name__ == "__main__":
    main()
