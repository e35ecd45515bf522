"""swap-optimizer: AdamW with its state in pinned host memory, streamed through
small device staging arenas during step()."""

import torch  # noqa: F401  (loads libtorch, which _C links against)

from . import _C
from .config import STATE_KEYS, SwapOptimizerConfig
from .ops import LAYOUT_COLUMNS, fused_adam_packed, plan_packed_layout
from .optimizer import SwapOptimizer

__all__ = ["SwapOptimizer", "SwapOptimizerConfig", "STATE_KEYS", "built_with_cuda", "fused_adam_packed",
           "plan_packed_layout", "LAYOUT_COLUMNS"]


def built_with_cuda() -> bool:
    """True when this build of the extension contains the CUDA kernels."""
    return bool(_C.built_with_cuda())
