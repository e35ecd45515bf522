"""State dicts saved by an earlier Adam store (tests/data/adam_store_checkpoints.pt,
made by tests/data/make_adam_store_checkpoints.py at commit 0c690bf, when
Adam/AdamW always ran the packed kernel) keep loading: default states into
torch's own update, which then runs bitwise as the plain optimizer loaded with
the same dict; compact states into the packed kernel, unchanged."""

import os

import pytest
import torch

import swap_optimizer as so
from conftest import TESTS

SAVED = torch.load(os.path.join(TESTS, "data", "adam_store_checkpoints.pt"),
                   weights_only=False)


def model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 8)).to(dtype)


def resumed(name, wrap):
    saved = SAVED[name]
    m = model(saved["dtype"])
    m.load_state_dict(saved["model"])
    cls = torch.optim.Adam if name.startswith("adam_") else torch.optim.AdamW
    inner = cls(m.parameters(), **saved["kwargs"])
    optimizer = so.SwapOptimizer(inner, swap_times=3, **saved["config"]) if wrap else inner
    optimizer.load_state_dict(saved["optimizer"])
    return m, optimizer


def train(m, optimizer, steps=3):
    generator = torch.Generator().manual_seed(5)
    for _ in range(steps):
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        optimizer.step()
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("name", ["adamw_fp32", "adam_amsgrad_fp32"])
def test_default_states_resume_bitwise_as_the_plain_optimizer(name):
    m, swapped = resumed(name, wrap=True)
    plain_model, plain = resumed(name, wrap=False)
    for ours, theirs in zip(train(m, swapped), train(plain_model, plain)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    ours, theirs = swapped.state_dict()["state"], plain.state_dict()["state"]
    for index, entry in theirs.items():
        for key, value in entry.items():
            torch.testing.assert_close(ours[index][key], value, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["adamw_bf16_states", "adamw_8bit_states"])
def test_compact_states_load_as_saved(name):
    m, swapped = resumed(name, wrap=True)
    saved = SAVED[name]["optimizer"]
    reloaded = swapped.state_dict()
    assert reloaded["param_groups"][0][so.compact.FORMAT_KEY] == saved["param_groups"][0][so.compact.FORMAT_KEY]
    for index, entry in saved["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(reloaded["state"][index][key], value, rtol=0, atol=0)
    train(m, swapped)  # and training goes on from them
    assert all(torch.isfinite(p).all() for p in m.parameters())
