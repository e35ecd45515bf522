"""Compact state forms in Python: blockwise 8-bit moments (encode and decode with
torch ops, the same rules as the kernels' csrc/kernels/state_codec.h), the
description a state dict carries of its form, and the conversion of a state
dict with 8-bit moments into a plain torch.optim one."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from . import _C

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = ()

BLOCK_SIZE = 256  # elements per absmax scale
MIN_QUANTIZED_NUMEL = 4096  # smaller params keep unquantized moments
MOMENTS = _C.adam_moment_keys  # exp_avg, exp_avg_sq, max_exp_avg_sq: the keys 8-bit codes may hold
# The key, in each param group of a state dict, that describes its state form.
FORMAT_KEY = "swap_state_format"
# The per-param count keying bf16 rounding where the optimizer keeps no step
# (SGD's momentum on torch's update path): saved with the state, dropped here.
ROUNDING_STEP = "swap_rounding_step"


@functools.lru_cache(maxsize=None)
def _maps() -> tuple[torch.Tensor, torch.Tensor]:
    return _C.code_maps()


def code_map(moment: str) -> torch.Tensor:
    """The 256 values codes of `moment` stand for (times their block's absmax):
    bitsandbytes' signed dynamic map for exp_avg, the unsigned one otherwise."""
    signed, unsigned = _maps()
    return signed if moment == "exp_avg" else unsigned


def named_map(name: str) -> torch.Tensor:
    """The code map codec.CODE_MAPS names ("signed" or "unsigned")."""
    signed, unsigned = _maps()
    if name not in ("signed", "unsigned"):
        raise ValueError(f"code map {name!r} is neither 'signed' nor 'unsigned'")
    return signed if name == "signed" else unsigned


def quantize(values: torch.Tensor, moment: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax) of `values`: uint8 codes of the same shape (on the CPU) and
    one float32 absmax per block of BLOCK_SIZE elements in flat order. Nearest
    code, except that exp_avg_sq never codes a positive value as 0 (the step
    would be lr * m / eps), and max_exp_avg_sq rounds up (it must stay a
    maximum)."""
    flat = values.detach().reshape(-1).to("cpu", torch.float32)
    count = flat.numel()
    blocks = -(-count // BLOCK_SIZE)
    padded = torch.zeros(blocks * BLOCK_SIZE)
    padded[:count] = flat
    padded = padded.view(blocks, BLOCK_SIZE)
    magnitude = padded.abs().nan_to_num(nan=0.0, posinf=float("inf"))  # NaN counts as 0, as in the kernels
    absmax = magnitude.amax(dim=1) if blocks else torch.zeros(0)
    scale = absmax[:, None].expand_as(padded)
    normalized = torch.where(scale > 0, padded / scale, torch.zeros(()))
    table = code_map(moment)
    if moment == "max_exp_avg_sq":
        codes = torch.searchsorted(table, normalized.contiguous()).clamp_(max=255)
        short = (table[codes] * scale < padded) & (codes < 255)
        codes = codes + short.long()
    else:
        midpoints = (table[:-1] + table[1:]) / 2
        codes = torch.bucketize(normalized, midpoints)
    codes = torch.where(normalized.isnan(), 0, codes)  # as the kernels: a NaN compares below nothing
    if moment == "exp_avg_sq":
        # After the NaN rule, as the kernels' nonzero rounding (code_of_normalized): +inf (normalized inf / inf: NaN) codes 1, which
        # decodes to inf again, not to 0 * inf (NaN).
        codes = torch.where((codes == 0) & (padded > 0), 1, codes)
    return codes.to(torch.uint8).reshape(-1)[:count].reshape(values.shape), absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, moment: str, map_name: str | None = None) -> torch.Tensor:
    """float32 values of `codes` (any shape, blocks in flat order) with their
    absmax, by `moment`'s map (Adam's names) or the map `map_name` names."""
    flat = codes.reshape(-1).long()
    scale = absmax.to(torch.float32).repeat_interleave(BLOCK_SIZE)[:flat.numel()]
    table = named_map(map_name) if map_name is not None else code_map(moment)
    return (table.to(codes.device)[flat] * scale.to(codes.device)).reshape(codes.shape)


def _dequantize_shards(codes: torch.Tensor, absmax: torch.Tensor, moment: str,
                       map_name: str | None = None) -> torch.Tensor:
    """Decodes an FSDP2 param's full codes whose scales are [world, scales]:
    rank r held rows [r * chunk, (r + 1) * chunk) of dim 0 (torch.chunk's
    split, FSDP2's) and its blocks started at its own first element."""
    world = absmax.shape[0]
    chunk = -(-codes.shape[0] // world)
    parts = []
    for rank in range(world):
        shard = codes[rank * chunk:(rank + 1) * chunk]
        blocks = -(-shard.numel() // BLOCK_SIZE)
        parts.append(dequantize(shard, absmax[rank, :blocks], moment, map_name))
    return torch.cat(parts)


def state_format(state_dtype: Any, rounding_seed: Any) -> dict:
    """What a state dict says about its form (in each param group, FORMAT_KEY)."""
    form: dict[str, Any] = {"moments": "param dtype" if state_dtype is None else str(state_dtype).replace("torch.", "")}
    if state_dtype == torch.uint8:
        form.update(block_size=BLOCK_SIZE, min_quantized_numel=MIN_QUANTIZED_NUMEL,
                    code_maps={"exp_avg": code_map("exp_avg").tolist(), "exp_avg_sq": code_map("exp_avg_sq").tolist(),
                               "max_exp_avg_sq": code_map("max_exp_avg_sq").tolist()})
    if rounding_seed is not None:
        form["rounding_seed"] = rounding_seed
    return form


def dequantize_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of a SwapOptimizer state dict that its wrapped optimizer (AdamW,
    SGD, RMSprop, ...) loads: 8-bit states (S_codes and S_absmax) decoded to
    float32 under their plain names S, by the map the group's FORMAT_KEY names
    for S (Adam's moments: exp_avg signed, the others unsigned), Kahan
    compensation buffers dropped (the params already hold the rounded
    weights), the bf16 rounding's own step count dropped (SGD's), and the
    state-form description removed from the param groups. bf16 states stay
    bf16 (torch's load casts them to the param's dtype). Tensors that need no
    change are shared, not copied."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("dequantize_state_dict: expected an optimizer state dict with 'state' and 'param_groups'")
    maps_of: dict[Any, dict] = {}  # param id -> {state: map name} from its group's FORMAT_KEY
    for group in state_dict["param_groups"]:
        form = group.get(FORMAT_KEY)
        states = form.get("states", {}) if isinstance(form, dict) else {}
        names = {name: spec["code_map"] for name, spec in states.items()
                 if isinstance(spec, dict) and spec.get("code_map") is not None}
        for param_id in group.get("params", ()):
            maps_of[param_id] = names
    plain_state = {}
    for param_id, entry in state_dict["state"].items():
        entry = dict(entry)
        names = maps_of.get(param_id, {})
        decoded = list(dict.fromkeys([*MOMENTS, *names, *(k[:-len("_codes")] for k in entry if k.endswith("_codes"))]))
        for moment in decoded:
            codes, absmax = entry.pop(f"{moment}_codes", None), entry.pop(f"{moment}_absmax", None)
            if (codes is None) != (absmax is None):
                raise ValueError(f"dequantize_state_dict: param {param_id!r} has only one of {moment}_codes and "
                                 f"{moment}_absmax; both are needed to decode it")
            if codes is None:
                continue
            if isinstance(codes, DTensor) or isinstance(absmax, DTensor):
                raise ValueError(f"dequantize_state_dict: param {param_id!r}'s {moment} is sharded (DTensors); "
                                 "decode a full state dict (get_optimizer_state_dict with full_state_dict=True), "
                                 "or load it into a SwapOptimizer with state_dtype=torch.float32")
            map_name = names.get(moment)
            entry[moment] = dequantize(codes, absmax, moment, map_name) if absmax.dim() == 1 else \
                _dequantize_shards(codes, absmax, moment, map_name)
        entry.pop("compensation", None)
        entry.pop(ROUNDING_STEP, None)
        plain_state[param_id] = entry
    groups = []
    for group in state_dict["param_groups"]:
        group = copy.copy(group)
        group.pop(FORMAT_KEY, None)
        groups.append(group)
    return {**state_dict, "state": plain_state, "param_groups": groups}
