"""Parameter offload keeps buffers on the compute device and does not change the initial weights.

No GPU here: the meta device stands in for "a device other than the parameters'" (it accepts
copies and shape-only math), and a 1-rank gloo run exercises FSDP2's CPU offload end to end.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.model.args import model_args
from meshtrain.model.init import block_seed, fill_normal_rows, init_weights, rows_per_block
from meshtrain.model.llama import Transformer, build_model, materialize, rope_tables
from trainers import sharded_model

VOCAB = 97
SEED = 7


def tiny_config(offload: bool, tied: bool = False) -> MeshtrainConfig:
    return load_config(
        None,
        [
            "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=160",
            f"model.tie_embeddings={str(tied).lower()}", f"parallel.cpu_offload={str(offload).lower()}",
            "scaling.num_workers=1", "parallel.shard=1", "parallel.mixed_precision=fp32",
            "train.global_batch_size=2", "train.micro_batch_size=2", f"train.seed={SEED}",
        ],
    )


def meta_model(tied: bool = False) -> Transformer:
    return build_model(model_args(tiny_config(False, tied).model, VOCAB), "meta")


def reference_weights(tied: bool = False) -> dict[str, torch.Tensor]:
    model = materialize(meta_model(tied), "cpu")
    init_weights(model, SEED)
    return {name: param.detach().clone() for name, param in model.named_parameters()}


# --- materialize: parameter and buffer devices ----------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_buffers_go_to_the_buffer_device_and_parameters_stay(tied: bool) -> None:
    model = materialize(meta_model(tied), "cpu", buffer_device="meta")
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    assert params and set(buffers) == {"rope_cos", "rope_sin"}
    assert {name: p.device.type for name, p in params.items()} == dict.fromkeys(params, "cpu")
    assert {name: b.device.type for name, b in buffers.items()} == dict.fromkeys(buffers, "meta")
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    # The RoPE tables stay non-persistent: checkpoints and exports never see them.
    assert not {"rope_cos", "rope_sin"} & set(model.state_dict())


def test_buffers_default_to_the_parameter_device() -> None:
    model = materialize(meta_model(), "cpu")
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}


def test_rope_tables_are_rebuilt_on_the_buffer_device() -> None:
    """Parameters elsewhere (meta) must not stop the tables from being filled where they live."""
    model = materialize(meta_model(), "meta", buffer_device="cpu")
    model.reset_rope()
    cos, sin = rope_tables(model.args.head_dim, model.args.max_seq_len, model.args.rope_theta)
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)


# --- init: the same values whatever device holds the parameters -----------------------------------


def test_init_draws_on_the_host_whatever_the_parameter_device() -> None:
    """Drawing with a generator on the parameter's device fails on meta (and differs on CUDA)."""
    shape = torch.Size((300, 64))
    fill_normal_rows(torch.empty(shape, device="meta"), 0, shape, "w", SEED, 0.02)


def test_init_with_buffers_elsewhere_gives_the_reference_weights() -> None:
    model = materialize(meta_model(), "cpu", buffer_device="meta")
    init_weights(model, SEED)
    expected = reference_weights()
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), expected[name]), name


def test_a_shard_is_filled_with_the_rows_of_its_cpu_blocks() -> None:
    """Rows 70..229 of a parameter whose blocks hold 64 rows each: the values are the CPU
    generator's draws for blocks 1..3, cut at the shard's edges."""
    shape = torch.Size((300, 1 << 14))
    block_rows = rows_per_block(shape)
    assert block_rows == 64
    local = torch.empty((160, shape[1]))
    fill_normal_rows(local, 70, shape, "w", SEED, 0.5)
    blocks = []
    for block in range(1, 4):
        generator = torch.Generator().manual_seed(block_seed(SEED, "w", block))
        blocks.append(torch.empty((block_rows, shape[1])).normal_(0.0, 0.5, generator=generator))
    assert torch.equal(local, torch.cat(blocks)[70 - 64 : 70 - 64 + 160])


# --- FSDP2 CPU offload end to end (1 gloo rank, in this process) ------------------------------------


def train_once(offload: bool) -> dict[str, Any]:
    """One forward/backward of the FSDP2 model: its initial weights, loss, grads and devices."""
    model, _ = sharded_model(tiny_config(offload), VOCAB, WorkerLayout(), torch.device("cpu"))
    initial = {name: param.full_tensor().clone() for name, param in model.named_parameters()}
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    return {
        "loss": loss.item(),
        "initial": initial,
        "grads": {name: param.grad.full_tensor() for name, param in model.named_parameters()},
        "devices": {t.device.type for t in [*model.parameters(), *model.buffers()]},
        "offloaded": offload_flags(model),
    }


def offload_flags(model: torch.nn.Module) -> set[bool]:
    """FSDP2's own record, per sharded parameter, of whether it offloads to the host."""
    groups = [module._get_fsdp_state()._fsdp_param_group for module in model.modules() if isinstance(module, FSDPModule)]
    return {param.offload_to_cpu for group in groups if group is not None for param in group.fsdp_params}


def test_cpu_offload_trains_like_no_offload(single_rank_group: None) -> None:
    offloaded, resident = train_once(True), train_once(False)
    assert offloaded["offloaded"] == {True} and resident["offloaded"] == {False}
    assert offloaded["devices"] == {"cpu"}
    expected = reference_weights()
    for name, tensor in expected.items():
        assert torch.equal(offloaded["initial"][name], tensor), name
    assert offloaded["loss"] == pytest.approx(resident["loss"], rel=1e-6)
    for name, grad in resident["grads"].items():
        torch.testing.assert_close(offloaded["grads"][name], grad, rtol=1e-5, atol=1e-7)
