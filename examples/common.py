"""What the examples share: their command line, a small model and token data
built from a config (nothing downloaded), the memory figures, and the final
state each run writes so that a resumed run can be compared with an
uninterrupted one (tests/tools/test_examples.py does).

Every example runs in one of four phases (--phase):
  all       (default) train to --stop-at, save a checkpoint, then build the
            model and optimizer anew, resume from the checkpoint and finish;
  first     train to --stop-at, save a checkpoint, exit (as if interrupted);
  resume    resume from the checkpoint in --output-dir and finish;
  straight  train all --steps without a checkpoint.
"""

import argparse
import importlib
import os
import sys

import torch
from torch import nn

PHASES = ("all", "first", "resume", "straight")


def require(package: str, *modules: str):
    """Imports a framework: the first of `modules` that imports (the package's
    own name if none are given), or stops naming them and the command that
    installs `package`."""
    modules = modules or (package,)
    for module in modules:
        try:
            return importlib.import_module(module)
        except ImportError:
            pass
    names = " or ".join(dict.fromkeys(module.split(".")[0] for module in modules))
    sys.exit(f"skipped: {os.path.basename(sys.argv[0])} needs {names}; install it with `pip install '{package}'` "
             "(or every example's framework: `pip install transformers accelerate lightning`, the versions "
             "docs/integrations.md names)")


def arguments(description: str, steps: int = 6, stop_at: int = 3, more=None) -> argparse.Namespace:
    """The examples' common options; `more(parser)` adds a script's own."""
    parser = argparse.ArgumentParser(description=description)
    name = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    parser.add_argument("--output-dir", default=os.path.join("runs", name), help="checkpoints and final.pt")
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps in all")
    parser.add_argument("--stop-at", type=int, default=stop_at, help="the step the checkpoint is saved at")
    parser.add_argument("--phase", choices=PHASES, default="all", help="see examples/common.py")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    if more is not None:
        more(parser)
    args = parser.parse_args()
    if not 0 < args.stop_at < args.steps:
        parser.error("--stop-at must be between 0 and --steps")
    os.makedirs(args.output_dir, exist_ok=True)
    return args


# A small decoder-style language model from a config: an embedding, a stack
# of residual MLP blocks in an nn.ModuleList (the blocks overlap_forward
# finds), a head; called on tokens, it returns their next-token loss.
CONFIG = dict(vocab_size=256, hidden=128, layers=4, sequence=32)


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, layers: int, sequence: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.position = nn.Parameter(torch.randn(sequence, hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab_size)

    def forward(self, tokens):
        """The next-token loss of a batch of sequences."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        h = self.embed(inputs) + self.position[: inputs.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_lm(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**CONFIG)


def token_data(count: int, batch: int = 4, sequence: int = CONFIG["sequence"], vocab: int = CONFIG["vocab_size"],
               seed: int = 1) -> torch.Tensor:
    """`count` batches of random tokens, the same every run: [count, batch, sequence]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, batch, sequence), generator=generator)


def print_memory(optimizer, label: str) -> None:
    """The figures SwapOptimizer reports: where the state lives and what moves per step."""
    stats = optimizer.memory_stats()
    mib = 1 << 20
    print(f"[{label}] optimizer state: {stats['host_state_bytes'] / mib:.2f} MiB in host memory "
          f"({'pinned' if stats['pinned'] else 'pageable'}), {stats['resident_state_bytes'] / mib:.2f} MiB on the "
          f"device; staging {stats['peak_staging_bytes'] / mib:.2f} MiB at its peak in {stats['batches']} batches; "
          f"{stats['h2d_bytes'] / mib:.2f} MiB in and {stats['d2h_bytes'] / mib:.2f} MiB out per step")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def save_final(path: str, named_params, optimizer_state: dict) -> None:
    """What the tests compare: every param (its local shard under FSDP2) and
    the optimizer's state dict, on the CPU."""
    def to_cpu(value):
        if isinstance(value, torch.Tensor):
            return local(value).detach().cpu().clone()
        if isinstance(value, dict):
            return {k: to_cpu(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(to_cpu(v) for v in value)
        return value

    torch.save({"params": {name: to_cpu(p) for name, p in named_params}, "optimizer": to_cpu(optimizer_state)}, path)
    print(f"final params and optimizer state written to {path}")
