"""Worker metrics without Prometheus: FLOPs against PyTorch's counter, the exposition a scrape
sees, the values training leaves in it, the targets file and the driver's progress output."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from corpora import stdlib_plan
from meshtrain.config.loading import load_config
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.model.args import model_args
from meshtrain.model.flops import device_peak_flops, flops_per_token, gpu_peak_flops, highest_peak_flops
from meshtrain.model.loss import token_cross_entropy_sum
from meshtrain.observe.goodput import goodput_of
from meshtrain.config.network import Endpoint, advertised_host
from meshtrain.observe.metrics import (
    DriverMetrics,
    StepClock,
    TrainingMetrics,
    targets_path,
    write_targets,
)
from meshtrain.observe.progress import ProgressMonitor
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    DownstreamEvalRecord,
    EvalRecord,
    Record,
    TrainRecord,
    append_records,
)
from meshtrain.train.trainer import train
from meshtrain.cluster.worker_plan import worker_plan
from record_samples import make
from test_model import initialized_model, tiny_args


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("seq_len", [16, 48])
def test_flops_per_token_equals_what_pytorch_counts_in_forward_and_backward(tied: bool, seq_len: int) -> None:
    # The math SDPA backend materializes QK^T and AV as bmm, which the counter sees; like our
    # formula it does the full square of work (the causal mask is applied, not skipped).
    args = tiny_args(tie_embeddings=tied)
    model = initialized_model(args)
    tokens = torch.randint(0, args.vocab_size, (3, seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        token_cross_entropy_sum(model(tokens), tokens).backward()
    assert counter.get_total_flops() / tokens.numel() == flops_per_token(args, seq_len)


def test_peak_flops_table_picks_the_right_gpu_and_dtype() -> None:
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == 494.7e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756.0e12
    assert gpu_peak_flops("NVIDIA H100 NVL", torch.bfloat16) == 835.0e12
    assert gpu_peak_flops("NVIDIA H200", torch.bfloat16) == 989.4e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312.0e12
    assert gpu_peak_flops("NVIDIA L4", torch.bfloat16) == 121.0e12
    assert gpu_peak_flops("NVIDIA L40S", torch.bfloat16) == 362.0e12
    assert gpu_peak_flops("NVIDIA A10", torch.bfloat16) == 125.0e12
    assert gpu_peak_flops("NVIDIA A10G", torch.bfloat16) is None  # not in the table: no guess
    # fp32 compute: the TF32 peak when TF32 is on, the (far lower) fp32 peak when it is off.
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32, tf32=False) == 66.9e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=False) == 19.5e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16, tf32=False) == 989.4e12
    # A Ray accelerator type may be any variant of its family: the floor of a step uses the fastest.
    assert highest_peak_flops("H100") == 989.4e12
    assert highest_peak_flops("A100-80G") == 312.0e12
    assert highest_peak_flops("A10G") is None
    cpu = torch.device("cpu")
    assert device_peak_flops(cpu, torch.float32, None, 2e11) == 2e11
    assert device_peak_flops(cpu, torch.float32, 5e12, 2e11) == 5e12


def scrape(port: int) -> dict[str, dict[str, Any]]:
    """``{sample name: {"type", "labels", "value"}}`` from one GET of /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + ("" if "le" not in sample.labels else f"[{sample.labels['le']}]")
            samples[key] = {"type": family.type, "labels": sample.labels, "value": sample.value}
    return samples


def new_metrics(**overrides: Any) -> TrainingMetrics:
    values: dict[str, Any] = dict(
        run="r1", rank=3, node="10.0.0.7", device=torch.device("cpu"), flops_per_token=1000.0, peak_flops_per_s=1e6
    )
    values.update(overrides)
    return TrainingMetrics(**values)


