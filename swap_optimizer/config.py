"""SwapOptimizerConfig: every setting of SwapOptimizer, validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

# The states Adam/AdamW keep per param, plus the optional fp32 master copy.
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


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
    state_keys: which states go to host memory (None: all the optimizer keeps,
        from STATE_KEYS); the others stay on the device.
    min_numel: params with fewer elements keep their state on the device.
    num_arenas: staging arenas on the device (>= 2); with 3 or more, copies in
        and out run on separate streams, both directions of the link at once.
    state_dtype: None keeps states in the param's dtype, as torch does;
        torch.float32 keeps fp32 states for 16-bit params.
    master_weights: keep an fp32 master copy of each 16-bit param, swapped like
        the states; the param is its rounding after every step.
    pin_memory: page-locked host memory (falls back to pageable with a warning).
    keep_arenas: keep the staging arenas allocated between steps.
    staging_budget_bytes: when set, swap_times becomes the smallest count whose
        arenas fit in this many bytes (swap_times is then ignored).
    unscale_in_step: whether GradScaler hands step() its scale and inf flag
        to unscale and skip on the device (no host sync per step), as for
        torch's fused AdamW. None follows the wrapped optimizer (fused=True:
        yes); frameworks that refuse such optimizers with gradient clipping
        (Lightning's bf16-mixed) then accept a plain AdamW.
    """

    swap_times: int = 16
    state_keys: Optional[tuple[str, ...]] = None
    min_numel: int = 1024
    num_arenas: int = 2
    state_dtype: Optional[torch.dtype] = None
    master_weights: bool = False
    pin_memory: bool = True
    keep_arenas: bool = False
    staging_budget_bytes: Optional[int] = None
    unscale_in_step: Optional[bool] = None

    def __post_init__(self) -> None:
        _check_int("swap_times", self.swap_times, 1)
        _check_int("min_numel", self.min_numel, 0)
        _check_int("num_arenas", self.num_arenas, 2)
        for name in ("master_weights", "pin_memory", "keep_arenas"):
            _check_bool(name, getattr(self, name))
        if self.state_dtype not in (None, torch.float32):
            raise ValueError("SwapOptimizerConfig.state_dtype must be None (the param's dtype) or "
                             f"torch.float32, got {self.state_dtype!r}")
        if self.staging_budget_bytes is not None:
            _check_int("staging_budget_bytes", self.staging_budget_bytes, 1)
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
            unknown = [k for k in keys if k not in STATE_KEYS]
            if unknown:
                raise ValueError(f"SwapOptimizerConfig.state_keys: unknown state key(s) {unknown}; "
                                 f"choose from {STATE_KEYS}")
            if len(set(keys)) != len(keys):
                raise ValueError(f"SwapOptimizerConfig.state_keys names a key twice: {keys}")
            object.__setattr__(self, "state_keys", keys)

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

    def swaps(self, key: str) -> bool:
        """Whether state `key` of a swappable param lives in host memory."""
        return self.state_keys is None or key in self.state_keys
