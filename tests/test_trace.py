"""The traced step: one real training step at a large fake world size, on fake tensors, beside the plan."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.config.loading import load_config
from meshtrain.distributed.plan import memory_plan, planned_mesh
from meshtrain.model.args import model_args
from meshtrain.model.llama import build_model, count_parameters
from meshtrain.train.trace import trace_step

REPO = Path(__file__).resolve().parents[1]
# A GPU run of the debug model on 32 ranks (4 nodes of 8): bf16 compute, HSDP over 8.
GPU_RUN = ["scaling.use_gpu=true", "scaling.num_workers=32", "scaling.workers_per_node=8", "data.seq_len=512",
           "train.global_batch_size=64", "train.micro_batch_size=1", "data.tokenizer=train"]


def test_a_32_rank_step_is_traced_on_one_cpu_process_and_the_plan_holds_within_10_percent() -> None:
    cfg = load_config(None, GPU_RUN)
    args = model_args(cfg.model, cfg.data.vocab_size)
    plan, _ = planned_mesh(cfg.scaling, cfg.parallel)
    assert plan.shape == (4, 8)
    peak = trace_step(args, plan, cfg.parallel, cfg.train, cfg.optim, cfg.data.seq_len, cfg.scaling.use_gpu)
    # The sharded state is exact: fp32 parameters and two AdamW moments, one eighth each (rows padded to 8).
    shard_bytes = 4 * count_parameters(build_model(args, "meta")) / 8
    assert peak.by_kind["Sharded Param"] == pytest.approx(shard_bytes, rel=0.01)
    assert peak.by_kind["OptState"] == pytest.approx(2 * shard_bytes, rel=0.01)
    # Activations were computed in bf16, as on the GPU: collectives, gathered units and activations all appear.
    assert peak.by_kind["Activation"] > 0 and peak.by_kind["Unsharded Param"] > 0
    planned = memory_plan(args, plan, cfg.parallel, cfg.train, cfg.data.seq_len, True, cfg.model.document_mask).total
    assert abs(planned / peak.total - 1) < 0.10, (planned, peak)


def test_trace_needs_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    from meshtrain.cli.pretrain import main

    assert main(["--trace"]) == 2
    assert capsys.readouterr().err == "meshtrain: config error: --trace goes with --dry-run: add --dry-run\n"


@pytest.mark.parametrize(
    "overrides,mesh",
    [
        (["parallel.context=4", "parallel.tensor=2", "train.global_batch_size=8"],
         "replicate=4, shard=1, context=4, tensor=2"),
    ],
    ids=["cp4xtp2"],  # TP 2 alone traced 0.992 of the plan, CP 8 alone 0.999 (one-off runs)
)
def test_tensor_and_context_parallel_steps_are_traced_and_the_plan_holds_within_5_percent(
    overrides: list[str], mesh: str
) -> None:
    """The same 32-rank GPU run with TP (sequence-parallel norms, vocabulary-parallel loss) and CP
    (gathered keys and values), traced as a user runs it (``--dry-run --trace``, a process of its own:
    DTensor keeps process-group names across groups in one process): the plan's TP/CP arithmetic
    against the step that runs. For a GPU run the CPU kernels' CP mask (flex attention allocates
    none) is set apart, and the report says so."""
    result = subprocess.run([sys.executable, str(REPO / "jobs" / "pretrain.py"), "--dry-run", "--trace", *GPU_RUN,
                             *overrides], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"mesh: ({mesh}) on 32 workers" in result.stdout
    ratio = float(re.search(r"= ([0-9.]+)x the traced peak", result.stdout)[1])
    assert abs(ratio - 1) < 0.05, result.stdout[-2000:]
    assert ("of CPU attention mask that a GPU's flex attention does not allocate" in result.stdout) == (
        "context" in mesh)
