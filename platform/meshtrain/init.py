"""Weight initialization that gives the same full weights on every mesh.

Each parameter is cut into fixed blocks of rows (the block size depends only on the parameter's
shape). Block ``j`` of parameter ``name`` is drawn from its own generator seeded by
``(seed, name, j)``, so a rank can fill exactly the rows of its shard, and the values do not depend
on how many ranks share the parameter. This avoids DTensor's RNG tracker, which on a CPU mesh gives
every shard the same values.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshtrain.model import Transformer

# Elements per random block: small enough that a shard wastes little, large enough to be fast.
_BLOCK_ELEMENTS = 1 << 20


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's tensor, index of its first row in the full parameter)."""
    if not isinstance(param, DTensor):
        return param.data, 0
    local = param.to_local()
    offset = 0
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh
        return local, 0
    rows = param.shape[0]
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if not (isinstance(placement, Shard) and placement.dim == 0):
            raise NotImplementedError(f"init supports Shard(0)/Replicate placements, got {placement}")
        # torch.chunk semantics, as DTensor and FSDP2 use: ceil-sized pieces, the tail may be short.
        size = param.device_mesh.size(mesh_dim)
        piece = -(-rows // size)
        offset += min(coordinate[mesh_dim] * piece, rows)
        rows = min(piece, max(rows - coordinate[mesh_dim] * piece, 0))
    if local.shape[0] != rows:
        raise RuntimeError(f"unexpected local shard shape {tuple(local.shape)} for {rows} rows")
    return local, offset


@torch.no_grad()
def fill_normal_rows(local: torch.Tensor, first_row: int, full_shape: torch.Size, name: str, seed: int, std: float) -> None:
    """Fill ``local`` (rows ``first_row``.. of a ``full_shape`` parameter) from N(0, std)."""
    if local.numel() == 0:
        return
    row_elements = max(1, full_shape.numel() // full_shape[0])
    block_rows = max(1, _BLOCK_ELEMENTS // row_elements)
    last_row = first_row + local.shape[0]
    first_block, last_block = first_row // block_rows, (last_row - 1) // block_rows
    pieces = []
    generator = torch.Generator(device=local.device)
    for block in range(first_block, last_block + 1):
        rows = min(block_rows, full_shape[0] - block * block_rows)
        generator.manual_seed(block_seed(seed, name, block))
        piece = torch.empty((rows, *full_shape[1:]), dtype=torch.float32, device=local.device)
        pieces.append(piece.normal_(mean=0.0, std=std, generator=generator))
    start = first_row - first_block * block_rows
    local.copy_(torch.cat(pieces)[start : start + local.shape[0]])


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Initialize all parameters (sharded or not) and the RoPE tables of ``model``."""
    stds = model.init_std_by_param()
    for name, param in model.named_parameters():
        std = stds[name]
        local, first_row = local_rows(param)
        if std is None:
            local.fill_(1.0)
        else:
            fill_normal_rows(local, first_row, param.shape, name, seed, std)
    model.reset_rope()
