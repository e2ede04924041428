"""HSDP gradient accumulation: the replicate-dim all-reduce runs once per step, not per micro-batch;
with a single replica (full_shard) it never runs.

On a 2x2 gloo mesh, ``train_step`` with the deferral gives the same loss and gradients as with an
all-reduce after every micro-batch, while issuing ``units`` replicate-dim all-reduces instead of
``units x micro-batches``. The gradients agree to fp32 rounding, not bitwise: deferring changes the
order of the sums, (a1 + a2) + (b1 + b2) over replicas a, b instead of (a1 + b1) + (a2 + b2).
On a 1x4 mesh FSDP shards over the shard dimension alone: no all-reduce over the one-rank replicate
group, and the same step as the 2x2 mesh's.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshtrain.config import ModelArgs, ParallelConfig
from meshtrain.distributed.layout import MeshPlan, RankLayout, WorkerLayout
from meshtrain.distributed.parallelize import build_mesh, parallelize
from meshtrain.model.init import init_weights
from meshtrain.model.llama import build_model, materialize
from meshtrain.train.guard import SpikeRules, StepGuard
from meshtrain.train.step import train_step
from ranks import run_on_ranks


WORLD = 4
MESH = (2, 2)  # (replicate, shard)
FULL_SHARD = (1, 4)
MICRO_BATCHES = 3
N_LAYERS = 2
UNITS = N_LAYERS + 2  # one per block, the embedding, norm+output (the untied root holds no parameters)
ARGS = ModelArgs(
    dim=32, n_layers=N_LAYERS, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64, max_seq_len=16,
    rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, init_std=0.02,
)
Batch = list[tuple[torch.Tensor, torch.Tensor]]


def micro_batches(rank: int, seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    tokens = [torch.randint(0, ARGS.vocab_size, (2, 9), generator=generator) for _ in range(MICRO_BATCHES)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def sharded_model(mesh: DeviceMesh, reshard_after_forward: bool, shape: tuple[int, int] = MESH) -> torch.nn.Module:
    plan = MeshPlan(*shape, reshard_after_forward)
    model = build_model(ARGS, "meta")
    parallelize(model, mesh, plan, ParallelConfig())
    materialize(model, "cpu")
    init_weights(model, seed=7)
    return model


class Recorder:
    """Counts replicate-group all-reduces and keeps the gradients each optimizer step sees."""

    def __init__(self, replicate_group: dist.ProcessGroup) -> None:
        self.replicate_group = replicate_group
        self.all_reduces = 0
        self.grads: list[torch.Tensor] = []
        self._all_reduce = dist.all_reduce

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        # The mesh hands out a different wrapper object for the same group: compare names.
        if group is not None and group.group_name == self.replicate_group.group_name:
            self.all_reduces += 1
        return self._all_reduce(tensor, *args, **kwargs)

    def before_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.grads = [p.grad.to_local().clone() for group in optimizer.param_groups for p in group["params"]]


def run_step(model: torch.nn.Module, mesh: DeviceMesh, batches: list[Batch], defer: bool,
             shape: tuple[int, int] = MESH) -> dict[str, Any]:
    """``train_step`` on each of ``batches`` in turn (one that raises is swallowed); the last step's
    loss, gradient norm, gradients and replicate all-reduce count."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = Recorder(mesh.get_group("replicate"))
    optimizer.register_step_pre_hook(recorder.before_step)
    guard = StepGuard(optimizer, torch.device("cpu"), SpikeRules(window=4))
    for batch in batches:
        recorder.all_reduces = 0
        with mock.patch.object(dist, "all_reduce", recorder.all_reduce):
            try:
                output = train_step(model, guard, batch, RankLayout(WorkerLayout(dist.get_rank(), WORLD), MeshPlan(*shape, True)),
                                    grad_clip=0.0, defer_all_reduce=defer)
            except (RuntimeError, ValueError):
                continue
    return {
        "loss": output.loss_sum.item(), "grad_norm": output.grad_norm.item(),
        "grads": recorder.grads, "all_reduces": recorder.all_reduces,
    }


