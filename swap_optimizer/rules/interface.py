"""The interface every rule implements (structurally: a rule need not
inherit it). SwapOptimizer calls these and nothing else of a rule; `opt` is
the SwapOptimizer, handed to each call, never kept."""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch

from ..config import SwapOptimizerConfig


@runtime_checkable
class UpdateRule(Protocol):
    optimizer: torch.optim.Optimizer  # the wrapped optimizer

    # --- the settings it supports, and why it refuses the others
    def check_wrap(self, config: SwapOptimizerConfig) -> None:
        """Raises, naming the fix, for a setting or group flag it cannot run."""

    def check_params(self, params: list) -> None:
        """Raises for params it cannot update (DTensors of a non-elementwise rule)."""

    def unscales_in_step(self, setting: Optional[bool]) -> bool:
        """Whether GradScaler hands step() its scale and inf flag (refuses True where it cannot take them)."""

    # --- the state layout it needs
    def start(self, opt, existing: dict) -> None:
        """Lays out the first store, filled from the wrapped optimizer's state."""

    def lay_out_empty(self, opt) -> None:
        """Lays out a store for the current params with no state in it (a move of the store fills it)."""

    @property
    def views(self) -> Optional[list[dict]]:
        """Per param, its state views in the store."""

    # --- the update
    def step(self, opt) -> None:
        """Updates every param with a grad (after SwapOptimizer.step's common part)."""

    def step_waited(self, opt, failed: bool = False) -> None:
        """A deferred step was waited for (failed: it stopped)."""

    # --- state dicts and param groups
    def state_dict_extras(self, opt, state_dict: dict[str, Any]) -> None:
        """Adds what its format needs to torch's state dict."""

    def load_state_dict(self, opt, state_dict: dict[str, Any]) -> None:
        """Checks the whole state dict, then writes it into the store (a refusal changes nothing)."""

    def add_param_group(self, opt, param_group: dict) -> None:
        """Adds the group and lays the store out again with its params."""

    # --- what the store's layout does not hold
    def memory_stats(self, opt) -> dict[str, Any]:
        """Its entries of SwapOptimizer.memory_stats()."""

    def bookkeeping(self) -> dict:
        """What a move of the store must carry over (which params show a state, scalars)."""

    def restore_bookkeeping(self, opt, kept: dict) -> None:
        """Takes bookkeeping() back after a move."""

    def release(self) -> None:
        """Drops every view of the store."""
