"""Profiler traces (profile.*): each rank's trace covers exactly the chosen steps and names the loop's
parts; profiling off builds nothing; under compiled blocks the ranges add no graph and no break."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

import meshtrain.train.profiling as profiling
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.config.observability import ProfileConfig
from meshtrain.data import DataPlan
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.observe.run_folder import ProfileRecord, Record
from meshtrain.train.profiling import StepProfiler, summary_line, top_ops
from meshtrain.train.trainer import train
from meshtrain.cluster.worker_plan import worker_plan

REGIONS = ("data wait", "forward", "block 0", "block 1", "attention", "loss", "backward", "grad clip", "optimizer step")


@pytest.fixture(scope="module")
def corpus(unsplit_corpus: DataPlan) -> DataPlan:
    return unsplit_corpus


def config(storage: Path, *overrides: str) -> MeshtrainConfig:
    """A tiny model without the document mask (no flex attention to compile), one worker."""
    return load_config(
        None,
        [
            "train.log_every=1", "train.global_batch_size=4", "train.micro_batch_size=2", "data.seq_len=32",
            "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=1", "model.dim=64",
            "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.document_mask=false",
            "scaling.num_workers=1", "checkpoint.enabled=false", "eval.interval=null", f"run.storage_path={storage}",
            "run.name=profiled", *overrides,
        ],
    )


def complete_events(trace: Path) -> Counter[str]:
    """How often each named range or op occurs in a Chrome trace (its complete, "X", events)."""
    events = json.loads(trace.read_text())["traceEvents"]
    return Counter(event["name"] for event in events if event.get("ph") == "X")


def steps_in(names: Counter[str]) -> list[int]:
    return sorted(int(name.removeprefix("ProfilerStep#")) for name in names if name.startswith("ProfilerStep#"))


def test_windows_trace_exactly_their_steps_and_name_the_loop(
    corpus: DataPlan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Windows of 2 steps at 1 (the run's first step: no warmup) and at 4 (warmed up at 3; it ends
    with the run's last step, so the end of the loop saves it): two traces, each of exactly its steps,
    each naming every part of the loop, and one summary line per window."""
    cfg = config(tmp_path, "train.steps=5", "profile.start_step=1", "profile.active_steps=2", "profile.every=3",
                 "profile.top=3")
    records: list[Record] = []
    train(worker_plan(cfg, corpus), WorkerLayout(), torch.device("cpu"), records.append)
    folder = tmp_path / "profiled" / "profile"
    assert sorted(path.name for path in folder.iterdir()) == ["rank0.1.pt.trace.json", "rank0.4.pt.trace.json"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[meshtrain] profile")]
    # The run's records carry each window's figures, the same as its line (metrics.jsonl, for tools).
    windows = [r for r in records if isinstance(r, ProfileRecord)]
    assert [(r.first_step, r.step, r.rank, r.device) for r in windows] == [(1, 2, 0, "cpu"), (4, 5, 0, "cpu")]
    for record, line in zip(windows, lines, strict=True):
        ops = [(name, ms) for name, ms in record.top_ms_per_step]
        assert line == summary_line(0, record.first_step, record.step, False, ops, Path(record.trace))
    for first, line in zip((1, 4), lines, strict=True):
        names = complete_events(folder / f"rank0.{first}.pt.trace.json")
        assert steps_in(names) == [first, first + 1]
        # Per step: one data wait, grad clip and optimizer step; per micro-batch (2) a forward, loss,
        # backward and each block; attention once per block and micro-batch.
        expected = {"data wait": 2, "grad clip": 2, "optimizer step": 2, "forward": 4, "loss": 4, "backward": 4,
                    "block 0": 4, "block 1": 4, "attention": 8}
        assert {region: names[region] for region in REGIONS} == expected
        trace = folder / f"rank0.{first}.pt.trace.json"
        assert line.startswith(f"[meshtrain] profile rank 0 steps {first}-{first + 1}: top CPU ops by self ms/step: ")
        assert line.endswith(f"; trace {trace}")
        assert line.count(" | ") == 2 and "aten::" in line


def test_off_builds_no_profiler_and_writes_nothing(
    corpus: DataPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a profiler was built with profiling off")

    monkeypatch.setattr(StepProfiler, "__init__", refuse)
    monkeypatch.setattr(profiling, "profile", refuse)
    train(worker_plan(config(tmp_path, "train.steps=2"), corpus), WorkerLayout(), torch.device("cpu"))
    assert not (tmp_path / "profiled" / "profile").exists()
    monkeypatch.undo()
    chosen = ProfileConfig(start_step=1, ranks=[1])
    assert StepProfiler.of(chosen, tmp_path, 0, 5, [], False, torch.device("cpu")) is None
    assert StepProfiler.of(chosen, tmp_path, 1, 5, [], False, torch.device("cpu")) is not None


def test_a_resumed_run_traces_the_rest_of_its_window_and_the_later_ones(tmp_path: Path) -> None:
    """Resumed at step 3, inside the window 2-4: it traces 3-4 at once, then 8-10 (warmed up at 7);
    the window from 14 lies past the run's 12 steps."""
    profiler = StepProfiler(ProfileConfig(start_step=2, active_steps=3, every=6), tmp_path, 0, 12, [], False,
                            torch.device("cpu"))
    for step in range(3, 13):
        profiler.step(step)
        torch.ones(8).add_(step)
    profiler.close()
    assert [path.name for path in profiler.traces] == ["rank0.3.pt.trace.json", "rank0.8.pt.trace.json"]
    assert steps_in(complete_events(profiler.traces[0])) == [3, 4]
    assert steps_in(complete_events(profiler.traces[1])) == [8, 9, 10]


def test_the_summary_names_device_kernels_on_a_gpu() -> None:
    """On CUDA the line ranks kernels by device time (CPU ops and named ranges left out), per step."""
    def event(key: str, device: DeviceType, cpu_us: int, device_us: int, annotation: bool = False) -> SimpleNamespace:
        return SimpleNamespace(key=key, device_type=device, self_cpu_time_total=cpu_us, self_device_time_total=device_us,
                               is_user_annotation=annotation)

    long_name = "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>"
    events = [
        event("aten::mm", DeviceType.CPU, 900, 4000),
        event(long_name, DeviceType.CUDA, 0, 3000),
        event("flash_fwd_kernel", DeviceType.CUDA, 0, 1000),
        event("block 0", DeviceType.CUDA, 0, 9000, annotation=True),
        event("idle", DeviceType.CUDA, 0, 0),
    ]
    ops = top_ops(events, device=True, count=5, steps=2)
    assert ops == [(long_name, 1.5), ("flash_fwd_kernel", 0.5)]
    line = summary_line(3, 10, 10, True, ops, Path("runs/r/profile/rank3.10.pt.trace.json"))
    assert line == ("[meshtrain] profile rank 3 step 10: top device kernels by self ms/step: "
                    f"{long_name[:57]}... 1.50 | flash_fwd_kernel 0.50; trace runs/r/profile/rank3.10.pt.trace.json")
    assert top_ops(events, device=False, count=1, steps=1) == [("aten::mm", 0.9)]


def test_compiled_blocks_keep_one_graph_when_a_window_adds_its_ranges(
    corpus: DataPlan, tmp_path: Path, single_rank_group: None
) -> None:
    """FSDP2 and compiled blocks: the block ranges come with the window at step 2, after step 1
    compiled the blocks, and cost no graph break (fullgraph would raise) and no recompilation; no
    attention range inside the compiled region."""
    from torch._dynamo.utils import counters

    counters.clear()
    cfg = config(tmp_path, "train.steps=3", "parallel.compile=true", "profile.start_step=2", "profile.active_steps=1")
    train(worker_plan(cfg, corpus), WorkerLayout(), torch.device("cpu"))
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    names = complete_events(tmp_path / "profiled" / "profile" / "rank0.2.pt.trace.json")
    assert steps_in(names) == [2]
    assert names["block 0"] == names["block 1"] == 2 and names["attention"] == 0
    assert any(name.startswith("Torch-Compiled Region") for name in names)
