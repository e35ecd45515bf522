"""Compact states on torch's update path (TorchUpdateRule): how a declared
element state is stored (exact, bf16 rounded stochastically, or blockwise
8-bit codes and scales), the scratch torch's update runs on, and the batched
codec calls that fill it from the staged compact form and write it back.

A param's compact state S is stored under
- bf16: S itself, a bfloat16 tensor (2 bytes an element);
- 8-bit: S_codes (uint8, param-shaped) and S_absmax (float32, one scale per
  block of 256 elements from the param's first, so a cut, on a multiple of
  256 elements, shares the scales out block by block).
Each batch decodes its compact states into scratch tensors in the dtype torch
keeps the state in (float32 for float32 params, the param's dtype for 16-bit
ones), runs torch's update on them, and encodes them back: one codec call per
kind per batch, on the arena's device. See docs/design.md, 'Compact states on
torch's update path'.
"""

from __future__ import annotations

import threading
import warnings
from typing import Optional

import torch

from ..codec import (BLOCK_SIZE, STATE_CODE_FORMS, decode_blockwise_8bit, encode_bf16_stochastic,
                     encode_blockwise_8bit)
from ..compact import MIN_QUANTIZED_NUMEL
from .declarations import ACCUMULATOR, DECAYING_MAX, DENOMINATOR, RAW_DENOMINATOR, RUNNING_MAX

BF16, EIGHT_BIT = "bf16", "8bit"
CODES, ABSMAX = "_codes", "_absmax"
# Kinds of state that must not decode to 0 where the stored value is not 0
# (a denominator, a running maximum), and the value an fp16 scratch gets there.
NEVER_ZERO = (DENOMINATOR, RUNNING_MAX, DECAYING_MAX, RAW_DENOMINATOR, ACCUMULATOR)
# Kinds kept in bf16 (stochastic) under 8-bit too, and kinds kept exact under
# bf16 (see StateSpec.code).
BF16_UNDER_8BIT = (DECAYING_MAX, RAW_DENOMINATOR)
EXACT_UNDER_BF16 = (ACCUMULATOR,)
FP16_SMALLEST = 2.0 ** -24


def compact_of(state_dtype: Optional[torch.dtype]) -> Optional[str]:
    return {torch.bfloat16: BF16, torch.uint8: EIGHT_BIT}.get(state_dtype)


def compacts(compact: Optional[str], code: Optional[str]) -> bool:
    """Whether a state of kind `code` is stored compact under `compact` (on a
    param large enough, of another dtype than bf16: form_for)."""
    return compact is not None and code is not None and not (compact == BF16 and code in EXACT_UNDER_BF16)


def form_for(compact: Optional[str], code: Optional[str], param: torch.Tensor,
             dtype: Optional[torch.dtype] = None, numel: Optional[int] = None) -> Optional[str]:
    """The form one element state of `param` (the whole param: a DTensor's
    global numel, or `numel` where given, as the planner gives the unsharded
    size of a rank's shard) is stored in: None (exact) where the state has no
    compact kind, under 8-bit where the param has fewer than
    MIN_QUANTIZED_NUMEL elements (as Adam's), and under bf16 where torch keeps
    the state in bf16 itself (`dtype`, the dtype torch's update runs the param
    in: its own, or float32 for a 16-bit one with Kahan, see update_dtype).
    Under 8-bit, a kind of BF16_UNDER_8BIT is stored as under bf16; under
    bf16, a kind of EXACT_UNDER_BF16 stays exact."""
    if not compacts(compact, code):
        return None
    if compact == EIGHT_BIT:
        if (param.numel() if numel is None else numel) < MIN_QUANTIZED_NUMEL:
            return None
        if code not in BF16_UNDER_8BIT:
            return EIGHT_BIT
    return None if (dtype or param.dtype) == torch.bfloat16 else BF16


def store_keys(name: str, form: Optional[str], param_dtype: torch.dtype,
               dtype: Optional[torch.dtype] = None) -> list[tuple[str, str, torch.dtype]]:
    """(store key, store kind, dtype) of one element state in `form`."""
    if form == EIGHT_BIT:
        return [(name + CODES, "element", torch.uint8), (name + ABSMAX, "block", torch.float32)]
    if form == BF16:
        return [(name, "element", torch.bfloat16)]
    return [(name, "element", dtype or param_dtype)]


def scratch_bytes_per_element(forms: list[Optional[str]], param_dtype: torch.dtype, kahan: bool = False) -> int:
    """Device bytes the scratch of one element of a param takes beyond its
    staged states: one scratch element per compact state, plus a float32
    copy of each bf16 one for the rounding when the param is 16-bit
    (`param_dtype`: the dtype torch's update runs it in), plus with Kahan the
    float32 stand-in param and grad (KAHAN_SCRATCH_BYTES)."""
    size = torch.empty((), dtype=param_dtype).element_size()
    total = KAHAN_SCRATCH_BYTES if kahan else 0
    for form in forms:
        if form is not None:
            total += size + (4 if form == BF16 and size != 4 else 0)
    return total


