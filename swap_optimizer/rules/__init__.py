"""How a SwapOptimizer updates a batch: a rule. One interface, three rules:

- fused_kernel.PackedKernelRule: the packed fused Adam/AdamW kernel, for the
  settings torch has no update for (compact states, master weights, Kahan);
- torch_update.TorchUpdateRule: torch's own update of the wrapped class on
  the staged views, for every declared optimizer (declarations.py);
- vouched_for.VouchedForRule: the same for an optimizer the user vouches
  for, its states learned and its contract probed.

Each rule (see TorchUpdateRule for the reference) says what it refuses
(check_wrap, check_params, unscales_in_step), lays out the store for the
states it needs (start, lay_out_empty, views), updates (step), converts
state dicts (state_dict_extras, load_state_dict), follows new param groups
(add_param_group), finishes what a deferred step leaves for its wait
(step_waited), and keeps what the store's layout does not hold
(bookkeeping, restore_bookkeeping, release). The SwapOptimizer hands itself
to each call; a rule never keeps a reference to it.
"""

from __future__ import annotations

import torch

from ..config import SwapOptimizerConfig
from .declarations import DECLARATIONS, REFUSED, Declaration, declaration_for, keeps_adam_step
from .fused_kernel import PackedKernelRule, needs_packed_kernel
from .interface import UpdateRule
from .torch_update import TorchUpdateRule
from .vouched_for import VouchedForRule, trusted_declaration


def choose_rule(optimizer: torch.optim.Optimizer, config: SwapOptimizerConfig):
    """The rule that updates `optimizer` under `config`, or a TypeError that
    says why none does (and which setting vouches for an optimizer)."""
    name = type(optimizer).__name__
    refused = next((reason for cls, reason in REFUSED.items() if isinstance(optimizer, cls)), None)
    if refused is not None:
        raise TypeError(f"SwapOptimizer cannot wrap {name}: {refused}")
    declaration = declaration_for(optimizer)
    if declaration is not None:
        if keeps_adam_step(optimizer) and needs_packed_kernel(config):
            return PackedKernelRule(optimizer, declaration)
        return TorchUpdateRule(optimizer, declaration)
    if config.trust_per_param_step:
        return VouchedForRule(optimizer, trusted_declaration(optimizer, config.trust_elementwise_step))
    supported = ", ".join(sorted(cls.__name__ for d in DECLARATIONS for cls in d.classes))
    raise TypeError(f"SwapOptimizer wraps torch.optim's {supported} (the classes themselves; Adam and AdamW also "
                    f"subclasses that keep their step); got {name}. For an optimizer of your own or from a package, "
                    "SwapOptimizer cannot prove from outside that its step treats each param on its own (a global "
                    "norm, Prodigy's d): if it does, pass trust_per_param_step=True (see 'Optimizers of your own' "
                    "in docs/usage.md)")


__all__ = ["DECLARATIONS", "REFUSED", "Declaration", "PackedKernelRule", "TorchUpdateRule", "VouchedForRule",
           "UpdateRule", "choose_rule", "declaration_for"]
