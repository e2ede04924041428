"""The --dry-run memory plan: its components for a Llama-3-8B shape, and the fit verdict."""

from __future__ import annotations

import pytest

import meshtrain.cluster.launcher
from meshtrain.cli.pretrain import main
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.distributed.layout import MeshPlan
from meshtrain.distributed.plan import (
    CONTEXT_RESERVE_GIB,
    DEVICE_MEMORY_GIB,
    FRAGMENTATION_SHARE,
    GIB,
    Device,
    MemoryPlan,
    fit_verdict,
    memory_plan,
    planned_device,
)
from meshtrain.model.args import model_args
from meshtrain.model.loss import loss_chunk_tokens

# Llama-3-8B: dim 4096, 32 layers, 32 heads, 8 KV heads of 128, FFN 14336, vocabulary 128256.
DIM, LAYERS, KV_DIM, FFN, VOCAB = 4096, 32, 8 * 128, 14336, 128256
BLOCK = 2 * DIM * DIM + 2 * DIM * KV_DIM + 3 * DIM * FFN + 2 * DIM  # wq, wo; wk, wv; w1-w3; 2 norms
HEAD = VOCAB * DIM + DIM  # output + final norm
BF16 = 2
LLAMA3_8B = [
    "model.preset=llama3_8b", f"data.vocab_size={VOCAB}", "data.seq_len=4096", "scaling.use_gpu=true",
    "scaling.num_workers=8", "scaling.workers_per_node=8", "train.global_batch_size=8", "train.micro_batch_size=1",
]


def plan_for(*overrides: str, plan: MeshPlan = MeshPlan(1, 8, True)) -> MemoryPlan:
    cfg = load_config(None, [*LLAMA3_8B, *overrides])
    return memory_plan(model_args(cfg.model, VOCAB), plan, cfg.parallel, cfg.train, cfg.data.seq_len, True, cfg.model.document_mask)


def test_block_shape_is_the_8b_one() -> None:
    assert BLOCK == 218_112_000


def test_head_unit_keeps_its_bf16_weight_and_gradient() -> None:
    memory = plan_for()
    assert memory.head_unit == 2 * HEAD * BF16 == 2 * (128256 * 4096 + 4096) * 2
    assert memory.gathered_blocks == 2 * (1 + 1) * BLOCK * BF16  # running + prefetched block, weight + grad
    assert memory.gathered == memory.gathered_blocks + memory.head_unit


def test_tied_head_lives_in_the_root_unit_with_the_same_size() -> None:
    assert plan_for("model.tie_embeddings=true").head_unit == 2 * HEAD * BF16


def test_fp32_compute_doubles_the_gathered_units() -> None:
    memory = plan_for("parallel.mixed_precision=fp32")
    assert memory.head_unit == 2 * HEAD * 4 and memory.gathered_blocks == 4 * BLOCK * 4


def test_deeper_prefetch_gathers_more_blocks() -> None:
    assert plan_for("parallel.prefetch=3").gathered_blocks == 2 * (1 + 3) * BLOCK * BF16


def test_zero2_keeps_every_block_and_the_embedding_gathered() -> None:
    memory = plan_for(plan=MeshPlan(1, 8, False))
    assert memory.gathered_blocks == ((LAYERS + 1) * BLOCK + VOCAB * DIM) * BF16
    tied = plan_for("model.tie_embeddings=true", plan=MeshPlan(1, 8, False))
    assert tied.gathered_blocks == (LAYERS + 1) * BLOCK * BF16  # the embedding is the head, in the root


def test_logits_are_bf16_holding_their_gradient_plus_one_fp32_chunk() -> None:
    tokens = 4096
    chunk = loss_chunk_tokens(VOCAB)
    assert 0 < chunk < tokens
    expected = tokens * VOCAB * BF16 + chunk * VOCAB * 4 + tokens * 4
    assert plan_for().logits == expected
    # A micro-batch smaller than a chunk upcasts only its own tokens.
    short = plan_for("data.seq_len=256")
    assert short.logits == 256 * VOCAB * BF16 + 256 * VOCAB * 4 + 256 * 4


