"""jobs/bench_gpu.py: the GPU configurations' dry-run plans and H100 verdicts (no Ray), how a failed
configuration is reduced to one line, the profiler's window after the timed steps and its summary read
back from a trace, and the tiny CPU set end to end through Ray."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs import REPO, job_env, read_metrics
from meshtrain.observe.run_folder import ProfileRecord, TrainRecord, append_records
from record_samples import make

BENCH = REPO / "jobs" / "bench_gpu.py"
MATRIX = yaml.safe_load((REPO / "jobs" / "bench_gpu.yaml").read_text())["sets"]
VERDICT = re.compile(r"^verdict: (fits|does not fit) H100 \(79\.6 GiB\): [\d.]+ GiB planned", re.MULTILINE)


def run_bench(*args: str, timeout: float = 120, own_ray: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        cwd=REPO, env=job_env(own_ray=own_ray, **env), capture_output=True, text=True, timeout=timeout,
    )


def test_dry_run_plans_every_gpu_configuration_with_an_h100_verdict() -> None:
    # An address no Ray listens on: a dry run that tried to join a cluster would fail.
    job = run_bench("--dry-run", own_ray=True, RAY_ADDRESS="127.0.0.1:1")
    assert job.returncode == 0, job.stderr[-3000:]
    blocks = dict(re.findall(r"^== (\S+) ==\n(.*?)(?=^== |^\| config )", job.stdout, re.MULTILINE | re.DOTALL))
    assert list(blocks) == list(MATRIX["gpu"]["configs"])
    for name, block in blocks.items():
        assert VERDICT.search(block), name
        assert re.search(r"^  total \(peak: the largest of the three\) +[\d.]+$", block, re.MULTILINE), name
        assert "model FLOPs per token" in block and "parameters: " in block, name
    summary = re.findall(r"^\| (\S+) \| [\d.]+ \| 1 \| (?:fits|does not fit) H100", job.stdout, re.MULTILINE)
    assert summary == list(blocks)
    assert any(name.startswith("8b-8l") for name in blocks) and any(name.startswith("1b-") for name in blocks)


def test_window_rounds_warmup_and_timed_steps_to_whole_logging_intervals() -> None:
    from meshtrain_bench.gpu_configs import Window

    assert Window.for_request(6, 20) == Window(warmup=6, timed=21, log_every=3)
    assert Window.for_request(5, 12) == Window(warmup=6, timed=12, log_every=3)
    assert Window.for_request(1, 3).total == 5  # warm-up 2: the first logged step (1) is not timed


def test_a_failed_configuration_is_one_line_naming_the_rank_that_failed_first() -> None:
    from ray.train import WorkerGroupError

    from meshtrain.cluster.outcome import TrainingFailed
    from meshtrain_bench.gpu_launch import failure_reason

    peer = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer.")
    oom = RuntimeError("CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total capacity of 79.19 GiB")
    try:
        try:
            raise WorkerGroupError("snippets", {0: peer, 1: oom})
        except WorkerGroupError:
            # What the launcher raises over Ray's error.
            raise TrainingFailed("training failed (run.max_failures=0): Training failed due to worker errors") from None
    except TrainingFailed as exc:
        reason = failure_reason(exc)
    assert reason == f"rank 1: RuntimeError: {oom} (+1 other rank(s) failed)"
    long = failure_reason(RuntimeError("x" * 1000 + "\nsecond line"))
    assert "\n" not in long and len(long) <= 240


def test_the_profiled_steps_follow_the_timed_ones_and_allocator_history_is_set_on_gpu_only() -> None:
    from meshtrain_bench.gpu_configs import (
        DEFAULT_MATRIX,
        HISTORY_ENTRIES,
        PROFILED_STEPS,
        Window,
        build_config,
        load_matrix,
        run_settings,
        select,
    )

    sets = load_matrix(DEFAULT_MATRIX)
    window = Window.for_request(6, 20)
    gpu = select(sets, "gpu", ["1b-mb1"], {})[0]
    cpu = select(sets, "tiny", ["tiny-2w-mb2"], {})[0]
    settings = run_settings(gpu, window, "run", "runs")
    # Step window.total is the timed window's last; the next one starts the profiler, the one after is traced.
    assert settings["profile.start_step"] == window.total + 2 == settings["train.steps"]
    assert settings["profile.active_steps"] == PROFILED_STEPS == 1 and settings["profile.ranks"] == [0]
    assert settings["memory.history_entries"] == HISTORY_ENTRIES
    assert build_config(settings).memory.history_entries == HISTORY_ENTRIES
    cpu_cfg = build_config(run_settings(cpu, window, "run", "runs"))
    assert cpu_cfg.memory.history_entries is None and cpu_cfg.profile.start_step == window.total + 2
    for config in (gpu, cpu):
        plain = run_settings(config, window, "run", "runs", profile=False)
        assert plain["train.steps"] == window.total
        assert not [key for key in plain if key.startswith(("profile.", "memory."))]


def fake_gpu_run(run_dir: Path, window: Any, step_s: float, global_tokens: int, flops: float) -> None:
    """The files a one-GPU run leaves: rank 0's logged steps, its tokenizer (no Ray, no GPU)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from meshtrain.data.tokenizer import EOS_TOKEN

    run_dir.mkdir(parents=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS_TOKEN])
    tokenizer.train_from_iterator(["a tiny corpus"] * 4, trainer)
    tokenizer.save(str(run_dir / "tokenizer.json"))
    warmup_s = 30.0  # compilation
    records = [
        make(TrainRecord, step=step, tokens=step * global_tokens, loss=5.0, data_wait_s=0.002,
             elapsed_s=warmup_s * min(step, window.warmup) / window.warmup + step_s * max(0, step - window.warmup),
             # The attended pairs differ a little by interval (documents end at other places).
             flops_per_token=flops * (1 + 0.01 * (step % 2)))
        for step in range(window.log_every, window.total + 1, window.log_every)
    ]
    append_records(run_dir / "metrics.jsonl", records)