# Kahan summation on torch's update path (kahan_summation=True). A 16-bit
# param keeps its compensation, what rounding it lost, as an element state
# COMPENSATION in its dtype; torch's update runs on a float32 stand-in
# (param + compensation) with a float32 grad and float32 states, and the
# result is split back into the rounded param and the new remainder.
COMPENSATION = "compensation"
KAHAN_SCRATCH_BYTES = 8  # per element: the float32 stand-in param and grad


def kahan_applies(param: torch.Tensor, kahan_summation: bool) -> bool:
    """Whether `param` keeps a Kahan compensation: 16-bit params only."""
    return kahan_summation and param.element_size() == 2


def warn_if_no_16_bit(params: list, kahan_summation: bool) -> None:
    """kahan_summation=True on params none of which is 16-bit does nothing: a
    warning (from a rule's check_wrap, called by SwapOptimizer.__init__)."""
    if kahan_summation and not any(p.dtype != torch.float32 for p in params):
        warnings.warn("SwapOptimizer: kahan_summation=True applies to 16-bit params, and this optimizer has "
                      "none; it does nothing here", UserWarning, stacklevel=4)


def update_dtype(param: torch.Tensor, kahan_summation: bool) -> torch.dtype:
    """The dtype torch's update runs `param` in: float32 for a 16-bit param
    with Kahan (the stand-in), else its own."""
    return torch.float32 if kahan_applies(param, kahan_summation) else param.dtype


def kahan_stand_in(piece: torch.Tensor, grad: torch.Tensor, compensation: Optional[torch.Tensor]) -> torch.Tensor:
    """The float32 param torch's update runs on for a 16-bit `piece`: the
    piece plus its compensation (None: a first step, 0), its grad float32."""
    with torch.no_grad():
        stand_in = piece.float() if compensation is None else piece.float() + compensation.float()
    stand_in.grad = grad.float()
    return stand_in


def kahan_round(stand_in: torch.Tensor, piece: torch.Tensor, compensation: torch.Tensor) -> None:
    """After torch's update: the piece becomes the stand-in rounded to nearest
    in its dtype and the compensation what that rounding lost, both written
    through `.data` (the write bumps no version counter: a bump is a write
    outside step(), which zeroes the compensation)."""
    with torch.no_grad():
        rounded = stand_in.to(piece.dtype)
        compensation.data.copy_((stand_in - rounded.float()).to(compensation.dtype))
        piece.data.copy_(rounded)