def test_offload_moves_only_the_sharded_state_off_the_device() -> None:
    resident, offloaded = plan_for(), plan_for("parallel.cpu_offload=true")
    sharded = -(-(LAYERS * BLOCK + 2 * VOCAB * DIM + DIM) // 8)
    assert (resident.parameters, resident.gradients, resident.optimizer) == (4 * sharded, 4 * sharded, 8 * sharded)
    assert (offloaded.parameters, offloaded.gradients, offloaded.optimizer) == (0, 0, 0)
    assert offloaded.gathered == resident.gathered and offloaded.logits == resident.logits


# --- the verdict -----------------------------------------------------------------------------------


def plan_of(total_gib: float) -> MemoryPlan:
    return MemoryPlan(0, 0, 0, 0, 0, int(total_gib * GIB), 0)


def test_usable_memory_keeps_the_margin() -> None:
    assert Device("H100", 80.0).usable_gib == pytest.approx(80 * (1 - FRAGMENTATION_SHARE) - CONTEXT_RESERVE_GIB)
    assert Device("H100", 80.0).usable_gib == pytest.approx(70.0)


def test_verdict_fits() -> None:
    line = fit_verdict(plan_of(50), Device("H100", 79.6))
    assert line.startswith("verdict: fits H100 (79.6 GiB): 50.0 GiB planned of 69.6 usable (")
    assert "10% + 2 GiB" in line and "does not" not in line


def test_verdict_does_not_fit_and_says_what_to_change() -> None:
    line = fit_verdict(plan_of(70), Device("H100", 79.6))
    assert line.startswith("verdict: does not fit H100 (79.6 GiB): 70.0 GiB planned of 69.6 usable (")
    assert "train.micro_batch_size" in line and "parallel.activation_checkpointing=full" in line


def test_verdict_without_a_known_device_names_the_settings() -> None:
    line = fit_verdict(plan_of(1), None)
    assert "scaling.device_memory_gib" in line and "scaling.accelerator_type" in line and "H100" in line


def scaling(**values: object) -> MeshtrainConfig:
    return load_config(None, ["scaling.use_gpu=true", *(f"scaling.{k}={v}" for k, v in values.items())])


def test_planned_device_from_accelerator_type_or_explicit_memory() -> None:
    assert planned_device(scaling(accelerator_type="H200").scaling) == Device("H200", DEVICE_MEMORY_GIB["H200"])
    assert planned_device(scaling(accelerator_type="l4").scaling) == Device("L4", 22.4)
    assert planned_device(scaling(accelerator_type="TPU-V4").scaling) is None
    assert planned_device(scaling().scaling) is None
    # The explicit size wins over the table (an A100 that is the 80 GB part).
    assert planned_device(scaling(accelerator_type="A100", device_memory_gib=80).scaling) == Device("A100", 80.0)
    assert planned_device(scaling(device_memory_gib=24).scaling) == Device("the GPU", 24.0)
    # CPU workers: no GPU to fit.
    assert planned_device(load_config(None, ["scaling.device_memory_gib=24"]).scaling) is None


def test_an_ambiguous_type_assumes_the_smaller_part_and_says_so() -> None:
    device = planned_device(scaling(accelerator_type="A100").scaling)
    assert device is not None and device.memory_gib == 40.0
    assert "scaling.device_memory_gib" in fit_verdict(plan_of(1), device)


# --- --dry-run -------------------------------------------------------------------------------------


def dry_run(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    def refuse(cfg: MeshtrainConfig) -> dict:
        raise AssertionError("the dry run tried to launch")

    monkeypatch.setattr(meshtrain.cluster.launcher, "launch", refuse)
    code = main(["--dry-run", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.partition("\n---\n")[2].splitlines()


@pytest.mark.parametrize(
    ("device", "verdict"),
    [
        ("scaling.accelerator_type=H100", "verdict: fits H100 (79.6 GiB): "),
        ("scaling.accelerator_type=L4", "verdict: does not fit L4 (22.4 GiB): "),
        ("scaling.device_memory_gib=64", "verdict: fits the GPU (64 GiB): "),
    ],
)
def test_dry_run_prints_the_verdict_above_the_table(
    device: str, verdict: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = dry_run([*LLAMA3_8B, device], capsys, monkeypatch)
    (line,) = [line for line in lines if line.startswith("verdict:")]
    assert line.startswith(verdict), line
    assert lines.index(line) + 1 == lines.index("memory per rank (GiB):")
    gathered = next(line for line in lines if "gathered units + their grads" in line)
    expected = (2 * 2 * BLOCK + 2 * HEAD) * BF16 / GIB
    assert float(gathered.split()[-1]) == pytest.approx(expected, abs=1e-3)
    total = float(lines[-1].split()[-1])
    assert f"{total:.1f} GiB planned" in line


def test_dry_run_on_cpu_workers_has_no_verdict(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    lines = dry_run([], capsys, monkeypatch)
    assert not [line for line in lines if line.startswith("verdict")]
