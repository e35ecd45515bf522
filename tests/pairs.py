"""A plain optimizer and its SwapOptimizer-wrapped twin trained side by side
(run_pair), and the bitwise comparisons the tests make of them."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

import swap_optimizer as so


def bits(tensor):
    """The tensor's bits, so that NaNs (fp16 RMSprop overflows) compare too."""
    return tensor.detach().reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                              8: torch.int64}[tensor.element_size()])


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def give_grads(step, *param_lists):
    """Fresh random grads for `step` (never zeros), the same for each list's
    param at one position."""
    generator = torch.Generator().manual_seed(100 + step)
    for params in zip(*param_lists):
        grad = torch.randn(params[0].shape, generator=generator).to(params[0].device, params[0].dtype)
        for p in params:
            p.grad = grad.clone()


def assert_same_state(plain, swapped):
    """Every state bitwise the plain optimizer's; scalars (0-dim) on the
    device torch keeps them on, swapped states in host memory."""
    ours, theirs = swapped.state_dict(), plain.state_dict()
    swapped_keys = set(swapped.memory_stats()["swapped_state_keys"])
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert ours["state"][index].keys() == entry.keys(), index
        for key, value in entry.items():
            mine = ours["state"][index][key]
            if torch.is_tensor(value):
                swapped_here = key in swapped_keys and value.dim() > 0
                assert mine.device == (torch.device("cpu") if swapped_here else value.device), (index, key)
                assert same_bits(mine.cpu(), value.cpu()), (index, key)
            else:
                assert mine == value, (index, key)


class Pair(NamedTuple):
    plain: torch.optim.Optimizer
    swapped: so.SwapOptimizer
    plain_params: list
    swapped_params: list

    def states(self):
        """(plain, swapped) state dicts' "state" entries."""
        return self.plain.state_dict()["state"], self.swapped.state_dict()["state"]


def run_pair(make: Callable[[list], torch.optim.Optimizer], make_params: Callable[[], list], steps: int,
             exact: bool = False, first_step: int = 0, **settings) -> Pair:
    """make(params) -> the optimizer, plain and (another instance) wrapped with
    `settings` (min_numel=0 unless given); make_params() -> fresh params, the
    same values at every call. Both take `steps` steps on the same fresh
    random grads. exact: assert params, states and param groups bitwise."""
    a, b = make_params(), make_params()
    plain = make(a)
    swapped = so.SwapOptimizer(make(b), **dict(dict(min_numel=0), **settings))
    for step in range(first_step, first_step + steps):
        give_grads(step, a, b)
        plain.step()
        swapped.step()
    if exact:
        for p, q in zip(a, b):
            assert same_bits(p, q)
        assert swapped.state_dict()["param_groups"] == plain.state_dict()["param_groups"]
        assert_same_state(plain, swapped)
    return Pair(plain, swapped, a, b)