def blocks(count: int) -> int:
    return -(-count // BLOCK_SIZE)


class ScratchPool:
    """Host memory for the decoded states of the CPU backend's batches, kept
    from batch to batch within a step: a fresh allocation per batch costs
    page faults on every batch (a seventh of a bf16 SGD step on 4M elements)
    and cold caches. One batch at a time holds it (lend), from its first
    scratch to the end of its update: the CPU's codec ops are synchronous,
    so its encode has read the scratches when the batch returns. A batch
    that finds it lent (another thread, or a batch inside a batch) allocates
    its own. A scratch that does not fit is a fresh allocation, and the
    buffer grows to what that batch took, for the next ones; the step's last
    batch frees the buffers (unless the arenas are kept), so between steps
    the pool holds nothing, as the arenas. CUDA scratches come from torch's
    caching allocator instead."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._taken: dict[torch.dtype, int] = {}  # this loan's elements so far, per dtype
        self._lock = threading.Lock()

    def lend(self) -> bool:
        if not self._lock.acquire(blocking=False):
            return False
        self._taken = {}
        return True

    def give_back(self, free: bool) -> None:
        """Ends the loan. free: drop the buffers (the step's last batch, or a
        failed one); else a buffer shorter than what the batch took grows to
        it (its scratches are no longer read: the batch has returned)."""
        try:
            if free:
                self._buffers.clear()
            else:
                for dtype, elements in self._taken.items():
                    buffer = self._buffers.get(dtype)
                    if buffer is None or buffer.numel() < elements:
                        self._buffers[dtype] = torch.empty(elements, dtype=dtype, device="cpu")
        finally:
            self._lock.release()

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The next `shape` elements of the buffer for `dtype`, or a fresh
        CPU tensor where the buffer is too short."""
        numel, start = shape.numel(), self._taken.get(dtype, 0)
        self._taken[dtype] = start + numel
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < start + numel:
            return torch.empty(shape, dtype=dtype, device="cpu")
        return buffer[start:start + numel].view(shape)


class BatchCodec:
    """The compact states of one batch: decoded into scratch before torch's
    update (one call per kind), encoded back after it (one call per kind).
    With a lent ScratchPool (CPU) the scratches are the pool's."""

    def __init__(self, device: torch.device, seed: Optional[int], pool: Optional[ScratchPool] = None) -> None:
        self.device, self.seed, self.pool = device, seed, pool
        self._decode_8bit: list[tuple] = []   # (codes, absmax, scratch, map)
        self._decode_bf16: list[tuple] = []   # (stored, scratch)
        self._kept_positive: list[tuple] = []  # (stored, scratch): fp16 scratches of never-0 states
        self._encode_8bit: list[tuple] = []   # (values, codes, absmax, map, rounding)
        self._encode_bf16: list[tuple] = []   # (values, out, param index, state index, offset, step)

    def scratch(self, form: str, code: str, views: dict, name: str, shape, param_dtype: torch.dtype) -> torch.Tensor:
        """A scratch of the state for torch's update, filled by decode(), in
        the dtype of the param torch's update runs on (`param_dtype`:
        update_dtype's, so float32 for a 16-bit param with Kahan), as torch
        keeps its element states: its fused and foreach paths need the param's
        dtype, and its for-loop would run mixed precision silently."""
        if self.pool is None:
            scratch = torch.empty(shape, dtype=param_dtype, device=self.device)
        else:
            scratch = self.pool.take(torch.Size(shape), param_dtype)
        stored = views[name + CODES] if form == EIGHT_BIT else views[name]
        if form == EIGHT_BIT:
            self._decode_8bit.append((stored, views[name + ABSMAX], scratch, STATE_CODE_FORMS[code][0]))
        else:
            self._decode_bf16.append((stored, scratch))
        if scratch.dtype == torch.float16 and code in NEVER_ZERO:
            self._kept_positive.append((stored, scratch))
        return scratch

    def decode(self) -> None:
        if self._decode_8bit:
            codes, absmax, out, maps = zip(*self._decode_8bit)
            decode_blockwise_8bit([c.view(-1) for c in codes], absmax, [o.view(-1) for o in out], maps)
        if self._decode_bf16:
            stored, out = zip(*self._decode_bf16)
            torch._foreach_copy_(list(out), list(stored))
        for stored, scratch in self._kept_positive:
            # fp16's range ends at 2**-24: a small positive value decodes to 0
            # there, and a 0 denominator divides by eps alone (itself 0 in
            # fp16); such a value becomes fp16's smallest positive instead.
            scratch.masked_fill_((scratch == 0) & (stored.view(scratch.shape) != 0), FP16_SMALLEST)

    def write_back(self, form: str, code: str, views: dict, name: str, value: torch.Tensor, param_index: int,
                   state_index: int, offset: int, step: int) -> None:
        """Queues the encode of `value` (the state after torch's update) into the store's views."""
        if form == EIGHT_BIT:
            _, rounding = STATE_CODE_FORMS[code]
            self._encode_8bit.append((value.detach().reshape(-1).contiguous(), views[name + CODES].view(-1),
                                      views[name + ABSMAX], STATE_CODE_FORMS[code][0], rounding))
        else:
            self._encode_bf16.append((value.detach().reshape(-1).float().contiguous(), views[name].view(-1),
                                      param_index, state_index, offset, step))

    def encode(self) -> None:
        if self._encode_8bit:
            values, codes, absmax, maps, rounding = zip(*self._encode_8bit)
            encode_blockwise_8bit(values, codes, absmax, maps, rounding)
        if self._encode_bf16:
            values, out, params, states, offsets, steps = zip(*self._encode_bf16)
            encode_bf16_stochastic(values, out, seed=self.seed, param_index=params, state_index=states,
                                   global_offset=offsets, step=steps)


def encode_exact(value: torch.Tensor, form: str, code: str, views: dict, name: str) -> None:
    """Loads a state given in torch's form into the store's compact form:
    8-bit codes by the state's rule; bf16 rounded to nearest (a load draws no
    random bits)."""
    with torch.no_grad():
        if form == EIGHT_BIT:
            codes, absmax = views[name + CODES], views[name + ABSMAX]
            device_values = value.detach().to(codes.device).reshape(-1).contiguous()
            if not device_values.is_floating_point() or device_values.dtype == torch.float64:
                device_values = device_values.float()
            encode_blockwise_8bit([device_values], [codes.view(-1)], [absmax], [STATE_CODE_FORMS[code][0]],
                                  [STATE_CODE_FORMS[code][1]])
        else:
            views[name].copy_(value.reshape(views[name].shape))
