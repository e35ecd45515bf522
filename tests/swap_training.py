"""Small models built in the tests and a driver that trains one with a given
optimizer, for comparing SwapOptimizer with the optimizer it wraps."""

from __future__ import annotations

import io

import numpy as np
import torch
from torch import nn
from torch.testing import assert_close

import swap_optimizer as so


class TinyTransformer(nn.Module):
    """Token embedding, one pre-norm encoder layer, output head. The layer has no
    biases: the attention's key bias gets only rounding noise as its gradient,
    which Adam would amplify into differences that say nothing about us."""

    def __init__(self, vocab=50, width=32, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=64, dropout=0.0,
                                                batch_first=True, norm_first=True, bias=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.layer(self.embed(tokens)))


def build_model(kind: str, device, dtype=torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(24, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 48), nn.GELU(),
                              nn.Linear(48, 10))
    elif kind == "transformer":
        model = TinyTransformer()
    else:
        raise ValueError(kind)
    return model.to(device=device, dtype=dtype)


def batch_for(kind: str, step: int, device):
    """Fresh random inputs and targets for each step, the same for every run."""
    rng = np.random.default_rng([7, step])
    if kind == "mlp":
        x = torch.from_numpy(rng.standard_normal((16, 24), dtype=np.float32)).to(device)
        y = torch.from_numpy(rng.integers(0, 10, 16)).to(device)
        return x, y
    tokens = torch.from_numpy(rng.integers(0, 50, (4, 12))).to(device)
    return tokens, torch.roll(tokens, -1, dims=1)


def loss_of(kind: str, model: nn.Module, step: int, device):
    inputs, targets = batch_for(kind, step, device)
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def train(kind, model, optimizer, steps, device, first_step=0, before_step=None):
    """Trains `steps` steps; returns the losses. before_step(step, model) may
    edit grads (clip, drop) before optimizer.step()."""
    losses = []
    for step in range(first_step, first_step + steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(kind, model, step, device)
        loss.backward()
        if before_step is not None:
            before_step(step, model)
        optimizer.step()
        losses.append(loss.detach().float().cpu())
    return torch.stack(losses)


def plain_optimizer(name: str, params, amsgrad: bool = False) -> torch.optim.Optimizer:
    """torch.optim.AdamW or Adam with the tests' hyper-parameters."""
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[name]
    weight_decay = 0.1 if name == "adamw" else 0.01
    return cls(params, lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, amsgrad=amsgrad)


def swap_optimizer(name: str, params, amsgrad: bool = False, **fields) -> so.SwapOptimizer:
    """SwapOptimizer around plain_optimizer(name, ...)."""
    return so.SwapOptimizer(plain_optimizer(name, params, amsgrad), **fields)


def side_by_side(kind, name, device, **fields):
    """Two copies of a model: one with SwapOptimizer(fields), one with the plain optimizer."""
    model, twin = build_model(kind, device), build_model(kind, device)
    return (model, swap_optimizer(name, model.parameters(), **fields)), (twin, plain_optimizer(name, twin.parameters()))


def plain_twin(kind, model, optimizer, device, name="adamw"):
    """A copy of `model` and a plain optimizer holding `optimizer`'s state. The
    state dict goes through torch.save / torch.load: loading a state dict shares
    its tensors (in torch as here), and the twin must not train ours."""
    twin = build_model(kind, device)
    twin.load_state_dict(model.state_dict())
    plain = plain_optimizer(name, twin.parameters())
    plain.load_state_dict(round_trip(optimizer.state_dict()))
    return twin, plain


def assert_train_alike(kind, first, second, steps, first_step, device, **tolerance):
    """Trains two (model, optimizer) pairs on the same data; losses and params agree."""
    (model_a, optimizer_a), (model_b, optimizer_b) = first, second
    assert_close(train(kind, model_a, optimizer_a, steps, device, first_step),
                 train(kind, model_b, optimizer_b, steps, device, first_step), **tolerance)
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert_close(p, q, **tolerance)


def arena_bytes(numels, state_bytes=4, states=2, align=256):
    """Bytes of one batch's arena when no param is split: each state of each
    param on its own aligned region (the layout docs/design.md describes)."""
    up = lambda n: -(-n // align) * align  # noqa: E731
    cursor = 0
    for n in numels:
        for _ in range(states):
            cursor = up(cursor) + n * state_bytes
    return cursor


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def state_tensors(optimizer, model):
    """The states of every param, on the CPU, keyed (param index, state name)."""
    out = {}
    for i, p in enumerate(model.parameters()):
        for key, value in optimizer.state[p].items():
            out[(i, key)] = value.detach().cpu().clone()
    return out


def round_trip(state_dict):
    """A state dict as it comes back from torch.save / torch.load."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)