def test_exposition_follows_prometheus_conventions_and_shows_only_known_values() -> None:
    metrics = new_metrics()
    port = metrics.serve("127.0.0.1", 0)
    try:
        before = scrape(port)
        for sample in before.values():
            # Restart mode's one group is replica group 0.
            assert {"run": "r1", "replica": "0", "rank": "3", "node": "10.0.0.7"}.items() <= sample["labels"].items()
            assert sample["labels"].keys() <= {"run", "replica", "rank", "node", "le"}
        names = set(before)
        assert all(name.startswith("meshtrain_") for name in names)
        assert not any(name.endswith("_created") for name in names)
        counters = {name for name, s in before.items() if s["type"] == "counter"}
        assert counters and all(name.endswith("_total") for name in counters)
        # Nothing has happened yet: no loss, no checkpoint time, no throughput; a 0 would be a lie.
        for absent in ("meshtrain_loss", "meshtrain_checkpoint_load_duration_seconds", "meshtrain_tokens_per_second", "meshtrain_mfu_ratio"):
            assert absent not in names
        assert before["meshtrain_process_resident_memory_bytes"]["value"] > 10 * 2**20
        assert before["meshtrain_model_flops_per_token"]["value"] == 1000.0

        metrics.set_mesh(4, (2, 2))
        metrics.set_plan(8, 50)
        metrics.start_steps(10, 5000)
        for step in (11, 12, 13):
            time.sleep(0.02)
            metrics.step_done(step, 128, data_wait_s=0.5)
        metrics.logged(make(TrainRecord, loss=2.5, lr=1e-3, grad_norm=0.75, tokens=6536, tokens_per_s=2000.0), world_size=4)
        metrics.checkpoint_blocked(0.25)
        committed_before = time.time()
        metrics.checkpoint_event(make(CheckpointSaveRecord, step=12, total_s=1.5, bytes=4096))
        committed_after = time.time()
        metrics.checkpoint_event(make(CheckpointLoadRecord, step=12, load_s=0.125))
        after = scrape(port)
    finally:
        metrics.close()
    value = {name: sample["value"] for name, sample in after.items()}
    assert value["meshtrain_step"] == 13
    assert value["meshtrain_tokens_total"] == 3 * 128
    assert value["meshtrain_data_wait_seconds_total"] == 1.5
    assert value["meshtrain_loss"] == 2.5 and value["meshtrain_learning_rate"] == 1e-3
    assert value["meshtrain_grad_norm"] == 0.75 and value["meshtrain_run_tokens"] == 6536
    assert value["meshtrain_tokens_per_second"] == 500.0  # this worker's quarter of the global rate
    assert value["meshtrain_mfu_ratio"] == 500.0 * 1000.0 / 1e6
    assert value["meshtrain_step_duration_seconds_count"] == 3
    assert value["meshtrain_step_duration_seconds_sum"] >= 0.06
    assert value["meshtrain_step_duration_seconds_bucket[+Inf]"] == 3
    assert value["meshtrain_workers"] == 4 and value["meshtrain_workers_requested"] == 8
    assert value["meshtrain_checkpoint_interval_steps"] == 50
    assert committed_before <= value["meshtrain_checkpoint_last_commit_timestamp_seconds"] <= committed_after
    assert (value["meshtrain_mesh_replicate_degree"], value["meshtrain_mesh_shard_degree"]) == (2, 2)
    assert value["meshtrain_checkpoint_save_blocking_seconds"] == 0.25
    assert value["meshtrain_checkpoint_save_duration_seconds"] == 1.5
    assert value["meshtrain_checkpoint_size_bytes"] == 4096 and value["meshtrain_checkpoint_step"] == 12
    assert value["meshtrain_checkpoint_saves_total"] == 1
    assert value["meshtrain_checkpoint_load_duration_seconds"] == 0.125


def test_the_driver_exports_goodput_and_downstream_scores_per_task_and_metric() -> None:
    metrics = DriverMetrics("r1")
    port = metrics.serve("127.0.0.1", 0)
    try:
        metrics.scored(DownstreamEvalRecord(step=40, task="arc_easy", scores={"acc": 0.5, "acc_norm": 0.25}, samples=8,
                                            seconds=3.0, time=1.0))
        metrics.goodput(goodput_of([make(TrainRecord, step=1, time=3.0, interval_steps=1, step_time_s=1.0,
                                           data_wait_s=0.25)], started=0.0, ended=4.0))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            families = {family.name: family for family in text_string_to_metric_families(response.read().decode())}
    finally:
        metrics.close()
    scores = {(s.labels["task"], s.labels["metric"]): s.value for s in families["meshtrain_downstream_score"].samples}
    assert scores == {("arc_easy", "acc"): 0.5, ("arc_easy", "acc_norm"): 0.25}  # counts and times are not scores
    [step] = families["meshtrain_downstream_step"].samples
    assert step.labels["task"] == "arc_easy" and step.labels["run"] == "r1" and step.value == 40
    [ratio] = families["meshtrain_goodput_ratio"].samples
    assert ratio.labels == {"run": "r1"} and ratio.value == 0.75 / 4.0
    lost = {s.labels["cause"]: s.value for s in families["meshtrain_lost_seconds"].samples}
    assert (lost["start_up"], lost["data_wait"], lost["finishing"], lost["redone"]) == (2.0, 0.25, 1.0, 0.0)


