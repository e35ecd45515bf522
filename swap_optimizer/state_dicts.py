"""Adam/AdamW state entries as state dicts and `state` edits hold them,
checked and converted into the store's form (values or 8-bit codes, master
copies, compensation) for the packed kernel's rule (rules/fused_kernel.py);
torch's update keeps torch's own entries (rules/torch_update.py)."""

from __future__ import annotations

from typing import Any

import torch

from .compact import MOMENTS, dequantize, quantize
from .distributed import _check_fsdp_8bit, _is_dtensor, _local, _local_part, _local_scales


def check_readable(value: torch.Tensor, where: str, key: str) -> None:
    """Refuses a state tensor without data to read (meta) or not dense."""
    if value.is_meta or value.layout != torch.strided:
        kind = "a meta tensor (no data)" if value.is_meta else f"{value.layout} (not dense)"
        raise ValueError(f"{where}: '{key}' is {kind}; load a state dict of dense tensors with data")


def check_state_entry(saved_id: Any, entry: Any) -> None:
    """Refuses a state dict's entry for a param that is not a dict of its states."""
    if not isinstance(entry, dict):
        raise ValueError(f"SwapOptimizer.load_state_dict: the state of param id {saved_id!r} is a "
                         f"{type(entry).__name__}, not a dict of its states; load a state dict that an optimizer's "
                         "state_dict() made")


def _as_step_value(value: Any, where: str) -> float:
    if isinstance(value, torch.Tensor):
        check_readable(value, where, "step")
        if value.numel() != 1:
            raise ValueError(f"{where}: 'step' must hold one number, got shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{where}: 'step' must be a number or a one-element tensor, got {type(value).__name__}")


def checked_adam_state(param: torch.Tensor, entry: Any, amsgrad: bool, where: str) -> dict:
    """Validates one param's saved state; returns {key: value} to write. A
    moment may be saved as values (its plain name) or as 8-bit codes and
    scales (`<name>_codes`, `<name>_absmax`); write_adam_states converts either
    to this optimizer's form."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: state must be a dict, got {type(entry).__name__}")
    moments = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    allowed = {"step", "master_param", "compensation"} | set(moments) | \
        {f"{m}_{part}" for m in moments for part in ("codes", "absmax")}
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown state key(s) {unknown}; Adam/AdamW with amsgrad={amsgrad} keep "
                         f"{sorted(allowed)} (is this another optimizer's state dict?)")
    missing = [k for k in ["step"] + moments if k not in entry and f"{k}_codes" not in entry]
    if missing:
        raise ValueError(f"{where}: state is missing {missing}; Adam/AdamW with amsgrad={amsgrad} need step, "
                         f"{moments} (as values, or as <name>_codes and <name>_absmax)")
    values = {"step": _as_step_value(entry["step"], where)}
    for moment in moments:
        if moment in entry and f"{moment}_codes" in entry:
            raise ValueError(f"{where}: '{moment}' is saved both as values and as codes; keep one")
        if (f"{moment}_codes" in entry) != (f"{moment}_absmax" in entry):
            raise ValueError(f"{where}: has only one of '{moment}_codes' and '{moment}_absmax'; 8-bit moments "
                             "need both")
        if f"{moment}_codes" in entry:
            values[moment] = _checked_codes(param, entry, moment, where)
    for key in [m for m in moments if m in entry] + [k for k in ("master_param", "compensation") if k in entry]:
        value = entry[key]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise ValueError(f"{where}: '{key}' must be a floating-point tensor, got "
                             f"{getattr(value, 'dtype', type(value).__name__)}")
        check_readable(_local(value), where, key)
        if value.shape != param.shape:
            raise ValueError(f"{where}: '{key}' has shape {tuple(value.shape)} but the param has shape "
                             f"{tuple(param.shape)}; the state dict belongs to another model")
        values[key] = _local_part(value, param)  # here, so a failing redistribution changes nothing
    return values

def _checked_codes(param: torch.Tensor, entry: dict, moment: str, where: str) -> tuple:
    """(codes, absmax) of an 8-bit moment, checked against the param."""
    codes, absmax = entry.get(f"{moment}_codes"), entry.get(f"{moment}_absmax")
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.shape != param.shape:
        raise ValueError(f"{where}: '{moment}_codes' must be a uint8 tensor of the param's shape "
                         f"{tuple(param.shape)}, got {getattr(codes, 'dtype', type(codes).__name__)} "
                         f"{tuple(getattr(codes, 'shape', ()))}")
    blocks = -(-_local(param).numel() // 256)
    # A DTensor param's scales come as a state dict has them ([world, scales])
    # or as `state` holds them (this rank's, 1-D).
    sharded = _is_dtensor(param) and isinstance(absmax, torch.Tensor) and absmax.dim() == 2
    if not isinstance(absmax, torch.Tensor) or absmax.dtype != torch.float32 or \
            (not sharded and absmax.shape != (blocks,)):
        raise ValueError(f"{where}: '{moment}_absmax' must be a float32 tensor of {blocks} scales (one per 256 "
                         f"elements) beside '{moment}_codes', got {getattr(absmax, 'dtype', type(absmax).__name__)} "
                         f"{tuple(getattr(absmax, 'shape', ()))}")
    for key, value in ((f"{moment}_codes", codes), (f"{moment}_absmax", absmax)):
        check_readable(_local(value), where, key)
    if sharded:
        _check_fsdp_8bit(param, where)
        absmax = _local_scales(absmax, param, blocks, where, f"{moment}_absmax")
    return _local_part(codes, param), absmax

def write_adam_states(params: list[torch.Tensor], views: list[dict], values: dict[int, dict], only=None) -> None:
    """Writes validated states into the stores (of the params in `only`, or
    all): no step and zeros where a param has no saved state; each moment in
    this optimizer's form (8-bit codes are copied as they are or decoded,
    values copied or encoded); master copies from the params when not saved
    or when a saved one no longer rounds to its param (a plain AdamW carries
    master_param along without updating it); compensation zero unless saved."""
    with torch.no_grad():
        for i, (p, view) in enumerate(zip(params, views)):
            if only is not None and i not in only:
                continue
            saved = values.get(i, {})
            view["step"].fill_(saved.get("step", 0.0))
            for moment in MOMENTS:
                value = saved.get(moment)
                if f"{moment}_codes" in view:
                    codes, absmax = view[f"{moment}_codes"], view[f"{moment}_absmax"]
                    if value is None:
                        codes.zero_()
                        absmax.zero_()  # every code decodes to 0
                        continue
                    if not isinstance(value, tuple):
                        value = quantize(value, moment)
                    codes.copy_(value[0])
                    absmax.copy_(value[1])
                elif moment in view:
                    if value is None:
                        view[moment].zero_()
                    else:
                        view[moment].copy_(dequantize(*value, moment) if isinstance(value, tuple) else value)
            if "compensation" in view:
                value = saved.get("compensation")
                if value is None:
                    view["compensation"].zero_()
                else:
                    view["compensation"].copy_(value)
            if "master_param" in view:
                value = saved.get("master_param")
                if value is None or value.dtype != torch.float32 or \
                        not torch.equal(value.to(p.dtype), _local(p).to(value.device)):
                    value = _local(p)
                view["master_param"].copy_(value)