def broken(batch: Batch) -> Batch:
    """``batch`` whose last micro-batch fails in the loss, after the earlier backwards ran."""
    inputs, targets = batch[-1]
    return [*batch[:-1], (inputs, targets[:, :-1])]


def _rank(rank: int, world: int) -> dict[str, Any]:
    # One mesh for every model: FSDP on a second mesh of the same shape reduces over that mesh's new
    # groups, while get_group on its parameters' mesh answered the first mesh's (seen in torch 2.13).
    mesh = build_mesh(MeshPlan(*MESH, True), "cpu")
    results: dict[str, Any] = {}
    for reshard in (True, False):  # hybrid_shard and hybrid_shard_zero2
        steps = [micro_batches(rank, seed=1)]
        for defer, name in ((True, "deferred"), (False, "per_micro_batch")):
            results[f"{name}/{reshard}"] = run_step(sharded_model(mesh, reshard), mesh, steps, defer)
    # A step that raises midway (its earlier micro-batches already reduce-scattered) must leave
    # nothing behind for the next step.
    steps = [broken(micro_batches(rank, seed=2)), micro_batches(rank, seed=1)]
    results["after_failure"] = run_step(sharded_model(mesh, True), mesh, steps, defer=True)
    full_mesh = build_mesh(MeshPlan(*FULL_SHARD, True), "cpu")
    full = sharded_model(full_mesh, True, FULL_SHARD)
    results["full_shard_mesh_dims"] = next(full.parameters()).device_mesh.mesh_dim_names
    results["full_shard"] = run_step(full, full_mesh, [micro_batches(rank, seed=1)], defer=False, shape=FULL_SHARD)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_rank, WORLD)


def assert_same_step(got: dict[str, Any], expected: dict[str, Any]) -> None:
    # Only the order of the fp32 sums changes: measured at most 3.7e-9 apart on gradients of ~1e-2.
    assert got["loss"] == expected["loss"]  # the forward does not depend on the reduction
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
    assert len(got["grads"]) == len(expected["grads"]) > 0
    for ours, theirs in zip(got["grads"], expected["grads"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("reshard", [True, False], ids=["hybrid_shard", "hybrid_shard_zero2"])
def test_deferred_all_reduce_gives_the_same_step(ranks: list[dict[str, Any]], reshard: bool) -> None:
    for result in ranks:
        assert_same_step(result[f"deferred/{reshard}"], result[f"per_micro_batch/{reshard}"])


@pytest.mark.parametrize("reshard", [True, False], ids=["hybrid_shard", "hybrid_shard_zero2"])
def test_replicate_all_reduce_runs_once_per_unit_and_step(ranks: list[dict[str, Any]], reshard: bool) -> None:
    for result in ranks:
        assert result[f"per_micro_batch/{reshard}"]["all_reduces"] == UNITS * MICRO_BATCHES
        assert result[f"deferred/{reshard}"]["all_reduces"] == UNITS


def test_a_step_that_raised_leaves_no_partial_gradient(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["after_failure"]["all_reduces"] == UNITS
        assert_same_step(result["after_failure"], result["deferred/True"])


def test_full_shard_shards_over_one_dimension_and_never_all_reduces(ranks: list[dict[str, Any]]) -> None:
    """FSDP2 takes any 2D mesh as HSDP: on (1, 4) it would all-reduce each unit's gradient over the
    one-rank replicate group after every micro-batch (UNITS x MICRO_BATCHES calls). The same batches
    and weights give the 2x2 mesh's loss and gradient norm."""
    for result in ranks:
        assert result["full_shard_mesh_dims"] == ("shard",)
        assert result["full_shard"]["all_reduces"] == 0
        assert result["full_shard"]["loss"] == pytest.approx(result["deferred/True"]["loss"], rel=1e-6)
        assert result["full_shard"]["grad_norm"] == pytest.approx(result["deferred/True"]["grad_norm"], rel=1e-5)