def test_a_gpu_run_is_measured_against_the_h100_peak_and_its_memory_plan(tmp_path: Path) -> None:
    from meshtrain.config.loading import load_config
    from meshtrain.distributed.layout import MeshPlan
    from meshtrain.distributed.plan import memory_plan
    from meshtrain.model.args import model_args
    from meshtrain.model.flops import flops_per_token
    from meshtrain_bench.gpu_configs import DEFAULT_MATRIX, Window, build_config, load_matrix, run_settings, select
    from meshtrain_bench.gpu_launch import read_diagnostics
    from meshtrain_bench.gpu_measure import Row, measure
    from meshtrain_bench.gpu_report import table_row

    config = select(load_matrix(DEFAULT_MATRIX), "gpu", ["1b-mb4-sel"], {})[0]
    window = Window.for_request(6, 20)
    cfg = build_config(run_settings(config, window, "fake", str(tmp_path)))
    fake_gpu_run(tmp_path / "fake", window, step_s=0.5, global_tokens=4 * 4096, flops=9e9)
    planned = memory_plan(model_args(cfg.model, 300), MeshPlan(1, 1, True), cfg.parallel, cfg.train, cfg.data.seq_len, True, cfg.model.document_mask).total
    summary = {
        "run_dir": str(tmp_path / "fake"), "world_size": 1, "mesh_shape": [1, 1], "parameters": 1_235_814_400,
        "workers": [{"rank": 0, "node_rank": 0}], "wall_time_s": 100.0, "train_time_s": 40.5,
        "device": "NVIDIA H100 80GB HBM3", "peak_device_memory_bytes": int(0.9 * planned), "num_alloc_retries": 3,
    }
    row = measure(Row("1b-mb4-sel", "failed"), cfg, summary, window)
    assert row.status == "ok" and row.device == "NVIDIA H100 80GB HBM3"
    assert row.tokens_per_s_per_worker == pytest.approx(4 * 4096 / 0.5)
    full = flops_per_token(model_args(load_config(None, ["model.preset=llama3_1b"]).model, 300), 4096)
    assert row.flops_per_token_full_attention == full
    # The timed steps 7-27 are logged at 9, 12, ..., 27: four odd steps (x 1.01) and three even ones.
    assert row.flops_per_token == pytest.approx(9e9 * (1 + 0.01 * 4 / 7))
    assert row.peak_flops_per_s == 989.4e12 and row.peak_source.startswith("NVIDIA H100 80GB HBM3 dense bf16")
    assert row.mfu_full_attention == pytest.approx(row.tokens_per_s_per_worker * full / 989.4e12)
    assert row.mfu == pytest.approx(row.tokens_per_s_per_worker * row.flops_per_token / 989.4e12)
    assert row.measured_kind == "cuda_max_allocated" and row.measured_over_planned == pytest.approx(0.9, abs=1e-9)
    assert row.alloc_retries == 3
    assert (row.step_ms, row.data_wait_ms, row.warmup_ms_per_step) == pytest.approx((500.0, 2.0, 5000.0))
    assert row.setup_s == pytest.approx(59.5)
    line = table_row(row)
    assert line.startswith(f"| 1b-mb4-sel | 32,768 | {100 * row.mfu:.1f}% | {100 * row.mfu_full_attention:.1f}% | "
                           "NVIDIA H100") and "| 0.90 | 3 |" in line

    # What the run folder says besides: rank 0's profiled window (its record) and the snapshots the
    # allocator history gave at the end of the steps.
    run_dir = tmp_path / "fake"
    (run_dir / "memory").mkdir()
    for rank in (0, 1):
        (run_dir / "memory" / f"rank{rank}.step29.end.pickle").write_bytes(b"")
    append_records(run_dir / "metrics.jsonl", [
        ProfileRecord(step=29, rank=rank, first_step=29, device="cuda",
                      top_ms_per_step=[["sm90_gemm", 4.0], ["Memcpy HtoD", 0.5]],
                      trace=str(run_dir / "profile" / f"rank{rank}.29.pt.trace.json"))
        for rank in (1, 0)
    ])
    read_diagnostics(row, run_dir)
    assert row.memory_snapshots == ["memory/rank0.step29.end.pickle", "memory/rank1.step29.end.pickle"]
    assert row.profile_trace == "profile/rank0.29.pt.trace.json"
    assert row.profile_summary == ("[meshtrain] profile rank 0 step 29: top device kernels by self ms/step: sm90_gemm "
                                   "4.00 | Memcpy HtoD 0.50; trace profile/rank0.29.pt.trace.json")


