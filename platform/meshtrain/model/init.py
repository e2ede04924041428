"""Weight initialization that gives the same full weights on every mesh.

Each parameter is cut into fixed blocks of rows (the block size depends only on the parameter's
shape). Block ``j`` of parameter ``name`` is drawn from its own generator seeded by
``(seed, name, j)``, so a rank can fill exactly the rows of its shard, and the values do not depend
on how many ranks share the parameter. This avoids DTensor's RNG tracker, which on a CPU mesh gives
every shard the same values. The generators are CPU ones, so the values do not depend on the device
either (GPU, or host memory under CPU offload).
"""

from __future__ import annotations

import hashlib

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshtrain.model.llama import Transformer

# Elements per random block: small enough that a shard wastes little, large enough to be fast.
_BLOCK_ELEMENTS = 1 << 20


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def local_region(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(this rank's tensor, the index in the full parameter of its first element along each dim).

    A shard of a DTensor is one box of the full tensor under every placement meshtrain uses: FSDP's
    row shards, tensor parallel's row or column shards, and FSDP over TP (strided row shards);
    DTensor computes it as DCP does when it saves."""
    if not isinstance(param, DTensor):
        return param.data, (0,) * param.dim()
    local = param.to_local()
    if param.device_mesh.get_coordinate() is None:  # this rank is not in the mesh
        return local, (0,) * param.dim()
    # Plain integer arithmetic, which for strided shards DTensor does on small tensors: outside fake
    # mode (the traced dry run initializes fake parameters), so they have values.
    with unset_fake_temporarily():
        shape, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"unexpected local shard shape {tuple(local.shape)}, expected {tuple(shape)}")
    return local, tuple(offsets)


@torch.no_grad()
def fill_normal_rows(local: torch.Tensor, first_row: int, full_shape: torch.Size, name: str, seed: int, std: float,
                     first_column: int = 0) -> None:
    """Fill ``local`` (rows ``first_row``.. and, of a matrix, columns ``first_column``.. of a
    ``full_shape`` parameter) from N(0, std).

    Blocks are drawn on the host, whatever ``local``'s device: a CUDA generator (Philox) and a CPU
    one (Mersenne Twister) give different numbers for one seed, so drawing on the parameter's device
    would make the weights depend on where they live (GPU, or host memory under CPU offload).
    Each block is copied into its overlap with ``local`` at once, so only one block is ever held.
    """
    if local.numel() == 0:
        return
    block_rows = rows_per_block(full_shape)
    last_row = first_row + local.shape[0]
    generator = torch.Generator(device="cpu")
    for block in range(first_row // block_rows, (last_row - 1) // block_rows + 1):
        block_start = block * block_rows
        rows = min(block_rows, full_shape[0] - block_start)
        generator.manual_seed(block_seed(seed, name, block))
        values = torch.empty((rows, *full_shape[1:]), dtype=torch.float32)
        values.normal_(mean=0.0, std=std, generator=generator)
        start, stop = max(first_row, block_start), min(last_row, block_start + rows)
        rows_drawn = values[start - block_start : stop - block_start]
        if local.dim() > 1:  # a column shard (tensor parallel's row-parallel weights) takes its columns
            rows_drawn = rows_drawn[:, first_column : first_column + local.shape[1]]
        local[start - first_row : stop - first_row].copy_(rows_drawn)


def rows_per_block(full_shape: torch.Size) -> int:
    """Rows of one random block of a ``full_shape`` parameter (a function of the shape alone)."""
    row_elements = max(1, full_shape.numel() // full_shape[0])
    return max(1, _BLOCK_ELEMENTS // row_elements)


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Initialize all parameters (sharded or not) and the RoPE tables of ``model``."""
    stds = model.init_std_by_param()
    for name, param in model.named_parameters():
        std = stds[name]
        local, offsets = local_region(param)
        if std is None:
            local.fill_(1.0)
        else:
            fill_normal_rows(local, offsets[0], param.shape, name, seed, std, *offsets[1:2])
    model.reset_rope()