def test_a_replica_groups_workers_label_every_series_with_their_group() -> None:
    """fault_tolerance.mode=replica: every group numbers its world ranks from 0, so the replica label is
    what tells group 1's rank 0 from group 0's (a sum over a run's workers counts each worker once). Its
    tokens/s and MFU are its own share of the step, which the groups split."""
    metrics = new_metrics(rank=0, replica=1)
    metrics.evaluated(make(EvalRecord, step=4, loss=2.0, sources={}))
    # Two groups of two workers trained the step: each worker, a quarter of the run's 2000 tokens/s.
    metrics.logged(make(TrainRecord, tokens_per_s=2000.0, replicas=2), world_size=2)
    exposed = generate_latest(metrics.registry).decode()
    samples = [sample for family in text_string_to_metric_families(exposed) for sample in family.samples]
    assert {sample.name for sample in samples} >= {"meshtrain_step_duration_seconds_count", "meshtrain_eval_loss"}
    assert all((sample.labels["replica"], sample.labels["rank"]) == ("1", "0") for sample in samples)
    value = {sample.name: sample.value for sample in samples}
    assert value["meshtrain_tokens_per_second"] == 500.0 and value["meshtrain_mfu_ratio"] == 500.0 * 1000.0 / 1e6


def test_a_taken_port_falls_back_to_a_free_one() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        metrics = new_metrics()
        try:
            port = metrics.serve("127.0.0.1", busy)
            assert port != busy and scrape(port)["meshtrain_model_flops_per_token"]["value"] == 1000.0
        finally:
            metrics.close()


def test_final_scrape_wait_happens_only_when_something_scrapes(monkeypatch) -> None:
    metrics = new_metrics()
    port = metrics.serve("127.0.0.1", 0)
    try:
        waits: list[float] = []
        wait_beyond = metrics._scrapes.wait_beyond
        monkeypatch.setattr(metrics._scrapes, "wait_beyond",
                            lambda started, timeout_s: waits.append(timeout_s) or wait_beyond(started, timeout_s))
        assert metrics.await_final_scrape(5.0) is False and waits == []  # never scraped: no wait at all
        scrape(port)
        seen: list[float] = []

        def late_scrape() -> None:
            time.sleep(0.5)
            seen.append(scrape(port)["meshtrain_step"]["value"])

        metrics.step_done(7, 1, 0.0)
        scraper = threading.Thread(target=late_scrape)
        scraper.start()
        assert metrics.await_final_scrape(5.0) is True
        scraper.join()
        assert seen == [7] and waits == [5.0]
    finally:
        metrics.close()


def test_step_clock_reports_each_step_once() -> None:
    clock = StepClock(torch.device("cpu"))
    for pause in (0.01, 0.03):
        time.sleep(pause)
        clock.mark()
    first = clock.drain()
    assert len(first) == 2 and first[0] >= 0.01 and first[1] >= 0.03
    assert clock.drain() == []


def test_targets_file_lists_endpoints_and_is_emptied(tmp_path: Path) -> None:
    path = targets_path(None, str(tmp_path), "run-a")
    assert path == tmp_path / "prometheus" / "run-a.json"
    assert targets_path(str(tmp_path / "sd"), "/ignored", "run-a") == tmp_path / "sd" / "run-a.json"
    write_targets(path, [Endpoint("10.0.0.1", 9800), Endpoint("10.0.0.1", 9801), Endpoint("fd00::2", 9800)])
    assert json.loads(path.read_text()) == [
        {"targets": ["10.0.0.1:9800", "10.0.0.1:9801", "[fd00::2]:9800"], "labels": {}}
    ]
    write_targets(path, [])
    assert json.loads(path.read_text()) == []
    assert [p.name for p in path.parent.iterdir()] == ["run-a.json"]  # no temporary files left
    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert advertised_host("127.0.0.1", "10.1.2.3") == "127.0.0.1"


