"""Python face of the codec ops: batched conversion of optimizer states between
their compact forms (blockwise 8-bit codes, bf16 rounded stochastically) and
values, one call per batch of tensors, on the CPU or CUDA with the same bits.

The ops (csrc/kernels/codec_batch.h, schemas in csrc/kernels/op_registry.h):

- ``torch.ops.swap_optimizer.decode_blockwise_8bit(codes, absmax, out, code_map)``
- ``torch.ops.swap_optimizer.encode_blockwise_8bit(values, codes, absmax, code_map, rounding)``
- ``torch.ops.swap_optimizer.encode_bf16_stochastic(values, out, seed, param_index, state_index,
  global_offset, step)``

The wrappers below take names for the maps and roundings; ``STATE_CODE_FORMS``
says which a kind of state uses. Decoding bf16 states needs no op (a copy).
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _C  # noqa: F401  (loads the library that defines the ops)

BLOCK_SIZE = 256  # elements per absmax scale, counted from each tensor's first element

CODE_MAPS = ("signed", "unsigned")  # index = the ops' code_map value
ROUNDINGS = ("nearest", "nonzero", "up")  # index = the ops' rounding value
# (map, rounding) per kind of state: signed states (momentum, exp_avg) round to
# nearest; states that sit in a denominator (exp_avg_sq, RMSprop/Adadelta
# square_avg, Adagrad sum, Adadelta acc_delta) to nearest but never to 0 when
# positive (an 8-bit 0 there would divide by eps alone); running maxima
# (max_exp_avg_sq) round up, so they stay maxima. (Adamax's exp_inf, a maximum
# that decays, is never coded in 8 bits: rules/declarations.py, DECAYING_MAX.)
STATE_CODE_FORMS = {
    "signed": ("signed", "nearest"),
    "denominator": ("unsigned", "nonzero"),
    "accumulator": ("unsigned", "nonzero"),  # Adagrad's sum: a denominator too
    "running_max": ("unsigned", "up"),
}
# Every kind of compact element state (rules/declarations.py says what each
# is); the two beyond STATE_CODE_FORMS are kept in bf16 under 8-bit too.
STATE_KINDS = (*STATE_CODE_FORMS, "decaying_max", "raw_denominator")

_decode_8bit = torch.ops.swap_optimizer.decode_blockwise_8bit
_encode_8bit = torch.ops.swap_optimizer.encode_blockwise_8bit
_encode_bf16 = torch.ops.swap_optimizer.encode_bf16_stochastic


def _same_counts(op: str, **lists) -> int:
    counts = {name: len(values) for name, values in lists.items()}
    first = next(iter(counts.values()))
    if any(count != first for count in counts.values()):
        raise ValueError(f"{op}: lists of different lengths {counts}; pass one entry per tensor in every list")
    return first


def _check_8bit_fake(op: str, values, codes, absmax) -> None:
    for index, (v, c, a) in enumerate(zip(values, codes, absmax)):
        torch._check(v.numel() == c.numel(), lambda: f"{op}: tensor {index}: values and codes differ in numel")
        torch._check(a.numel() == -(-c.numel() // BLOCK_SIZE),
                     lambda: f"{op}: tensor {index}: absmax needs one scale per {BLOCK_SIZE} codes")


@torch.library.register_fake("swap_optimizer::decode_blockwise_8bit")
def _decode_8bit_fake(codes, absmax, out, code_map):
    _same_counts("decode_blockwise_8bit", codes=codes, absmax=absmax, out=out, code_map=code_map)
    _check_8bit_fake("decode_blockwise_8bit", out, codes, absmax)


@torch.library.register_fake("swap_optimizer::encode_blockwise_8bit")
def _encode_8bit_fake(values, codes, absmax, code_map, rounding):
    _same_counts("encode_blockwise_8bit", values=values, codes=codes, absmax=absmax, code_map=code_map,
                 rounding=rounding)
    _check_8bit_fake("encode_blockwise_8bit", values, codes, absmax)


@torch.library.register_fake("swap_optimizer::encode_bf16_stochastic")
def _encode_bf16_fake(values, out, seed, param_index, state_index, global_offset, step):
    _same_counts("encode_bf16_stochastic", values=values, out=out, param_index=param_index, state_index=state_index,
                 global_offset=global_offset, step=step)
    for index, (v, o) in enumerate(zip(values, out)):
        torch._check(v.numel() == o.numel(), lambda: f"encode_bf16_stochastic: tensor {index}: values and out differ in numel")
    return None


def _indices(op: str, what: str, names: Sequence[str], allowed: tuple[str, ...]) -> list[int]:
    indices = []
    for index, name in enumerate(names):
        if name not in allowed:
            raise ValueError(f"{op}: tensor {index}: {what} {name!r} is none of {allowed}")
        indices.append(allowed.index(name))
    return indices


def decode_blockwise_8bit(codes: Sequence[torch.Tensor], absmax: Sequence[torch.Tensor],
                          out: Sequence[torch.Tensor], maps: Sequence[str]) -> None:
    """Writes into each ``out[i]`` (float32, bfloat16 or float16, as many
    elements as ``codes[i]``) the values of uint8 ``codes[i]``: the dtype's
    rounding of ``map[code] * absmax[i][block]`` (the product in float32),
    ``absmax[i]`` one float32 scale per block of 256 codes (ceil(numel / 256)),
    ``maps[i]`` "signed" or "unsigned" (swap_optimizer.compact.code_map).
    Every tensor contiguous, all on one device; one launch on CUDA."""
    codes, absmax, out = list(codes), list(absmax), list(out)
    if _same_counts("decode_blockwise_8bit", codes=codes, absmax=absmax, out=out, maps=maps) == 0:
        return
    _decode_8bit(codes, absmax, out, _indices("decode_blockwise_8bit", "map", maps, CODE_MAPS))


def encode_blockwise_8bit(values: Sequence[torch.Tensor], codes: Sequence[torch.Tensor],
                          absmax: Sequence[torch.Tensor], maps: Sequence[str], rounding: Sequence[str]) -> None:
    """Encodes each ``values[i]`` (float32, bfloat16 or float16) into uint8
    ``codes[i]`` (same numel) and float32 ``absmax[i]`` (one per block of 256
    elements from the tensor's first: the largest magnitude, NaN counted as 0).
    ``maps[i]``: "signed" or "unsigned"; ``rounding[i]``: "nearest",
    "nonzero" (nearest, but a positive value never gets the code of 0) or
    "up" (the smallest code that decodes to at least the value); the last two
    with the unsigned map only. See STATE_CODE_FORMS for which a state takes.
    A NaN gets code 0; an infinity makes its block's absmax inf and its
    block's values NaN or 0 when decoded, as in the fused kernel."""
    values, codes, absmax = list(values), list(codes), list(absmax)
    if _same_counts("encode_blockwise_8bit", values=values, codes=codes, absmax=absmax, maps=maps,
                    rounding=rounding) == 0:
        return
    _encode_8bit(values, codes, absmax, _indices("encode_blockwise_8bit", "map", maps, CODE_MAPS),
                 _indices("encode_blockwise_8bit", "rounding", rounding, ROUNDINGS))


def encode_bf16_stochastic(values: Sequence[torch.Tensor], out: Sequence[torch.Tensor], *, seed: int,
                           param_index: Sequence[int], state_index: Sequence[int],
                           global_offset: Sequence[int], step: Sequence[int]) -> None:
    """Rounds each float32 ``values[i]`` into bfloat16 ``out[i]`` stochastically
    (up or down with probability proportional to the distance; NaN and inf
    round to nearest). Element j's random bits are keyed by (``seed``,
    ``param_index[i]``, ``state_index[i]`` in 0..3, ``global_offset[i] + j``,
    ``step[i]``), the fused Adam kernel's generator: a result depends on no
    batching, list order, split or device, so a piece of a state encodes like
    the same elements of the whole when its ``global_offset`` is the index of
    its first element in the whole."""
    values, out = list(values), list(out)
    if _same_counts("encode_bf16_stochastic", values=values, out=out, param_index=param_index,
                    state_index=state_index, global_offset=global_offset, step=step) == 0:
        return
    _encode_bf16(values, out, int(seed), [int(i) for i in param_index], [int(i) for i in state_index],
                 [int(i) for i in global_offset], [int(i) for i in step])
