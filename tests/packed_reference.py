"""Drives the packed op the way a caller would, beside torch.optim on the same
data, for the op tests and the benchmark-free parity checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

import swap_optimizer as so


@dataclasses.dataclass(frozen=True)
class AdamFlags:
    decoupled: bool = True  # AdamW when True, Adam (L2 decay) when False
    amsgrad: bool = False
    maximize: bool = False
    weight_decay: float = 0.1
    lr: float = 1e-2
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8

    def torch_optimizer(self, params, **extra):
        cls = torch.optim.AdamW if self.decoupled else torch.optim.Adam
        return cls(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                   amsgrad=self.amsgrad, maximize=self.maximize, **extra)


def _normal(shape, rng):
    # NumPy's generator: the same bits whatever instruction set torch picked.
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))


def random_params(sizes, dtype, device, seed):
    rng = np.random.default_rng(seed)
    return [_normal((n,), rng).to(device=device, dtype=dtype) for n in sizes]


def random_grads(params, seed, step):
    rng = np.random.default_rng([seed, step])
    return [_normal(tuple(p.shape), rng).to(device=p.device, dtype=p.dtype) for p in params]


class PackedBatches:
    """Params split into consecutive batches, each with its own arena."""

    def __init__(self, params, batch_sizes, *, amsgrad, state_dtype=None, master_weights=False,
                 alignment=256, start=0):
        self.params = params
        self.batches = []
        first = 0
        for size in batch_sizes:
            members = params[first:first + size]
            first += size
            layout, nbytes = so.plan_packed_layout(members, amsgrad=amsgrad, state_dtype=state_dtype,
                                                   master_weights=master_weights, alignment=alignment,
                                                   start=start)
            device = params[0].device if params else torch.device("cpu")
            arena = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            steps = torch.zeros(len(members), dtype=torch.float32, device=device)
            for row, p in zip(layout.tolist(), members):
                if row[3] >= 0:
                    self._view(arena, row[3], p.numel(), torch.float32).copy_(p.float().flatten())
            self.batches.append((members, layout, arena, steps))
        assert first == len(params)
        self.state_dtype = state_dtype

    @staticmethod
    def _view(arena, offset, numel, dtype):
        return arena[offset:offset + numel * dtype.itemsize].view(dtype)

    def state(self, index, column):
        """The arena view of state `column` (0..3) of param `index`."""
        for members, layout, arena, _ in self.batches:
            if index < len(members):
                offset = int(layout[index, column])
                p = members[index]
                dtype = torch.float32 if column == 3 else (self.state_dtype or p.dtype)
                return self._view(arena, offset, p.numel(), dtype).view(p.shape)
            index -= len(members)
        raise IndexError(index)

    def step(self, grads, flags: AdamFlags, state_dtype=None, grad_scale=None, found_inf=None):
        first = 0
        for members, layout, arena, steps in self.batches:
            so.fused_adam_packed(members, grads[first:first + len(members)], arena, layout, steps,
                                 lr=flags.lr, betas=flags.betas, eps=flags.eps,
                                 weight_decay=flags.weight_decay, amsgrad=flags.amsgrad,
                                 maximize=flags.maximize, decoupled_weight_decay=flags.decoupled,
                                 state_dtype=state_dtype, grad_scale=grad_scale, found_inf=found_inf)
            first += len(members)

    def steps(self):
        return torch.cat([s.cpu() for *_, s in self.batches]) if self.batches else torch.zeros(0)
