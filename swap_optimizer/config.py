"""SwapOptimizerConfig: every setting of SwapOptimizer, validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Union

import torch

from . import _C
from .budget import StepCostModel
from .codec import STATE_KINDS

# Per key of the runtime's Adam/AdamW state, the state key whose placement it
# follows (each moment's absmax scales follow the moment), from the
# extension's one table (csrc/kernels/adam_vocabulary.h).
_RUNTIME_KEYS = _C.adam_runtime_key_owners
# The states Adam/AdamW keep per param, plus the optional fp32 master copy and
# Kahan compensation buffer: the keys that follow themselves. (8-bit moments
# keep their codes and scales where the moment's key says.)
STATE_KEYS = tuple(key for key, owner in zip(_C.adam_runtime_keys, _RUNTIME_KEYS) if key == owner)
_STATE_DTYPES = (None, torch.float32, torch.bfloat16, torch.uint8)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"SwapOptimizerConfig.{name} must be an int >= {minimum}, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"SwapOptimizerConfig.{name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class SwapOptimizerConfig:
    """How SwapOptimizer keeps and moves the optimizer state.

    swap_times: batches per step; each batch's states pass through a staging
        arena, so staging memory is about num_arenas / swap_times of the state.
        None: 16, or the device budget's choice.
    state_keys: which states go to host memory (None: all the optimizer keeps;
        Adam/AdamW's are STATE_KEYS, another optimizer's are its own state
        names, such as SGD's momentum_buffer); the others stay on the device.
        Names are checked against the wrapped optimizer.
    min_numel: params with fewer elements keep their state on the device.
    num_arenas: staging arenas on the device (>= 2); with 3 or more, copies in
        and out run on separate streams, both directions of the link at once.
        None: 2, or the device budget's choice.
    state_dtype: how the moments are stored. None: in the param's dtype, as
        torch does; torch.float32: fp32 for 16-bit params; torch.bfloat16: bf16,
        rounded stochastically (see rounding_seed); torch.uint8: blockwise 8-bit
        codes (256 elements per fp32 absmax, bitsandbytes' dynamic maps) for
        params of at least 4096 elements, the param's dtype for smaller ones.
    master_weights: keep an fp32 master copy of each 16-bit param, swapped like
        the states; the param is its rounding after every step.
    kahan_summation: keep a 16-bit Kahan compensation buffer per 16-bit param,
        swapped like a state, that carries what rounding the param lost; half
        the bytes of master_weights (exclusive with it).
    rounding_seed: seeds the stochastic rounding of bf16 states (those of
        state_dtype=torch.bfloat16, and under torch.uint8 those kept in bf16,
        as Adamax's exp_inf), keyed by param index, state, element index in
        the whole param and step, so results do not depend on batching,
        device or rank. None: torch's initial seed. Saved in the state dict.
    pin_memory: page-locked host memory (falls back to pageable with a warning).
    keep_arenas: keep the staging arenas allocated between steps.
    staging_budget_bytes: when set, swap_times becomes the smallest count whose
        arenas fit in this many bytes (exclusive with swap_times). With
        device_budget_bytes: a cap on the staging part of the budget.
    device_budget_bytes: the device bytes the optimizer's states may take in
        all: the resident store (min_numel and state_keys residents too), the
        staging arenas and step table, torch's update temporaries (other
        optimizers than Adam), contiguous copies of strided params and grads,
        and GradScaler's clones, each rounded as torch's allocator rounds. The
        planner keeps resident, per param in param order, the state that fits
        beside the staging, and chooses swap_times and num_arenas (unless
        given) for the least predicted step time (see plan_report()).
        "auto": after auto_warmup_steps whole iterations with the plan as
        given, the budget becomes the device's free memory (the allocator's
        cached blocks included) plus what this optimizer holds, less the
        iterations' measured peak and auto_headroom_bytes; the states move to
        the new plan once, at that step boundary (docs/usage.md).
    auto_warmup_steps: iterations (forward, backward, step) measured before
        an "auto" budget is derived.
    auto_headroom_bytes: device bytes an "auto" budget leaves free.
    cost_model: the StepCostModel the planner predicts step times with; None:
        StepCostModel.for_device (the link measured once per process).
    unscale_in_step: whether GradScaler hands step() its scale and inf flag
        to unscale and skip on the device (no host sync per step), as for
        torch's fused AdamW. None follows the wrapped optimizer (fused=True:
        yes); frameworks that refuse such optimizers with gradient clipping
        (Lightning's bf16-mixed) then accept a plain AdamW.
    overlap_forward: step() enqueues the step and returns; the updates run
        beside the next forward, whose blocks wait for their own params
        (SwapOptimizer's model= argument says which module to hook). Results
        are bitwise those without it. See SwapOptimizer.wait().
    trust_per_param_step: wrap an optimizer SwapOptimizer has no declaration
        for (one of your own, or from a package), on your word that its
        step() reads only each param's own grad and states plus its param
        group and writes nothing else, and that its states are plain tensors
        or numbers. Its states are learned at each param's first update, run
        whole on the device. Ignored for the optimizers SwapOptimizer declares.
    trust_elementwise_step: also cut such a param into pieces, on your word
        that each element's update reads only that element of the param, its
        grad and its param-shaped states (no per-param norm, as in LAMB).
        Needs trust_per_param_step=True.
    trusted_state_kinds: for such an optimizer under state_dtype=torch.bfloat16
        or torch.uint8 (and trust_elementwise_step=True), each param-shaped
        state's name -> its kind, which picks its 8-bit map and rounding:
        "signed" (a momentum), "denominator" (under a square root or in a
        divisor), "running_max", "decaying_max", "raw_denominator",
        "accumulator" (docs/usage.md, 'Compact states'), or None to keep
        that state exact. A learned state it does not name is refused at its
        first update, which changes nothing.
    """

    swap_times: Optional[int] = None
    state_keys: Optional[tuple[str, ...]] = None
    min_numel: int = 1024
    num_arenas: Optional[int] = None
    state_dtype: Optional[torch.dtype] = None
    master_weights: bool = False
    kahan_summation: bool = False
    rounding_seed: Optional[int] = None
    pin_memory: bool = True
    keep_arenas: bool = False
    staging_budget_bytes: Optional[int] = None
    unscale_in_step: Optional[bool] = None
    overlap_forward: bool = False
    trust_per_param_step: bool = False
    trust_elementwise_step: bool = False
    trusted_state_kinds: Optional[dict[str, Optional[str]]] = None
    device_budget_bytes: Optional[Union[int, str]] = None
    cost_model: Optional[StepCostModel] = None
    auto_warmup_steps: int = 3
    auto_headroom_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.swap_times is not None:
            _check_int("swap_times", self.swap_times, 1)
        _check_int("min_numel", self.min_numel, 0)
        if self.num_arenas is not None:
            _check_int("num_arenas", self.num_arenas, 2)
        for name in ("master_weights", "kahan_summation", "pin_memory", "keep_arenas", "overlap_forward",
                     "trust_per_param_step", "trust_elementwise_step"):
            _check_bool(name, getattr(self, name))
        if self.trust_elementwise_step and not self.trust_per_param_step:
            raise ValueError("SwapOptimizerConfig: trust_elementwise_step=True is a second promise on top of "
                             "trust_per_param_step=True; set both, or neither")
        if self.trusted_state_kinds is not None:
            self._check_trusted_state_kinds()
        if self.state_dtype not in _STATE_DTYPES:
            raise ValueError("SwapOptimizerConfig.state_dtype must be None (the param's dtype), torch.float32, "
                             f"torch.bfloat16 or torch.uint8 (8-bit blockwise), got {self.state_dtype!r}")
        if self.kahan_summation and self.master_weights:
            raise ValueError("SwapOptimizerConfig: kahan_summation=True and master_weights=True both keep what "
                             "rounding 16-bit params loses; set one of kahan_summation and master_weights")
        if self.rounding_seed is not None:
            if isinstance(self.rounding_seed, bool) or not isinstance(self.rounding_seed, int) \
                    or not 0 <= self.rounding_seed < 2 ** 63:
                raise ValueError("SwapOptimizerConfig.rounding_seed must be None or an int in [0, 2**63), got "
                                 f"{self.rounding_seed!r}")
            if self.state_dtype not in (torch.bfloat16, torch.uint8):
                raise ValueError("SwapOptimizerConfig.rounding_seed seeds the stochastic rounding of bf16 states "
                                 "(state_dtype=torch.bfloat16, and under torch.uint8 the states kept in bf16, as "
                                 "Adamax's exp_inf); set state_dtype=torch.bfloat16 or drop rounding_seed")
        if self.staging_budget_bytes is not None:
            _check_int("staging_budget_bytes", self.staging_budget_bytes, 1)
            if self.swap_times is not None and self.device_budget_bytes is None:
                raise ValueError("SwapOptimizerConfig: staging_budget_bytes chooses swap_times; set one of "
                                 "swap_times and staging_budget_bytes")
        if self.device_budget_bytes is not None and self.device_budget_bytes != "auto":
            if isinstance(self.device_budget_bytes, str):
                raise ValueError("SwapOptimizerConfig.device_budget_bytes must be None, an int >= 1 or 'auto', got "
                                 f"{self.device_budget_bytes!r}")
            _check_int("device_budget_bytes", self.device_budget_bytes, 1)
        _check_int("auto_warmup_steps", self.auto_warmup_steps, 1)
        _check_int("auto_headroom_bytes", self.auto_headroom_bytes, 0)
        if self.cost_model is not None and not isinstance(self.cost_model, StepCostModel):
            raise ValueError("SwapOptimizerConfig.cost_model must be None or a swap_optimizer.StepCostModel, got "
                             f"{self.cost_model!r}")
        if self.unscale_in_step is not None:
            _check_bool("unscale_in_step", self.unscale_in_step)
        if self.state_keys is not None:
            if isinstance(self.state_keys, str) or not hasattr(self.state_keys, "__iter__"):
                raise ValueError("SwapOptimizerConfig.state_keys must be None or a sequence of names "
                                 f"from {STATE_KEYS}, got {self.state_keys!r}")
            keys = tuple(self.state_keys)  # read once: it may be a generator
            if not all(isinstance(k, str) for k in keys):
                raise ValueError("SwapOptimizerConfig.state_keys must be None or a sequence of names "
                                 f"from {STATE_KEYS}, got {keys!r}")
            if len(set(keys)) != len(keys):
                raise ValueError(f"SwapOptimizerConfig.state_keys names a key twice: {keys}")
            object.__setattr__(self, "state_keys", keys)

    def _check_trusted_state_kinds(self) -> None:
        kinds = self.trusted_state_kinds
        if not self.trust_per_param_step:
            raise ValueError("SwapOptimizerConfig.trusted_state_kinds names the states of an optimizer wrapped on "
                             "trust_per_param_step=True; set it too, or drop trusted_state_kinds (a declared "
                             "optimizer's kinds are known)")
        if not isinstance(kinds, dict) or not all(isinstance(name, str) and (kind is None or kind in STATE_KINDS)
                                                  for name, kind in kinds.items()):
            raise ValueError("SwapOptimizerConfig.trusted_state_kinds must be a dict of state name -> one of "
                             f"{list(STATE_KINDS)} or None (kept exact), got {kinds!r}")
        object.__setattr__(self, "trusted_state_kinds", dict(kinds))  # the caller's dict may change later

    @classmethod
    def from_fields(cls, config: Optional["SwapOptimizerConfig"], overrides: dict[str, Any]) -> "SwapOptimizerConfig":
        """`config` (or the defaults) with `overrides` applied; unknown names are refused."""
        if config is not None and not isinstance(config, cls):
            raise TypeError(f"config must be a SwapOptimizerConfig or None, got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"SwapOptimizer got unknown setting(s) {unknown}; the settings are {sorted(known)}")
        values = {f.name: getattr(config, f.name) for f in fields(cls)} if config is not None else {}
        values.update(overrides)
        return cls(**values)

    @property
    def fixed_swap_times(self) -> int:
        """swap_times where no budget chooses it."""
        return 16 if self.swap_times is None else self.swap_times

    @property
    def fixed_num_arenas(self) -> int:
        """num_arenas where no budget chooses it."""
        return 2 if self.num_arenas is None else self.num_arenas

    def check_adam_state_keys(self) -> None:
        """state_keys names only Adam/AdamW's states."""
        unknown = [k for k in (self.state_keys or ()) if k not in STATE_KEYS]
        if unknown:
            raise ValueError(f"SwapOptimizerConfig.state_keys: unknown state key(s) {unknown}; "
                             f"choose from {STATE_KEYS}")

    def swaps(self, key: str) -> bool:
        """Whether state `key` of a swappable param lives in host memory."""
        return self.state_keys is None or key in self.state_keys

    def runtime_swap_keys(self) -> list[bool]:
        """swaps() for each of the runtime's state keys (scales follow their moment)."""
        return [self.swaps(key) for key in _RUNTIME_KEYS]
