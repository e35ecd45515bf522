"""Devices as the runtime needs them: resolved once, where they enter.

torch accepts `"cuda"` and `torch.device("cuda")` as "the current CUDA device",
but its index is then None (-1 in C++), which CUDA calls such as
cudaDeviceGetAttribute and the caching allocator's statistics reject. Every
public entry that takes a device (the bench, StepCostModel, the auto budget,
the planner's measurements, the distributed helpers) passes it through
`resolve_device` before anything reaches `_C`, so the runtime always sees an
index. (The C++ entries resolve an unindexed device too, for callers of `_C`
itself; this is where our own code does it.)
"""

from __future__ import annotations

from typing import Union

import torch

DeviceLike = Union[str, int, torch.device]


def resolve_device(device: DeviceLike) -> torch.device:
    """`device` with its index: `"cuda"` or `torch.device("cuda")` becomes the
    current CUDA device `cuda:N`; `cuda:N` (or the int N, as torch.device(N)
    reads it) stays N, whichever device is current; CPU stays `cpu`. Refuses a
    CUDA index this machine does not have, naming the ones it has."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"SwapOptimizer: {device!r} is not a device; expected 'cpu', 'cuda' or 'cuda:N' "
                         f"({error})") from None
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise RuntimeError(f"SwapOptimizer: {device!r} names a CUDA device, but torch sees no CUDA GPU here "
                           "(torch.cuda.is_available() is False); use 'cpu', or run on a machine with a GPU and "
                           "a CUDA build of torch")
    if resolved.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if resolved.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(f"SwapOptimizer: {resolved} does not exist: this machine has {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}; pass one of those, or 'cuda' for the current one")
    return resolved
