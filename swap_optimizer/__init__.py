"""swap-optimizer: AdamW with its state in pinned host memory, streamed through
small device staging arenas during step()."""

import os

import torch  # noqa: F401  (loads libtorch, which _C links against)

try:
    from . import _C
except ImportError as error:
    _here = os.path.dirname(os.path.abspath(__file__))
    if not any(name.startswith("_C.") for name in os.listdir(_here)):
        raise ImportError(
            f"swap_optimizer: the compiled extension (_C) is not built in {_here}: this is the source folder, "
            "which Python imported instead of the installed package because it is on sys.path (the current "
            "directory). Run from another directory, or with `python -P` (Python 3.11+), or install here with "
            "`pip install --no-build-isolation .`") from error
    raise
from .budget import StepCostModel
from .compact import dequantize_state_dict
from .config import STATE_KEYS, SwapOptimizerConfig
from .ops import LAYOUT_COLUMNS, fused_adam_packed, plan_packed_layout
from .optimizer import SwapOptimizer

__all__ = ["SwapOptimizer", "SwapOptimizerConfig", "StepCostModel", "STATE_KEYS", "built_with_cuda", "fused_adam_packed",
           "plan_packed_layout", "LAYOUT_COLUMNS", "dequantize_state_dict"]


def built_with_cuda() -> bool:
    """True when this build of the extension contains the CUDA kernels."""
    return bool(_C.built_with_cuda())
