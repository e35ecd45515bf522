"""Optimizers whose update SwapOptimizer runs with torch's own code, batch by
batch, on the staged states: one declaration each.

A declaration says how the optimizer class is matched, what it refuses, which
states a param keeps under its group's settings (name, kind, shape) and
whether the rule is elementwise (a param may then be cut into pieces). The
update is always torch's own step, called on a stand-in of the optimizer whose
param groups hold the batch's params (or pieces of them) and whose state holds
the staged views (see run_torch_update): nothing of torch's math is copied
here, so the results are the wrapped optimizer's, bit for bit.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..codec import STATE_KINDS

# Kinds of state:
#  "element": param-shaped, in the param's dtype; cut with the param.
#  "whole": another shape (Adafactor's row and column variances); its param is never cut.
#  "scalar": a per-param number or 0-dim tensor (step counts, NAdam's
#     mu_product, ASGD's eta and mu): kept by SwapOptimizer where torch keeps
#     it, never swapped. Every piece of a cut param starts from its value
#     before the step; the last piece's result is kept.
ELEMENT, WHOLE, SCALAR = "element", "whole", "scalar"


# What a compact state (state_dtype=torch.bfloat16 or torch.uint8) of an
# element state is, as swap_optimizer.codec.STATE_CODE_FORMS names it: the map
# and rounding of its 8-bit codes (bf16 ones round stochastically, whatever
# the kind).
SIGNED, DENOMINATOR, ACCUMULATOR, RUNNING_MAX, DECAYING_MAX, RAW_DENOMINATOR = STATE_KINDS


@dataclass(frozen=True)
class StateSpec:
    name: str
    kind: str
    # "whole" only: the state's shape for a param of this shape.
    shape: Optional[Callable[[torch.Size], tuple[int, ...]]] = None
    # "element" only: the state's kind under compact states (SIGNED: a
    # momentum, nearest code of the signed map; DENOMINATOR: a positive state
    # under a square root or in a divisor, unsigned map, never rounded to 0
    # where it is not 0; RUNNING_MAX: a running maximum, unsigned map, rounded
    # up so it stays a maximum; DECAYING_MAX: a maximum that decays each step,
    # max(beta * state, |grad|), kept in bf16 under 8-bit too: rounded up or
    # to nearest, a decay smaller than half an 8-bit code's spacing would
    # leave the code where it is forever, where bf16's stochastic rounding
    # keeps the decay in expectation; RAW_DENOMINATOR: a denominator that
    # divides the raw grad, with no momentum between it and the step, also
    # kept in bf16 under 8-bit: an 8-bit code's error scales that element's
    # every step; ACCUMULATOR: a sum that only grows (Adagrad's), a
    # denominator in 8-bit and exact under bf16: its increments end far below
    # a bf16 ulp of the sum, and stochastic rounding makes each element's sum a
    # random walk of several percent, which the 1,000-step parity showed 2.6%
    # above the exact loss), or None: the state stays exact (Rprop's prev and step
    # sizes, a state not worth compacting).
    code: Optional[str] = None


@dataclass(frozen=True)
class Declaration:
    """One optimizer that runs torch's own update.

    states(param, group): the states the param keeps under its group's
        settings now (they are fixed at its first step, as torch's are).
    elementwise: the update of each element reads only that element of the
        param, its grad and its states (plus scalars): a param may be cut.
    validate(optimizer): raises for what SwapOptimizer cannot run exactly.
    """

    classes: tuple[type, ...]
    # None: learned from the states each param has after its first update
    # (an optimizer the user vouches for; see trusted_declaration).
    states: Optional[Callable[[torch.Tensor, dict], list[StateSpec]]]
    elementwise: bool
    validate: Optional[Callable[[torch.optim.Optimizer], None]] = None
    # torch's fused path takes GradScaler's grad_scale and found_inf (fused
    # Adam, AdamW, SGD and Adagrad): unscale_in_step works when every group is fused.
    takes_grad_scale: bool = False
    # An estimate of the device bytes torch's update allocates beyond the
    # staged states for one call: (rows: (shape, element bytes) of the params
    # or pieces, the call's group, whether it runs foreach) -> bytes.
    temporaries: Optional[Callable[[list, dict, bool], int]] = None
    # What foreach=None runs: torch's default picks foreach on CUDA for most
    # optimizers (_default_to_fused_or_foreach); Adafactor keeps its for-loop.
    foreach_by_default_on_cuda: bool = True
    # Whether a 16-bit param of this group may be cut on the CPU (group -> bool).
    # torch's CPU kernels may round a 16-bit element differently in their
    # vectorised body and their scalar tail (an `add(..., alpha=)` fuses a
    # multiply-add in the body only), and where tails fall depends on how the
    # threads share a tensor, so a cut can change torch's own result (SGD's
    # does, and Adam's L2 weight decay). Say True only for settings a test
    # proves cut and whole bitwise alike for every implementation flag
    # (tests/rules/test_rules.py::test_cut_16_bit_params_on_cpu_where_declared);
    # None: never.
    cuts_16_bit_on_cpu: Optional[Callable[[dict], bool]] = None
    # Which optimizers match beyond the classes themselves (subclasses that
    # keep the class's step); None: the classes only.
    also_matches: Optional[Callable[[torch.optim.Optimizer], bool]] = None

    def matches(self, optimizer: torch.optim.Optimizer) -> bool:
        # The class itself, not a subclass: a subclass may change the step.
        return type(optimizer) in self.classes or (self.also_matches is not None and self.also_matches(optimizer))


# Rows below: (shape, element bytes) of the params or pieces of one call.
def _elementwise_temporaries(rows, group, foreach):
    """torch's foreach path keeps up to three batch-sized lists of
    intermediates (weight decay, nesterov, denominators: Adadelta's three),
    its for-loop up to three of one param at a time (NAdam, RAdam, Rprop);
    its fused kernels none."""
    if group.get("fused"):
        return 0
    sizes = [math.prod(shape) * element for shape, element in rows]
    return 3 * (sum(sizes) if foreach else max(sizes, default=0))


def _muon_temporaries(rows, group, foreach):
    """Newton-Schulz in bf16 on an (m, n) matrix, m <= n: its iterate, the
    m x m products and the next iterate, about 6mn + 4m^2 bytes; plus the
    momentum blend, one param's worth; one matrix at a time."""
    return max((6 * min(shape) * max(shape) + 4 * min(shape) ** 2 + math.prod(shape) * element
                for shape, element in rows), default=0)


def _adafactor_temporaries(rows, group, foreach):
    """About three param-sized tensors per param: the negated grad (maximize),
    the variance estimate (row_var @ col_var, or the squared grad of a vector)
    and the update. The for-loop (torch's default for Adafactor, on CUDA too)
    makes them one param at a time; foreach=True makes each as a list over
    every param of the call, so they are counted for all of them."""
    sizes = [math.prod(shape) * element for shape, element in rows]
    return 3 * (sum(sizes) if foreach else max(sizes, default=0))


def estimated_temporaries(declaration: "Declaration", rows: list, group: dict, device: torch.device,
                          new_state_bytes: int) -> int:
    """What one call of torch's update allocates on the device beyond the
    staged states: the declaration's estimate, plus new_state_bytes (at a
    param's first step torch makes its states on the device, and they are
    copied into the arena after the call)."""
    foreach = group.get("foreach")
    if foreach is None:  # torch's default: mostly foreach on CUDA, the for-loop on the CPU
        foreach = device.type == "cuda" and declaration.foreach_by_default_on_cuda
    return (declaration.temporaries or _elementwise_temporaries)(rows, group, bool(foreach)) + new_state_bytes


def _elements(*names: str) -> list[StateSpec]:
    return [StateSpec(name, ELEMENT) for name in names]


def _compact(**codes: str) -> list[StateSpec]:
    """Element states with their compact kinds, in order (name=kind)."""
    return [StateSpec(name, ELEMENT, code=code) for name, code in codes.items()]


def _scalars(*names: str) -> list[StateSpec]:
    return [StateSpec(name, SCALAR) for name in names]


_ADAM_STEP = inspect.unwrap(torch.optim.Adam.step)


def keeps_adam_step(optimizer: torch.optim.Optimizer) -> bool:
    """An Adam or AdamW, or a subclass that keeps their step (a framework's)."""
    return isinstance(optimizer, torch.optim.Adam) and inspect.unwrap(type(optimizer).step) is _ADAM_STEP


def _adam_cuts_16_bit_on_cpu(group: dict) -> bool:
    """Adam/AdamW's update ops round alike in torch's vector body and scalar
    tail, except the L2 weight decay's `grad.add(param, alpha=weight_decay)`
    of the for-loop and foreach paths (fused computes it per element)."""
    l2_decay = group["weight_decay"] != 0 and not group.get("decoupled_weight_decay", False)
    return bool(group.get("fused")) or not l2_decay


def _adam_states(param, group):
    # (compact states of Adam/AdamW run the packed kernel, whose forms these are too)
    states = _scalars("step") + _compact(exp_avg=SIGNED, exp_avg_sq=DENOMINATOR)
    if group["amsgrad"]:
        states += _compact(max_exp_avg_sq=RUNNING_MAX)
    return states


def _sgd_states(param, group):
    return _compact(momentum_buffer=SIGNED) if group["momentum"] != 0 else []


def _rmsprop_states(param, group):
    # Centered, the denominator is sqrt(square_avg - grad_avg**2), a difference
    # of two states that is a small fraction of either where the grads agree:
    # their rounding errors would make it negative (a NaN update), so both stay
    # exact; momentum_buffer is compact either way. square_avg divides the raw
    # grad (RAW_DENOMINATOR): in 8-bit codes the 1,000-step parity ended 3.9%
    # above the exact loss, in bf16 0.1% (momentum_buffer's 8-bit: no change).
    centered = group["centered"]
    states = _scalars("step") + [StateSpec("square_avg", ELEMENT, code=None if centered else RAW_DENOMINATOR)]
    if group["momentum"] > 0:
        states += _compact(momentum_buffer=SIGNED)
    if centered:
        states += _elements("grad_avg")
    return states


def _adafactor_states(param, group):
    if param.dim() < 2:
        return _scalars("step") + _elements("variance")
    return _scalars("step") + [StateSpec("row_var", WHOLE, lambda shape: (*shape[:-1], 1)),
                               StateSpec("col_var", WHOLE, lambda shape: (*shape[:-2], 1, shape[-1]))]


def _validate_adafactor(optimizer):
    # eps=(None, ...) takes eps1 from the dtype of the first param torch's call
    # sees in the group; batch by batch that could be another param's dtype.
    for index, group in enumerate(optimizer.param_groups):
        if group["eps"][0] is None and len({p.dtype for p in group["params"]}) > 1:
            raise ValueError(f"SwapOptimizer: param group {index} of Adafactor mixes param dtypes "
                             f"{sorted(str(p.dtype) for p in {p.dtype: p for p in group['params']}.values())} with "
                             "eps=(None, ...): torch takes eps1 from the dtype of the first param of its call, which "
                             "batch by batch may be another one. Give eps1 explicitly (eps=(1e-30, 1e-3), say), or "
                             "one dtype per group")


def _validate_muon(optimizer):
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p.dim() != 2:
                raise ValueError(f"SwapOptimizer: param group {index} of Muon holds a {p.dim()}-D param "
                                 f"(shape {tuple(p.shape)}); Muon updates 2-D matrices only (torch's Muon would "
                                 "fail mid-step). Give embeddings, norms, biases and the head to an AdamW (its own "
                                 "SwapOptimizer beside this one)")


DECLARATIONS: list[Declaration] = [
    # With default states Adam and AdamW run torch's own update (bitwise); compact
    # states, master weights and Kahan summation run the packed kernel instead.
    Declaration((torch.optim.Adam, torch.optim.AdamW), _adam_states, elementwise=True, takes_grad_scale=True,
                cuts_16_bit_on_cpu=_adam_cuts_16_bit_on_cpu, also_matches=keeps_adam_step),
    Declaration((torch.optim.SGD,), _sgd_states, elementwise=True, takes_grad_scale=True),
    Declaration((torch.optim.Adagrad,), lambda p, g: _scalars("step") + _compact(sum=ACCUMULATOR), elementwise=True,
                takes_grad_scale=True),
    Declaration((torch.optim.RMSprop,), _rmsprop_states, elementwise=True),
    # (acc_delta: the numerator's square root, sqrt(acc_delta + eps) / sqrt(square_avg + eps); a
    # positive state rounded to 0 would scale the update by sqrt(eps) alone)
    Declaration((torch.optim.Adadelta,), lambda p, g: _scalars("step") + _compact(square_avg=DENOMINATOR,
                                                                                    acc_delta=DENOMINATOR),
                elementwise=True),
    Declaration((torch.optim.Adamax,), lambda p, g: _scalars("step") + _compact(exp_avg=SIGNED, exp_inf=DECAYING_MAX),
                elementwise=True),
    Declaration((torch.optim.NAdam,), lambda p, g: _scalars("step", "mu_product") + _compact(
        exp_avg=SIGNED, exp_avg_sq=DENOMINATOR), elementwise=True),
    Declaration((torch.optim.RAdam,), lambda p, g: _scalars("step") + _compact(exp_avg=SIGNED, exp_avg_sq=DENOMINATOR),
                elementwise=True),
    # (ax, the average of the params, is read by no update: signed, like a weight)
    Declaration((torch.optim.ASGD,), lambda p, g: _scalars("step", "eta", "mu") + _compact(ax=SIGNED),
                elementwise=True),
    # prev (the last grad's sign test) and step_size (per-element step sizes, multiplied up and
    # down by etas every step): kept exact, compact states leave Rprop as it is.
    Declaration((torch.optim.Rprop,), lambda p, g: _scalars("step") + _elements("prev", "step_size"),
                elementwise=True),
    # Adafactor reads param.norm(): never cut, even 1-D.
    Declaration((torch.optim.Adafactor,), _adafactor_states, elementwise=False, validate=_validate_adafactor,
                temporaries=_adafactor_temporaries, foreach_by_default_on_cuda=False),
    # Muon's Newton-Schulz iteration needs the whole matrix: never cut.
    Declaration((torch.optim.Muon,), lambda p, g: _elements("momentum_buffer"), elementwise=False,
                validate=_validate_muon, temporaries=_muon_temporaries),
]

# Refused outright, with the reason.
REFUSED = {
    torch.optim.LBFGS: "LBFGS keeps one history for all params together (flat direction and step vectors) and "
                       "re-evaluates the closure inside step(); there is no per-param state to stream",
    torch.optim.SparseAdam: "SparseAdam updates only the rows a sparse grad touches; SwapOptimizer streams dense "
                            "states",
}


def declaration_for(optimizer: torch.optim.Optimizer) -> Optional[Declaration]:
    return next((d for d in DECLARATIONS if d.matches(optimizer)), None)