def test_training_leaves_the_logged_values_in_the_metrics(tmp_path: Path) -> None:
    corpus = stdlib_plan(tmp_path / "token_stores")
    cfg = load_config(
        None,
        [
            "train.steps=6", "optim.warmup_steps=2", "train.log_every=2", "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "data.seq_len=32", "data.vocab_size=512", "data.max_documents=24", "scaling.num_workers=1",
            "checkpoint.interval=3", f"run.storage_path={tmp_path}", "run.name=metrics",
        ],
    )
    metrics = new_metrics(flops_per_token=flops_per_token(model_args(cfg.model, corpus.vocab_size), 32))
    port = metrics.serve("127.0.0.1", 0)
    records: list[Record] = []
    try:
        train(worker_plan(cfg, corpus), WorkerLayout(), torch.device("cpu"), records.append, metrics)
        value = {name: sample["value"] for name, sample in scrape(port).items()}
    finally:
        metrics.close()
    logged = [r for r in records if isinstance(r, TrainRecord)]
    saves = [r for r in records if isinstance(r, CheckpointSaveRecord)]
    last = logged[-1]
    assert value["meshtrain_step"] == last.step == 6
    assert value["meshtrain_loss"] == last.loss and value["meshtrain_grad_norm"] == last.grad_norm
    assert value["meshtrain_learning_rate"] == last.lr
    assert value["meshtrain_tokens_total"] == value["meshtrain_run_tokens"] == last.tokens == 6 * 4 * 32
    assert value["meshtrain_tokens_per_second"] == last.tokens_per_s
    assert value["meshtrain_step_duration_seconds_count"] == 6
    assert value["meshtrain_checkpoint_saves_total"] == len(saves) == 2
    assert value["meshtrain_checkpoint_size_bytes"] == saves[-1].bytes
    assert value["meshtrain_checkpoint_step"] == 6
    assert (value["meshtrain_workers"], value["meshtrain_mesh_shard_degree"]) == (1, 1)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _write(path: Path, records: list[Record]) -> None:
    append_records(path, records)


def _step(step: int) -> TrainRecord:
    return make(TrainRecord, step=step, loss=3.0, lr=1e-3, grad_norm=1.0, tokens=step * 100, tokens_per_s=1000.0,
                  step_time_s=0.1, elapsed_s=step * 0.1, world_size=1)


def test_progress_in_a_log_is_throttled_but_keeps_checkpoints_and_the_end(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _write(path, [_step(1)])  # an earlier job of this run: not repeated
    out = io.StringIO()
    with ProgressMonitor(path, total_steps=100, interval_s=3600, stream=out, poll_s=0.05) as monitor:
        _write(path, [_step(s) for s in range(2, 50)])
        _write(path, [make(CheckpointSaveRecord, step=50, path="/c/50", blocking_s=0.1, total_s=0.2, bytes=2**20)])
        monitor.poll()
        _write(path, [_step(s) for s in range(50, 101)])
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == [
        "[meshtrain] step 2/100",
        "[meshtrain] checkpoint step 50 committed: 1.0 MiB, loop blocked 0.10s, written in 0.20s -> /c/50",
        "[meshtrain] step 100/100",
    ]
    assert "ETA 0m00s" in lines[-1] and "\r" not in out.getvalue()


def test_progress_stops_on_the_latest_step_when_a_run_fails(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    out = io.StringIO()
    with ProgressMonitor(path, total_steps=100, interval_s=3600, stream=out, poll_s=0.05):
        _write(path, [_step(s) for s in range(1, 38)])
    assert [line.split(" |")[0] for line in out.getvalue().splitlines()] == [
        "[meshtrain] step 1/100", "[meshtrain] step 37/100"
    ]


def test_progress_on_a_terminal_rewrites_one_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    out = FakeTerminal()
    with ProgressMonitor(path, total_steps=3, interval_s=3600, stream=out, poll_s=0.05) as monitor:
        _write(path, [_step(1), _step(2)])
        monitor.poll()
        _write(path, [make(CheckpointLoadRecord, step=2, path="/c/2", load_s=0.5), _step(3)])
    text = out.getvalue()
    assert text.count("\n") == 2  # the checkpoint line and the final newline
    assert text.count("\r\033[K") == 4
    assert text.endswith("ETA 0m00s\n")


def test_tf32_is_on_for_cuda_fp32_unless_set_and_sets_the_matmul_precision() -> None:
    from meshtrain.distributed.parallelize import set_matmul_precision, use_tf32

    assert use_tf32(None, "fp32", "cuda") and not use_tf32(None, "bf16", "cuda") and not use_tf32(None, "auto", "cuda")
    assert not use_tf32(False, "fp32", "cuda") and use_tf32(True, "bf16", "cuda")
    assert not use_tf32(True, "fp32", "cpu")  # no TF32 on CPU workers: MFU keeps the CPU peak
    before = torch.get_float32_matmul_precision()
    try:
        set_matmul_precision(True)
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
        set_matmul_precision(False)
        assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cudnn.allow_tf32 = True
