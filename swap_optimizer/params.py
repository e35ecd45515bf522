"""Checks of the params a SwapOptimizer is given, shared by every rule:
dense floating tensors on one device, each listed once, no two sharing an
element."""

from __future__ import annotations

from typing import Optional

import torch

from .distributed import _is_dtensor, _local

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_params(params: list[torch.Tensor], device: Optional[torch.device], first_index: int = 0) -> torch.device:
    for offset, p in enumerate(params):
        index = first_index + offset
        if p.layout != torch.strided:
            raise ValueError(f"SwapOptimizer: param {index} is sparse ({p.layout}); only dense params are supported")
        if p.is_complex():
            raise TypeError(f"SwapOptimizer: param {index} is complex ({p.dtype}); use torch.view_as_real "
                            "on complex params or keep them in a separate optimizer")
        if p.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"SwapOptimizer: param {index} has dtype {p.dtype}; supported are float32, "
                            "bfloat16 and float16")
        if device is None:
            device = p.device
        elif p.device != device:
            raise ValueError(f"SwapOptimizer: param {index} is on {p.device} but earlier params are on {device}; "
                             "all params must be on one device")
    return device


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes a tensor's elements occupy."""
    extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    return tensor.data_ptr(), tensor.data_ptr() + extent * tensor.element_size()


def _elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose byte spans overlap share an element: column
    slices of one buffer interleave without sharing any."""
    (a_begin, a_end), (b_begin, b_end) = _byte_span(a), _byte_span(b)
    size = a.element_size()
    start, count = min(a_begin, b_begin), (max(a_end, b_end) - min(a_begin, b_begin)) // size
    if b.element_size() != size or (a_begin - b_begin) % size or count > 1 << 24:
        return True  # not comparable element by element (or too large to check): take the spans' word
    taken = torch.zeros(count, dtype=torch.bool)
    indices = torch.arange(count)
    taken[indices.as_strided(a.shape, a.stride(), (a_begin - start) // size).flatten()] = True
    return bool(taken[indices.as_strided(b.shape, b.stride(), (b_begin - start) // size).flatten()].any())


def check_distinct(params: list[torch.Tensor]) -> None:
    """Refuses a param listed twice (a tied weight passed twice, say) and params
    whose memory overlaps; disjoint views of one buffer (vector_to_parameters)
    are fine. Indices are in param_groups order."""
    first_index = {}
    for index, p in enumerate(params):
        if id(p) in first_index:
            raise ValueError(f"SwapOptimizer: param {index} is the same tensor as param {first_index[id(p)]} "
                             "(a tied weight listed twice?); list each param once")
        first_index[id(p)] = index
    locals_ = [_local(p) for p in params]
    spans = sorted((*_byte_span(t), index) for index, t in enumerate(locals_) if t.numel() > 0 and not t.is_meta)
    open_spans = []  # (end, index) of earlier spans that may still overlap
    for begin, end, index in spans:
        open_spans = [(e, i) for e, i in open_spans if e > begin]
        for _, other in open_spans:
            if _elements_overlap(locals_[other], locals_[index]):
                a, b = sorted((other, index))
                raise ValueError(f"SwapOptimizer: params {a} and {b} share memory (their elements overlap), so one "
                                 "update would overwrite the other; give each its own tensor, or list a tied weight "
                                 "once")
        open_spans.append((end, index))


def check_overlap_params(params: list[torch.Tensor]) -> None:
    dtensors = [i for i, p in enumerate(params) if _is_dtensor(p)]
    if dtensors:
        raise ValueError(f"SwapOptimizer: overlap_forward=True does not support DTensor params yet (FSDP2 and tensor "
                         f"parallel; param(s) {dtensors}): FSDP2 gathers params in its own hooks, which would read "
                         "them before their update. Use overlap_forward=False with DTensor params")


def param_versions(params: list[torch.Tensor], indices) -> dict[int, int]:
    """The version counter of each param in `indices` (a DTensor's local
    shard): a write outside step() (in place, model.load_state_dict) bumps
    it, while a rule's own writes bump nothing (the runtime hands the update
    its own handles of the params' memory; compact_states.kahan_round writes
    through `.data` besides)."""
    return {i: _local(params[i])._version for i in indices}


def written_since(params: list[torch.Tensor], versions: dict[int, int]) -> list[int]:
    """The params of `versions` (param_versions) written outside step() since."""
    return [i for i, version in versions.items() if _local(params[i])._version != version]
