"""One table of the optimizers SwapOptimizer wraps, with their kwargs variants
and what SwapOptimizer can do with each, as data (in the spirit of torch's
OptimizerInfo, torch/testing/_internal/common_optim.py).
tests/rules/test_optimizer_capabilities.py runs every capability over it: a
capability set False makes that optimizer's rows skip or assert the refusal.

The capabilities say what the library does today: every optimizer here is
bitwise its plain self with default states (Adam/AdamW through torch's own
update, as the others)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

import torch
from torch import nn

# Lion written by hand, an optimizer SwapOptimizer has no declaration for: the
# benchmark measures its learned path, the tests wrap it on trust.
from swap_optimizer.bench.host_overhead import Lion  # noqa: F401  (imported from here by the tests)


# The implementations torch offers, as the flags that pick them.
IMPLEMENTATIONS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class OptimizerCase:
    """One optimizer: how to make it, its kwargs variants, what SwapOptimizer
    does with it.

    cls: the optimizer class (torch.optim's, or one defined in the tests).
    variants: variant name -> kwargs; each capability runs over every variant.
    settings: SwapOptimizer settings the wrap needs (a vouched-for one's
        trust_per_param_step).
    fused, foreach: torch has that implementation of the optimizer (fused=True,
        foreach=True); parity runs each, and the for-loop (foreach=False, or no
        flag where the class takes none: `flags`).
    flags: the class takes foreach/fused flags at all (the for-loop is then
        foreach=False; Muon and Lion take none).
    dtypes: the param dtypes (of DTYPES) its rows run: where torch supports them
        and SwapOptimizer wraps them.
    bitwise: bitwise the plain optimizer with the same flags (params and every
        state).
    compact: state_dtype=torch.bfloat16 / torch.uint8: True, accepted and
        its states move fewer bytes; "exact", accepted with a warning that its
        states are not worth quantizing and stay exact (Rprop); False, refused
        with the reason (not elementwise); or a dict of those per
        mode ("bf16", "8bit": Adagrad's sum stays exact under bf16).
    kahan: kahan_summation=True accepted for 16-bit params (a compensation
        each; torch's update on a float32 stand-in, or Adam's packed kernel),
        else refused with the reason (not elementwise).
    split: a large param may be cut into pieces across batches (else it moves
        whole at any swap_times).
    overlap: overlap_forward=True accepted and bitwise the run without it.
    overlap_deferred: with overlap, step() returns before the update ran
        (a vouched-for optimizer's step completes inside step()).
    fsdp2: DTensor params (FSDP2) accepted (else refused at the wrap).
    vouched_for: no declaration in swap_optimizer.rules; wrapped on the
        user's word (trust_per_param_step=True).
    only_2d: the optimizer updates 2-D params only (Muon).
    sign_update: the update is the sign of a state (Lion): compact states
        flip it where the state is near 0, a whole step for those few
        elements, so compact parity bounds the mean difference, not the
        largest.
    """

    name: str
    cls: type
    variants: dict
    settings: dict = field(default_factory=dict)
    fused: bool = False
    foreach: bool = True
    flags: bool = True
    dtypes: tuple = ("fp32", "bf16")
    bitwise: bool = True
    compact: Union[bool, str, dict] = False
    kahan: bool = True
    split: bool = True
    overlap: bool = True
    overlap_deferred: bool = True
    fsdp2: bool = True
    vouched_for: bool = False
    only_2d: bool = False
    sign_update: bool = False

    def make(self, variant: str, implementation: str = "for-loop") -> Callable[[list], torch.optim.Optimizer]:
        """params -> a new optimizer of this case's variant and implementation."""
        kwargs = dict(self.variants[variant], **(IMPLEMENTATIONS[implementation] if self.flags else {}))
        return lambda params: self.cls(params, **kwargs)

    def has(self, implementation: str) -> bool:
        return implementation == "for-loop" or getattr(self, implementation.replace("-", "_"))

    def params(self, dtype=torch.float32, device="cpu") -> Callable[[], list]:
        """A maker of fresh params (random, never zeros; the same values at
        every call): a 2-D param whose states are cut into pieces (of at least
        64 KiB each) at swap_times 4, a 1-D one of one piece, and two small
        ones; for only_2d three small 2-D ones. None above 32,768 elements,
        and Muon's matrices below 32 x 32: larger ones run torch's CPU kernels
        on several threads, which on a loaded machine take milliseconds an op
        (a bf16 matmul of Muon's 10 ms instead of 0.1)."""
        shapes = [(16, 24), (16, 20), (12, 16)] if self.only_2d else [(128, 256), (16384,), (24, 20), (5,)]

        def make():
            generator = torch.Generator().manual_seed(1)
            return [nn.Parameter(torch.randn(*s, generator=generator).to(device, dtype)) for s in shapes]
        return make


CASES = [
    OptimizerCase("Adam", torch.optim.Adam, {
        "default": dict(lr=1e-2),
        "amsgrad-maximize-wd": dict(lr=1e-2, amsgrad=True, maximize=True, weight_decay=0.01),
    }, fused=True, compact=True),
    OptimizerCase("AdamW", torch.optim.AdamW, {
        "default": dict(lr=1e-2, weight_decay=0.1),
        "amsgrad": dict(lr=1e-2, amsgrad=True, betas=(0.8, 0.95)),
    }, fused=True, compact=True),
    OptimizerCase("SGD", torch.optim.SGD, {
        "momentum-dampening-wd": dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
        "nesterov-maximize": dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True),
    }, fused=True, compact=True),
    OptimizerCase("Adagrad", torch.optim.Adagrad, {
        "decay-wd-init": dict(lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1),
        "maximize": dict(lr=0.1, maximize=True),
    }, fused=True, compact={"bf16": "exact", "8bit": True}),
    OptimizerCase("RMSprop", torch.optim.RMSprop, {
        "centered-momentum-wd": dict(lr=0.01, momentum=0.5, centered=True, weight_decay=0.01),
        "plain": dict(lr=0.01),
    }, compact=True),
    OptimizerCase("Adadelta", torch.optim.Adadelta, {
        "wd": dict(weight_decay=0.01),
        "maximize-rho": dict(lr=0.5, rho=0.8, maximize=True),
    }, compact=True),
    OptimizerCase("Adamax", torch.optim.Adamax, {
        "wd": dict(lr=1e-2, weight_decay=0.01),
        "maximize": dict(lr=1e-2, maximize=True),
    }, compact=True),
    OptimizerCase("NAdam", torch.optim.NAdam, {
        "decoupled-wd": dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01),
        "momentum-decay": dict(lr=1e-2, momentum_decay=8e-3),
    }, compact=True),
    OptimizerCase("RAdam", torch.optim.RAdam, {
        "wd": dict(lr=1e-2, weight_decay=0.01),
        "decoupled-wd": dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01),
    }, compact=True),
    OptimizerCase("ASGD", torch.optim.ASGD, {
        "t0-wd": dict(lr=1e-2, t0=2, weight_decay=0.01),
        "maximize": dict(lr=1e-2, maximize=True),
    }, compact=True),
    OptimizerCase("Rprop", torch.optim.Rprop, {
        "default": dict(),
        "maximize-etas": dict(lr=1e-2, etas=(0.4, 1.3), maximize=True),
    }, compact="exact"),
    OptimizerCase("Adafactor", torch.optim.Adafactor, {
        "default": dict(lr=1e-2),
        "wd-beta2-decay": dict(lr=1e-2, weight_decay=0.01, beta2_decay=-0.5),
    }, split=False, fsdp2=False, kahan=False),
    OptimizerCase("Muon", torch.optim.Muon, {
        "default": dict(lr=1e-2),
        "no-nesterov-wd": dict(lr=1e-2, nesterov=False, weight_decay=0.01),
    }, foreach=False, flags=False, split=False, fsdp2=False, only_2d=True, kahan=False),
    OptimizerCase("Lion", Lion, {
        "default": dict(lr=1e-3),
        "wd-betas": dict(lr=1e-3, weight_decay=0.5, betas=(0.8, 0.9)),
    }, settings=dict(trust_per_param_step=True, trust_elementwise_step=True,
                     trusted_state_kinds={"exp_avg": "signed"}), foreach=False, flags=False,
        # bf16: the first step's check of trust_elementwise_step finds Lion's
        # update of a bf16 param cut in two unlike the whole one on the CPU,
        # and refuses (the declared optimizers never cut 16-bit params there);
        # with Kahan its update runs on a float32 stand-in, which cuts exactly.
        dtypes=("fp32",), vouched_for=True, compact=True, sign_update=True),
]
BY_NAME = {case.name: case for case in CASES}


def rows(*dimensions, slow_variants=False):
    """pytest params over every (case, variant), crossed with `dimensions`
    (lists of names), each row's id: case-variant[-name...]. slow_variants:
    the rows of each case's variants after its first are marked slow (for a
    test whose cost is in the pipeline, not in the hyper-parameters)."""
    import itertools

    import pytest

    params = []
    for case in CASES:
        for number, variant in enumerate(case.variants):
            marks = [pytest.mark.slow] if slow_variants and number > 0 else []
            for extra in itertools.product(*dimensions):
                params.append(pytest.param(case, variant, *extra, id="-".join((case.name, variant, *extra)),
                                           marks=marks))
    return params
