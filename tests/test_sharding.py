"""FSDP2 on a 2D CPU mesh: placements, per-rank memory, and mesh-independent initialization."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.model.args import model_args
from meshtrain.model.init import init_weights
from meshtrain.model.llama import build_model, materialize
from trainers import sharded_model
from ranks import run_on_ranks

VOCAB = 97  # not divisible by 2 or 4: shards are uneven, which init and the byte count must handle



def tiny_config(world: int, shard: int, tied: bool = False) -> MeshtrainConfig:
    return load_config(
        None,
        [
            "model.dim=64", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=160",
            f"model.tie_embeddings={str(tied).lower()}", f"scaling.num_workers={world}", f"parallel.shard={shard}",
            "train.global_batch_size=8", "train.micro_batch_size=2", "train.seed=7",
        ],
    )


def _shard_and_gather(rank: int, world: int, shard: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tied in (False, True):
        cfg = tiny_config(world, shard, tied)
        layout = WorkerLayout(rank, world, rank % shard, shard, rank // shard)
        model, layout = sharded_model(cfg, VOCAB, layout, torch.device("cpu"))
        params = {}
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            params[name] = {
                "mesh_dims": param.device_mesh.mesh_dim_names,
                "mesh_shape": tuple(param.device_mesh.shape),
                "placements": tuple(param.placements),
                "local_bytes": param.to_local().numel() * param.element_size(),
                "full_bytes": param.numel() * param.element_size(),
                "row_bytes": param[0].numel() * param.element_size() if param.ndim > 1 else param.element_size(),
                "full": param.full_tensor(),  # collective: every rank takes part
            }
        out["tied" if tied else "untied"] = {"plan": layout.plan.shape, "params": params}
    return out


def reference_weights(tied: bool) -> dict[str, torch.Tensor]:
    args = model_args(tiny_config(1, 1, tied).model, VOCAB)
    model = materialize(build_model(args, "meta"), "cpu")
    init_weights(model, seed=7)
    return dict(model.named_parameters())


MESHES = [(2, 2, (1, 2)), (4, 4, (1, 4)), (4, 2, (2, 2))]


@pytest.fixture(scope="module")
def sharded() -> dict[tuple[int, int], list[dict[str, Any]]]:
    return {(world, shard): run_on_ranks(_shard_and_gather, world, shard) for world, shard, _ in MESHES}


@pytest.mark.parametrize("world,shard,shape", MESHES)
def test_every_parameter_is_hsdp_sharded_on_the_2d_mesh(sharded: dict, world: int, shard: int, shape: tuple) -> None:
    for rank_result in sharded[(world, shard)]:
        for variant in ("untied", "tied"):
            assert rank_result[variant]["plan"] == shape
            for name, info in rank_result[variant]["params"].items():
                if shape[0] == 1:  # one replica: FSDP shards over the shard dimension alone (no HSDP all-reduce)
                    assert (info["mesh_dims"], info["mesh_shape"], info["placements"]) == (("shard",), shape[1:], (Shard(0),)), name
                    continue
                assert info["mesh_dims"] == ("replicate", "shard"), name
                assert info["mesh_shape"] == shape, name
                assert info["placements"] == (Replicate(), Shard(0)), name


@pytest.mark.parametrize("world,shard,shape", MESHES)
def test_per_rank_parameter_bytes_are_full_over_shard(sharded: dict, world: int, shard: int, shape: tuple) -> None:
    for rank_result in sharded[(world, shard)]:
        params = rank_result["untied"]["params"]
        for name, info in params.items():
            assert abs(info["local_bytes"] - info["full_bytes"] / shard) <= info["row_bytes"], name
        local = sum(info["local_bytes"] for info in params.values())
        full = sum(info["full_bytes"] for info in params.values())
        rounding = sum(info["row_bytes"] for info in params.values())
        assert abs(local - full / shard) <= rounding


@pytest.mark.parametrize("world,shard,shape", MESHES)
def test_full_weights_are_bitwise_equal_to_the_unsharded_init(sharded: dict, world: int, shard: int, shape: tuple) -> None:
    for variant in ("untied", "tied"):
        expected = reference_weights(variant == "tied")
        for rank_result in sharded[(world, shard)]:
            gathered = rank_result[variant]["params"]
            assert gathered.keys() == expected.keys()
            for name, tensor in expected.items():
                assert torch.equal(gathered[name]["full"], tensor.detach()), f"{variant} {name} on {shape}"


def test_shards_hold_different_values() -> None:
    """Guards against the CPU DTensor RNG pitfall: identical values repeated in every shard."""
    weights = reference_weights(tied=False)
    embedding = weights["tok_embeddings.weight"].detach()
    first, second = embedding.chunk(2)
    assert not torch.equal(first[: second.shape[0]], second)


def _compute_dtypes(rank: int, world: int) -> dict[str, str]:
    cfg = load_config(None, [f"scaling.num_workers={world}", "parallel.mixed_precision=bf16", "data.vocab_size=512"])
    model, _ = sharded_model(cfg, 512, WorkerLayout(rank, world, rank, world, 0), torch.device("cpu"))
    seen: dict[str, str] = {}
    model.layers["0"].attention.wq.register_forward_hook(lambda m, i, o: seen.update(block=str(o.dtype)))
    logits = model(torch.randint(0, 512, (2, 16)))
    logits.float().sum().backward()
    seen["logits"] = str(logits.dtype)
    seen["shards"] = str({p.dtype for p in model.parameters()})
    seen["grads"] = str({p.grad.dtype for p in model.parameters()})
    return seen


def test_bf16_policy_computes_in_bf16_and_keeps_fp32_shards_and_grads() -> None:
    for seen in run_on_ranks(_compute_dtypes, 2):
        assert seen == {
            "block": "torch.bfloat16",
            "logits": "torch.bfloat16",
            "shards": "{torch.float32}",
            "grads": "{torch.float32}",
        }
