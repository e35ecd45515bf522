"""swap-optimizer: a torch.optim optimizer (Adam/AdamW, every other torch.optim
optimizer with per-param state, or one you vouch for) with its state in
pinned host memory, streamed through small device staging arenas during
step(): SwapOptimizer(torch.optim.AdamW(model.parameters()), swap_times=8)."""

import os

import torch  # noqa: F401  (loads libtorch, which _C links against)


def _check_torch_matches_build() -> None:
    """A C++ extension runs only with the torch it was compiled against:
    refuses another one, naming both and the command that rebuilds."""
    try:
        from ._build_info import CUDA_VERSION, SOURCE_FOLDER, TORCH_VERSION
    except ImportError:  # the source folder, or a build that predates the record
        return
    if (torch.__version__, torch.version.cuda) == (TORCH_VERSION, CUDA_VERSION):
        return

    def named(version, cuda):
        return f"torch {version} ({f'CUDA {cuda}' if cuda else 'a CPU build'})"

    where = f"the swap-optimizer source folder ({SOURCE_FOLDER})" if os.path.isfile(
        os.path.join(SOURCE_FOLDER, "setup.py")) else "the swap-optimizer source folder"
    raise ImportError(
        f"swap_optimizer was built against {named(TORCH_VERSION, CUDA_VERSION)}, but this Python has "
        f"{named(torch.__version__, torch.version.cuda)}: the compiled extension runs only with the torch it was built "
        "against. A plain `pip install .` builds in an isolated environment with the newest torch from the index; "
        f"rebuild against the installed one, in {where}: `pip install setuptools wheel ninja && "
        "pip install --no-build-isolation --force-reinstall --no-deps .`")


_check_torch_matches_build()

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

__all__ = ["SwapOptimizer", "SwapOptimizerConfig", "StepCostModel", "STATE_KEYS", "build_info", "built_with_cuda", "fused_adam_packed",
           "plan_packed_layout", "LAYOUT_COLUMNS", "dequantize_state_dict"]


def build_info() -> dict:
    """What the installed extension was compiled against: {"torch": version,
    "cuda": version or None, "cuda_kernels": bool}."""
    from . import _build_info

    return {"torch": _build_info.TORCH_VERSION, "cuda": _build_info.CUDA_VERSION,
            "cuda_kernels": _build_info.WITH_CUDA_KERNELS}


def built_with_cuda() -> bool:
    """True when this build of the extension contains the CUDA kernels."""
    return bool(_C.built_with_cuda())