def test_tiny_cpu_benchmark_runs_every_configuration_through_ray(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    job = run_bench(
        "--cpu-smoke", "--steps", "3", "--warmup", "2", "--storage", str(tmp_path / "runs"), "--out", str(out),
        timeout=300,
    )
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    names = list(MATRIX["tiny"]["configs"])
    assert "MFU = tokens/s per worker x model FLOPs per token / device peak FLOP/s" in job.stdout
    table = job.stdout[job.stdout.rindex("| config |"):]
    for name in names:
        # tok/s, MFU, MFU full attn, peak, RSS, plan, then measured/plan and alloc retries: nothing on CPU.
        cells = re.search(rf"^\| {re.escape(name)} \| ([\d,]+) \| ([\d.]+)% \| ([\d.]+)% \| CPU nominal [^|]+ \| "
                          r"[\d.]+ \(RSS\) \| [\d.]+ \| - \| - \| [\d.]+ \|", table, re.MULTILINE)
        assert cells is not None, table
        assert float(cells[1].replace(",", "")) > 0
        assert 0 < float(cells[2]) < float(cells[3])  # the causal mask halves attention's FLOPs

    document = json.loads(out.read_text())
    assert [row["name"] for row in document["rows"]] == names
    assert (document["warmup_steps"], document["timed_steps"], document["profiled_steps"]) == (2, 3, 1)
    for row in document["rows"]:
        workers = MATRIX["tiny"]["configs"][row["name"]]["scaling.num_workers"]
        assert row["status"] == "ok" and row["tokens_per_s_per_worker"] > 0
        assert row["world_size"] == workers and row["mesh_shape"] == [1, workers]
        assert row["device"] == "cpu" and 0 < row["mfu"] < row["mfu_full_attention"] < 1
        assert row["alloc_retries"] is None and row["memory_snapshots"] == []
        # On CPU the peak is the worker's resident set: printed, never divided by the device plan.
        assert row["measured_kind"] == "host_peak_rss" and row["measured_peak_bytes"] > 2**20
        assert row["measured_over_planned"] is None and row["planned_bytes"] > 0
        assert row["step_ms"] > 0 and 0 <= row["data_wait_ms"] < row["step_ms"]
        assert row["rest_ms"] == pytest.approx(row["step_ms"] - row["data_wait_ms"])
        run_dir = Path(row["run_dir"])
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["peak_host_rss_bytes"] == row["measured_peak_bytes"]
        assert "peak_device_memory_bytes" not in summary
        steps = [r for r in read_metrics(run_dir) if isinstance(r, TrainRecord)]
        # Steps 1-2 warm up, 3-5 are timed, 6 starts the profiler and rank 0 traces 7.
        assert [r.step for r in steps] == [1, 2, 3, 4, 5, 6, 7] and all(r.data_wait_s >= 0 for r in steps)
        assert row["flops_per_token_full_attention"] == steps[-1].flops_per_token_full_attention
        assert row["profile_trace"] == "profile/rank0.7.pt.trace.json"
        assert [p.name for p in (run_dir / "profile").iterdir()] == ["rank0.7.pt.trace.json"]
        assert row["profile_summary"].startswith("[meshtrain] profile rank 0 step 7: top CPU ops by self ms/step: ")
        assert row["profile_summary"].endswith("; trace profile/rank0.7.pt.trace.json")
        assert "aten::" in row["profile_summary"]
        assert f"  {row['profile_summary']}" in job.stdout.splitlines()
