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

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# Kinds of state:
#  "element": param-shaped, in the param's dtype; cut with the param.
#  "whole": another shape (Adafactor's row and column variances); its param is never cut.
#  "scalar": a per-param number or 0-dim tensor (step counts, NAdam's
#     mu_product, ASGD's eta and mu): kept by SwapOptimizer where torch keeps
#     it, never swapped. Every piece of a cut param starts from its value
#     before the step; the last piece's result is kept.
ELEMENT, WHOLE, SCALAR = "element", "whole", "scalar"


@dataclass(frozen=True)
class StateSpec:
    name: str
    kind: str
    # "whole" only: the state's shape for a param of this shape.
    shape: Optional[Callable[[torch.Size], tuple[int, ...]]] = None


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
    # SGD and Adagrad): unscale_in_step works when every group is fused.
    takes_grad_scale: bool = False
    # An estimate of the device bytes torch's update allocates beyond the
    # staged states for one call: (rows: (shape, element bytes) of the params
    # or pieces, the call's group, whether it runs foreach) -> bytes.
    temporaries: Optional[Callable[[list, dict, bool], int]] = None
    # What foreach=None runs: torch's default picks foreach on CUDA for most
    # optimizers (_default_to_fused_or_foreach); Adafactor keeps its for-loop.
    foreach_by_default_on_cuda: bool = True

    def matches(self, optimizer: torch.optim.Optimizer) -> bool:
        # The class itself, not a subclass: a subclass may change the step.
        return type(optimizer) in self.classes


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


def _scalars(*names: str) -> list[StateSpec]:
    return [StateSpec(name, SCALAR) for name in names]


def _sgd_states(param, group):
    return _elements("momentum_buffer") if group["momentum"] != 0 else []


def _rmsprop_states(param, group):
    states = _scalars("step") + _elements("square_avg")
    if group["momentum"] > 0:
        states += _elements("momentum_buffer")
    if group["centered"]:
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
    Declaration((torch.optim.SGD,), _sgd_states, elementwise=True, takes_grad_scale=True),
    Declaration((torch.optim.Adagrad,), lambda p, g: _scalars("step") + _elements("sum"), elementwise=True,
                takes_grad_scale=True),
    Declaration((torch.optim.RMSprop,), _rmsprop_states, elementwise=True),
    Declaration((torch.optim.Adadelta,), lambda p, g: _scalars("step") + _elements("square_avg", "acc_delta"),
                elementwise=True),
    Declaration((torch.optim.Adamax,), lambda p, g: _scalars("step") + _elements("exp_avg", "exp_inf"),
                elementwise=True),
    Declaration((torch.optim.NAdam,), lambda p, g: _scalars("step", "mu_product") + _elements("exp_avg", "exp_avg_sq"),
                elementwise=True),
    Declaration((torch.optim.RAdam,), lambda p, g: _scalars("step") + _elements("exp_avg", "exp_avg_sq"),
                elementwise=True),
    Declaration((torch.optim.ASGD,), lambda p, g: _scalars("step", "eta", "mu") + _elements("ax"), elementwise=True),
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


def _validate_trusted(optimizer):
    name = type(optimizer).__name__
    # Schedule-free optimizers swap their params and states in train() and
    # eval(), outside step(), where the states are in host memory.
    touching = [method for method in ("train", "eval") if callable(getattr(type(optimizer), method, None))]
    if touching:
        raise TypeError(f"SwapOptimizer cannot wrap {name}: its {' and '.join(m + '()' for m in touching)} "
                        "read or write its states outside step() (as schedule-free optimizers do), and "
                        "between steps SwapOptimizer keeps them in host memory; keep this optimizer's state "
                        "on the device")


def trusted_declaration(optimizer: torch.optim.Optimizer, elementwise: bool) -> Declaration:
    """An optimizer SwapOptimizer has no declaration for, wrapped on the
    user's word (trust_per_param_step): its states are learned per param,
    and its params are cut only on the second word (trust_elementwise_step)."""
    return Declaration((type(optimizer),), None, elementwise, _validate_trusted)


