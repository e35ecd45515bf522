"""DTensor (FSDP2) helpers of SwapOptimizer: each rank keeps the states of
its local shards; state dicts carry DTensors with the params' placements, and
8-bit scales (per local shard) get a row per rank."""

from __future__ import annotations

from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # torch built without distributed support
    DTensor = None


def _is_dtensor(tensor: Any) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2 shards, for one), or the tensor itself."""
    return tensor._local_tensor if _is_dtensor(tensor) else tensor


def _like_param(view: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A state view as torch.optim would hold it: a DTensor with the param's mesh
    and placements when the param is one, its local tensor being the view."""
    if not _is_dtensor(param):
        return view
    # Built directly, as FSDP2 builds its CPU-offloaded shards: DTensor.from_local
    # would copy a host view to the mesh's device, cutting it off from the store.
    spec = DTensorSpec(param.device_mesh, param.placements,
                       tensor_meta=TensorMeta(param.shape, param.stride(), view.dtype))
    return DTensor(view, spec, requires_grad=False)


def _local_part(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of a saved state tensor that belongs to this rank's part of param."""
    if not _is_dtensor(param):
        return value.full_tensor() if _is_dtensor(value) else value
    if _is_dtensor(value):
        if value.device_mesh != param.device_mesh or value.placements != param.placements:
            value = value.redistribute(param.device_mesh, param.placements)
        return value.to_local()
    # A full tensor (every rank holds all of it): take this rank's part, no communication.
    # (To this rank's device: the mesh's device type alone would be the current device.)
    return distribute_tensor(value.to(_local(param).device), param.device_mesh, param.placements,
                             src_data_rank=None).to_local()


def _global_offset(param: torch.Tensor, index: int) -> int:
    """The index, in the whole param, of this rank's first element: 0 unless
    the param is a DTensor sharded on dim 0 (FSDP2), whose shard is then one
    contiguous run of the whole param's elements."""
    if not _is_dtensor(param):
        return 0
    if any(isinstance(p, Shard) and p.dim != 0 for p in param.placements):
        raise ValueError(f"SwapOptimizer: param {index} is sharded on a dim other than 0 ({param.placements}); "
                         "stochastic rounding keys on the global element index, which needs shards on dim 0 "
                         "(FSDP2's default): shard on dim 0, or use state_dtype=None or torch.float32")
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    row = 1
    for size in param.shape[1:]:
        row *= size
    return int(offset[0]) * row if offset else 0


def _shared_default_seed() -> int:
    """torch's initial seed, rank 0's under torch.distributed: DDP replicas and
    FSDP2 shards must draw from one generator, even if ranks seeded torch apart."""
    seed = torch.initial_seed() % 2 ** 63
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        shared = [seed]
        torch.distributed.broadcast_object_list(shared, src=0)
        seed = shared[0]
    return seed


def _check_fsdp_8bit(param: torch.Tensor, where: str) -> None:
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(f"{where} is a DTensor placed {tuple(param.placements)} on a "
                         f"{param.device_mesh.ndim}-D mesh; 8-bit moments (state_dtype=torch.uint8) under DTensor need "
                         "a 1-D mesh and Shard(0) (FSDP2's default: fully_shard without HSDP or "
                         "shard_placement_fn), or use state_dtype=torch.bfloat16")


def _scale_rows(param: torch.Tensor) -> int:
    """Scales per rank of a DTensor param's 8-bit moment in a state dict: those
    of the largest local shard (dim-0 chunks of ceil(rows / world) rows)."""
    world = param.device_mesh.size()
    rows = -(-param.shape[0] // world) if param.dim() else 1
    return -(-(rows * (param.numel() // max(param.shape[0], 1) if param.dim() else 1)) // 256)


def _sharded_scales(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A DTensor param's absmax scales as a state dict holds them: a [world,
    scales] DTensor, rank r's scales (zero-padded) in row r, so DCP gives each
    rank's blocks their own place (they are per local shard and cannot be
    resharded without decoding)."""
    world, width = param.device_mesh.size(), _scale_rows(param)
    padded = torch.zeros(1, width, dtype=torch.float32, device=local.device)
    padded[0, :local.numel()] = local
    spec = DTensorSpec(param.device_mesh, (Shard(0),),
                       tensor_meta=TensorMeta(torch.Size((world, width)), (width, 1), torch.float32))
    return DTensor(padded, spec, requires_grad=False)


def _local_scales(absmax: torch.Tensor, param: torch.Tensor, blocks: int, where: str, key: str) -> torch.Tensor:
    """This rank's scales from a state dict's [world, scales] form (a DTensor or,
    from a full state dict, a plain tensor)."""
    world, width = param.device_mesh.size(), _scale_rows(param)
    if tuple(absmax.shape) != (world, width):
        raise ValueError(f"{where}: '{key}' has shape {tuple(absmax.shape)}, but here 8-bit scales are sharded as "
                         f"({world}, {width}): it was saved at another world size or sharding. 8-bit moments under "
                         "FSDP2 load at the world size they were saved at; to change it, load the checkpoint there "
                         "into an optimizer with state_dtype=torch.float32 (which decodes them) and save again")
    if _is_dtensor(absmax):
        if tuple(absmax.placements) != (Shard(0),) or absmax.device_mesh != param.device_mesh:
            absmax = absmax.redistribute(param.device_mesh, (Shard(0),))
        row = absmax.to_local()[0]
    else:
        row = absmax[param.device_mesh.get_local_rank()]
    return row[:blocks].to("cpu", torch.float32)
