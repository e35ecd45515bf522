"""Python face of the fused packed Adam op: its fake kernel, a typed wrapper and
a helper that lays parameters' states out in one arena."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import _C  # (also loads the library that defines the op)

# The layout table's columns, as the extension names them (csrc/kernels/adam_vocabulary.h).
LAYOUT_COLUMNS = _C.layout_columns
ABSENT = -1
_op = torch.ops.swap_optimizer.fused_adam_packed


@torch.library.register_fake("swap_optimizer::fused_adam_packed")
def _fused_adam_packed_fake(params, grads, arena, layout, steps, *, lr, beta1, beta2, eps,
                            weight_decay, amsgrad, maximize, decoupled_weight_decay,
                            state_dtype=None, grad_scale=None, found_inf=None, rounding_seed=None):
    torch._check(len(params) == len(grads), lambda: "one grad per param")
    torch._check(layout.dim() == 2 and layout.shape[0] == len(params) and layout.shape[1] == len(LAYOUT_COLUMNS),
                 lambda: f"one layout row per param, with columns {LAYOUT_COLUMNS}")
    torch._check(steps.dim() == 1 and steps.dtype == torch.float32, lambda: "steps is a 1-D float32 step table")
    return None


def fused_adam_packed(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    arena: torch.Tensor,
    layout: torch.Tensor,
    steps: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    decoupled_weight_decay: bool = True,
    state_dtype: Optional[torch.dtype] = None,
    grad_scale: Optional[torch.Tensor] = None,
    found_inf: Optional[torch.Tensor] = None,
    rounding_seed: Optional[int] = None,
) -> None:
    """One Adam (decoupled_weight_decay=False) or AdamW update of a batch of params.

    ``arena`` is a 1-D uint8 tensor on the params' device holding every state;
    ``layout`` (CPU int64, one row per param, columns LAYOUT_COLUMNS) gives the
    byte offset of each state (-1 when absent), the elements of the param the
    row updates (``numel`` of them from ``param_offset``: a piece of a param
    split across calls) and its step count, ``steps[step_index]``: a 1-D float32
    step table on the params' device. Every row computes its bias corrections
    from that count + 1; a row with ``advance_step`` 1 writes the count back
    incremented, as torch.optim does, so the pieces of a param advance it once,
    with their last. When ``found_inf`` is non-zero nothing is written at all.

    Compact states: ``state_dtype=torch.uint8`` makes rows with an
    ``exp_avg_absmax`` offset 8-bit (codes at the moments' offsets, one float32
    absmax per 256 elements at the absmax offsets; other rows keep the param's
    dtype); a ``compensation`` offset keeps a Kahan buffer (16-bit params);
    ``rounding_seed`` (with ``state_dtype=torch.bfloat16``) rounds the moments
    stochastically, keyed by ``random_key`` and ``global_offset`` + element.
    """
    params, grads = list(params), list(grads)
    for index, (p, g) in enumerate(zip(params, grads)):
        # The dispatcher would route a sparse tensor to a backend we do not
        # implement and say so in its own words; name the problem here instead.
        if p.layout != torch.strided or g.layout != torch.strided:
            raise ValueError(f"fused_adam_packed: param {index}: sparse params or grads are not supported; "
                             "use dense tensors")
    _op(params, grads, arena, layout, steps, lr=float(lr), beta1=float(betas[0]),
        beta2=float(betas[1]), eps=float(eps), weight_decay=float(weight_decay), amsgrad=amsgrad,
        maximize=maximize, decoupled_weight_decay=decoupled_weight_decay, state_dtype=state_dtype,
        grad_scale=grad_scale, found_inf=found_inf, rounding_seed=rounding_seed)


def plan_packed_layout(
    params: Sequence[torch.Tensor],
    *,
    amsgrad: bool = False,
    state_dtype: Optional[torch.dtype] = None,
    master_weights: bool = False,
    alignment: int = 256,
    start: int = 0,
) -> tuple[torch.Tensor, int]:
    """Places each param's states one after another, each region aligned to
    ``alignment`` bytes from ``start``. Returns the layout table (whole params,
    param i's step count at steps[i]) and the arena bytes it needs. Master
    copies are kept only for 16-bit params."""
    if alignment <= 0:
        raise ValueError(f"alignment must be a positive number of bytes, got {alignment}")
    rows = []
    cursor = start

    def take(nbytes: int) -> int:
        nonlocal cursor
        cursor = -(-cursor // alignment) * alignment
        offset = cursor
        cursor += nbytes
        return offset

    for index, p in enumerate(params):
        dtype = state_dtype or p.dtype
        state_bytes = p.numel() * dtype.itemsize
        exp_avg = take(state_bytes)
        exp_avg_sq = take(state_bytes)
        max_exp_avg_sq = take(state_bytes) if amsgrad else ABSENT
        master = take(p.numel() * 4) if master_weights and p.dtype != torch.float32 else ABSENT
        row = dict.fromkeys(LAYOUT_COLUMNS, ABSENT)
        row.update(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, max_exp_avg_sq=max_exp_avg_sq, master=master,
                   numel=p.numel(), param_offset=0, step_index=index, advance_step=1, random_key=index,
                   global_offset=0)
        rows.append(list(row.values()))
    layout = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), len(LAYOUT_COLUMNS))
    return layout, cursor