def _torch_step(optimizer: torch.optim.Optimizer):
    """The class's own step, without the per-instance and global step hooks
    that torch wraps it in (those run once per SwapOptimizer.step())."""
    step = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def _fingerprint(value) -> tuple:
    """What shows an in-place change of an attribute: a tensor's version, a
    container's members (by identity, tensors by version)."""
    if torch.is_tensor(value):
        return ("tensor", id(value), value._version)
    if isinstance(value, (list, tuple)):
        return ("sequence", tuple(_fingerprint(v) if torch.is_tensor(v) else id(v) for v in value))
    if isinstance(value, dict):
        return ("mapping", tuple((k, _fingerprint(v) if torch.is_tensor(v) else id(v)) for k, v in value.items()))
    if isinstance(value, set):
        return ("set", frozenset(id(v) for v in value))
    return ("object", id(value))


def foreign_state_keys(state: dict, param_ids: set) -> list[str]:
    """The keys of an optimizer's `state` that are not among its params."""
    return sorted(f"a tensor of shape {tuple(key.shape)}" if torch.is_tensor(key) else repr(key)
                  for key in state if not torch.is_tensor(key) or id(key) not in param_ids)


_DEVICE_ERRORS = tuple(error for error in (getattr(torch, "AcceleratorError", None),) if error is not None)


def run_torch_update(optimizer: torch.optim.Optimizer, groups: list[dict], state: dict,
                     strict: bool = False, grad_scale: Optional[dict] = None) -> None:
    """torch's own step of `optimizer`'s class over `groups` (param groups
    holding the batch's params or pieces, with .grad set) and `state` (their
    staged states): on a shallow copy of the optimizer, so the wrapped one's
    groups and state stay as they are. grad_scale: GradScaler's grad_scale
    and found_inf, which torch's fused step reads from the optimizer. strict:
    an attribute the step sets on the optimizer (lost with the copy) raises,
    naming it."""
    stand_in = object.__new__(type(optimizer))
    stand_in.__dict__.update(optimizer.__dict__, param_groups=groups, state=state, **(grad_scale or {}))
    before = {key: _fingerprint(value) for key, value in optimizer.__dict__.items()} if strict else None
    try:
        _torch_step(optimizer)(stand_in)
    except Exception as error:
        # torch's own optimizers' errors are theirs to word; so are a lack of
        # memory and a device's failure, whoever's step met them.
        if not strict or isinstance(error, (torch.OutOfMemoryError, *_DEVICE_ERRORS)):
            raise
        raise RuntimeError(
            f"SwapOptimizer: {type(optimizer).__name__}'s own step raised {type(error).__name__}: {error}, where "
            "SwapOptimizer ran it on a part of the params (one param, or one batch) with the states it has kept for "
            "them. An optimizer whose step needs more than its params' own states and its param groups (a value "
            "set outside step(), a state under another key, the other params) cannot be wrapped, whatever "
            "trust_per_param_step says: keep its state on the device") from error
    if strict:
        changed = sorted(key for key, value in optimizer.__dict__.items()
                         if key not in ("param_groups", "state") and _fingerprint(value) != before[key])
        if changed:
            raise RuntimeError(f"SwapOptimizer: {type(optimizer).__name__}'s step changed the optimizer's "
                               f"attribute(s) {changed} in place, outside its params' states and param groups; "
                               "SwapOptimizer runs the step batch by batch and cannot keep such a value. This "
                               "optimizer cannot be wrapped; keep its state on the device (the attribute has "
                               "been changed)")
        params = {id(p) for group in groups for p in group["params"]}
        foreign = foreign_state_keys(state, params)
        if foreign:
            raise RuntimeError(f"SwapOptimizer: {type(optimizer).__name__}'s step keeps state under {foreign}, keys "
                               "that are not params (a step counter shared by all params, say); SwapOptimizer runs "
                               "the step batch by batch and cannot keep such a value. This optimizer cannot be "
                               "wrapped; keep its state on the device")
        written = sorted(key for key, value in stand_in.__dict__.items() if key not in ("param_groups", "state")
                         and (key not in optimizer.__dict__ or optimizer.__dict__[key] is not value))
        if written:
            raise RuntimeError(f"SwapOptimizer: {type(optimizer).__name__}'s step wrote the optimizer's attribute(s) "
                               f"{written}, outside its params' states and param groups; SwapOptimizer runs the "
                               "step batch by batch and cannot keep such a value. This optimizer cannot be wrapped; "
                               "keep its state on the device")
