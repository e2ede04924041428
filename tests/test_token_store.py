"""Token stores: equal to the in-memory stream, built in parallel and resumably, mixtures, a
validation split, and one-line errors for every kind of bad store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from corpora import stdlib_plan
from meshtrain.config import ConfigError, DataConfig, SourceConfig, StageConfig
from meshtrain.config.loading import load_config
from meshtrain.data.integrity import CorruptTokens
from meshtrain.data import (
    DataParallelBatches,
    MixtureSamples,
    PackedSequences,
    TokenStore,
    open_data,
    prepare_data,
    stdlib_source_files,
    verify_store,
)
from meshtrain.data.pipeline import TrainingData
from meshtrain.data.sampling import MIXTURE_BLOCK, Samples, apportion
from meshtrain.data.skips import SkipRange, changed_before, check_left_out, merged_skips
from meshtrain.data.stages import StagedSamples, data_stages
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.observe.run_folder import MixtureRecord, check_record
from meshtrain.train.trainer import train
from meshtrain.cluster.worker_plan import worker_plan
from s3server import moto_s3

REPO = Path(__file__).resolve().parents[1]
SEQ = 32


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    # Small units: the 24 files land in several shards, so windows cross shard boundaries.
    # No held-out windows: the stream is compared with the whole corpus.
    return stdlib_plan(
        tmp_path_factory.mktemp("stores"), documents=24, prepare_unit_bytes=100_000, validation={"fraction": 0.0}
    )


def in_memory_stream(tokenizer_json: str, eos: int, documents: int) -> np.ndarray:
    """The stream the old in-memory path built: every document's ids then the end token, in file order."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    texts = [p.read_text() for p in stdlib_source_files()[:documents]]
    return np.concatenate([np.asarray(e.ids + [eos], dtype=np.uint16) for e in tokenizer.encode_batch(texts)])


def test_store_stream_equals_the_in_memory_stream_bitwise(plan) -> None:
    store = TokenStore(plan.stores[0].url)
    assert len(store.manifest.shards) > 2
    reference = in_memory_stream(plan.tokenizer_json, plan.eos_id, 24)
    assert np.array_equal(store.read(0, len(store)), reference)
    a, b = PackedSequences(reference, SEQ, 0), open_data(plan, SEQ, 0).train
    assert all(np.array_equal(a.sample(i), b.sample(i)) for i in range(2 * a.windows))
    boundary = store.index.end(0)  # a read across the first shard boundary joins both
    assert np.array_equal(store.read(boundary - 5, boundary + 5), reference[boundary - 5 : boundary + 5])


def test_training_from_the_store_equals_training_in_memory(plan) -> None:
    cfg = load_config(None, ["train.steps=6", "optim.warmup_steps=2", "train.log_every=1", "train.global_batch_size=4",
                             "train.micro_batch_size=2",
                             f"data.seq_len={SEQ}", "data.vocab_size=512", "scaling.num_workers=1", "checkpoint.enabled=false"])
    reference = in_memory_stream(plan.tokenizer_json, plan.eos_id, 24)
    in_memory = TrainingData(PackedSequences(reference, SEQ, 0), None, plan.vocab_size, "in-memory")
    losses = [[r.loss for r in train(worker_plan(cfg, data), WorkerLayout(), torch.device("cpu")).records] for data in (plan, in_memory)]
    assert losses[0] == losses[1]  # bitwise


def test_a_second_prepare_reuses_the_store(plan, tmp_path) -> None:
    cache = Path(plan.stores[0].url).parent

    def files() -> dict[str, tuple[int, int, int]]:  # every file under the cache: inode, size, modification time
        return {str(p.relative_to(cache)): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
                for p in cache.rglob("*") if p.is_file()}

    before = files()
    again = stdlib_plan(cache, documents=24, prepare_unit_bytes=100_000, validation={"fraction": 0.0})
    assert again == plan
    assert files() == before  # nothing tokenized, written or replaced again


# --- mixtures and validation --------------------------------------------------------------------


def test_apportion_is_exact() -> None:
    assert apportion(4096, [0.7, 0.3]) == [2867, 1229]
    assert sum(apportion(4096, [1, 1, 1])) == 4096


def unique(n_windows: int, offset: int) -> np.ndarray:
    return np.arange(offset, offset + SEQ * n_windows + 1, dtype=np.uint32)


def mixture(seed: int = 0) -> MixtureSamples:
    # Token values tell the sources apart: code < 1e6 <= text.
    code, text = PackedSequences(unique(300, 0), SEQ, (seed, 0)), PackedSequences(unique(500, 10**6), SEQ, (seed, 1))
    return MixtureSamples([code, text], [0.7, 0.3], seed)


def test_mixture_proportions_hold_and_are_deterministic() -> None:
    samples = [mixture().sample(i) for i in range(10_000)]
    code_share = sum(int(s[0] < 10**6) for s in samples) / len(samples)
    print(f"code share over 10,000 samples: {code_share:.4f} (weight 0.7)")
    assert abs(code_share - 0.7) < 0.02
    again = mixture()
    assert all(np.array_equal(again.sample(i), samples[i]) for i in range(0, 10_000, 7))
    other_seed = mixture(seed=1)
    assert not all(np.array_equal(other_seed.sample(i), samples[i]) for i in range(64))


def test_the_mixture_log_reports_each_sources_share_of_the_samples_trained_since_the_last_record() -> None:
    """The shares are those of the samples the batches read (told apart by their tokens), per logged
    interval; over one whole block of the mixture they are its apportioned counts exactly."""
    from meshtrain.checkpoint.state import Progress
    from meshtrain.data.sampling import MIXTURE_BLOCK
    from meshtrain.train.loop import StepDone
    from meshtrain.train.mixture_log import MixtureLog
    from meshtrain.train.records import LoopOutputs
    from meshtrain.train.step import StepOutput

    records: list[MixtureRecord] = []
    progress = Progress()
    batches = DataParallelBatches(mixture(), 16, 8, 0, 1, torch.device("cpu"))
    log = MixtureLog(mixture(), ["code", "text"], progress, LoopOutputs(records.append))
    log.at_start()
    code_read = 0
    output = StepOutput(torch.tensor(0.0), torch.tensor(0.0), 16 * SEQ)
    for step in range(1, 7):
        code_read += sum(int(row[0] < 10**6) for inputs, _ in batches.next_step() for row in inputs)
        progress.step, progress.data_position = step, batches.position
        log.after_step(StepDone(step, last=False, logged=step % 3 == 0, lr=0.0, output=output, data_wait_s=0.0))
        if step % 3 == 0:
            assert records[-1].samples == [(step - 3) * 16, step * 16]
            assert records[-1].sources == {"code": code_read / 48, "text": 1 - code_read / 48}
            code_read = 0
    assert [r.step for r in records] == [3, 6] and all(check_record(r.to_json()) == [] for r in records)

    progress.data_position = MIXTURE_BLOCK  # the rest of the first block
    log.after_step(StepDone(7, last=True, logged=True, lr=0.0, output=output, data_wait_s=0.0))
    log.at_start()
    progress.data_position = MIXTURE_BLOCK * 2
    log.after_step(StepDone(8, last=True, logged=True, lr=0.0, output=output, data_wait_s=0.0))
    assert records[-1].sources == {name: count / MIXTURE_BLOCK
                                      for name, count in zip(["code", "text"], apportion(MIXTURE_BLOCK, [0.7, 0.3]))}
    assert records[-1].target == records[-1].sources  # what a whole block gives is what the mixture aims at
    from meshtrain.observe.progress import progress_line

    assert progress_line(records[-1], 8) == ("[meshtrain] mixture of steps to 8: code 70.0% (aims at 70.0%), "
                                             "text 30.0% (aims at 30.0%)")


NAMED_SOURCES = [SourceConfig(name="code"), SourceConfig(name="text")]


def staged(seed: int = 0, block: int = MIXTURE_BLOCK) -> StagedSamples:
    """code alone for steps 1-3 of 16 samples, both sources equally for steps 4-6, text alone after."""
    code, text = PackedSequences(unique(300, 0), SEQ, (seed, 0)), PackedSequences(unique(500, 10**6), SEQ, (seed, 1))
    stages = data_stages(DataConfig(sources=NAMED_SOURCES, stages=[
        StageConfig(name="code", until_step=3, weights={"code": 1}),
        StageConfig(name="both", until_step=6, weights={"code": 1, "text": 1}),
        StageConfig(name="text", weights={"text": 2})]), 16)
    return StagedSamples([code, text], stages, seed, block)


def test_stages_switch_exactly_at_their_boundaries_and_every_source_continues_where_it_stopped() -> None:
    samples = staged(block=32)  # small blocks: many whole and partial blocks in 300 samples
    drawn = [samples.source_of(i) for i in range(300)]
    assert {source for source, _ in drawn[:48]} == {0} and {source for source, _ in drawn[96:]} == {1}
    assert {source for source, _ in drawn[48:96]} == {0, 1}
    for source in (0, 1):  # each source's own samples: every index once, in order of first use
        indices = [index for s, index in drawn if s == source]
        assert sorted(indices) == list(range(len(indices)))
    both = sum(source == 0 for source, _ in drawn[48:96])
    assert 16 < both < 32  # a whole block of 32 holds 16 of each; the partial one, 16 in its own proportions
    assert samples.counters(300, ["code", "text"]) == {
        "code": {"code": 48}, "both": {"code": both, "text": 48 - both}, "text": {"text": 204}}
    assert samples.counters(48, ["code", "text"]) == {"code": {"code": 48}}
    for start, stop in [(0, 300), (5, 47), (40, 100), (95, 97), (33, 290), (150, 150)]:
        assert samples.source_counts(start, stop) == [sum(s == k for s, _ in drawn[start:stop]) for k in (0, 1)]
    assert [samples.stage_name(i) for i in (0, 47, 48, 95, 96, 10**9)] == ["code", "code", "both", "both", "text", "text"]


def test_left_out_samples_are_never_read_count_as_drawn_and_join_up_with_later_ranges() -> None:
    """Ranges of each stage's own sequence left out: the positions read the sequence with them removed, the
    next stage's sources continue after them, the per-source counts of what was trained and of what was
    left out add up to the sequence's, and leaving out what positions [a, b) read makes position a read
    what b read before (a rollback's ranges); only a change among the samples already read is refused."""
    plain = staged(block=32)
    skips = [SkipRange("code", 5, 9), SkipRange("code", 20, 22), SkipRange("both", 0, 3)]
    samples = staged(block=32)
    samples.skip(skips)
    code_seq = [plain.mixtures[0].source_of(i) for i in range(80)]
    kept = [i for i in range(80) if not (5 <= i < 9 or 20 <= i < 22)]
    assert [samples.source_of(p) for p in range(48)] == [code_seq[i] for i in kept[:48]]
    # The second stage reads its own sequence from index 3, its code source continuing after index 53.
    offset = plain.mixtures[1].source_of
    assert [samples.source_of(48 + p)[0] for p in range(10)] == [offset(3 + p)[0] for p in range(10)]
    code_in_both = [index for source, index in (samples.source_of(48 + p) for p in range(48)) if source == 0]
    assert min(code_in_both) >= 54 and len(set(code_in_both)) == len(code_in_both)  # the code stage reached 54
    trained = samples.source_counts(0, 96)
    left_out = [sum(n) for n in zip(*(samples.skipped_counts(skip) for skip in skips))]
    sequences = [54 + plain.mixtures[1].source_counts(0, 51)[0], plain.mixtures[1].source_counts(0, 51)[1]]
    assert [t + o for t, o in zip(trained, left_out)] == sequences and sum(trained) == 96
    assert samples.counters(96, ["code", "text"])["code"] == {"code": 48}

    before = [samples.locate(p).read().tolist() for p in (14, 40)]
    rollback = samples.skip_ranges(15, 40)  # what positions 15-39 read: indices 19-45, less 20-21 (left out)
    assert rollback == [SkipRange("code", 19, 46)]
    samples.skip(merged_skips([*skips, *rollback]))
    assert samples.skips == (SkipRange("both", 0, 3), SkipRange("code", 5, 9), SkipRange("code", 19, 46))
    assert samples.locate(14).read().tolist() == before[0] and samples.locate(15).read().tolist() == before[1]

    stages = [(stage.name, stage.first_sample) for stage in samples.stages]
    trained_with = {"left_out": [skip.to_json() for skip in skips], "data_position": 15}
    assert changed_before(skips, samples.skips, stages, 15) is None  # the new range lies past what 15 read
    assert changed_before(skips, samples.skips, stages, 30) == SkipRange("code", 19, 36)  # but not past 30's reach
    assert changed_before(skips, skips[1:], stages, 15) == SkipRange("code", 5, 9)
    assert changed_before(skips, [*skips, SkipRange("both", 40, 50)], stages, 15) is None
    with pytest.raises(ConfigError, match=r"samples \[5, 9\) of stage 'code'"):
        check_left_out(trained_with, skips[1:], stages, 2)


def test_stage_ends_in_tokens_resolve_to_the_step_that_reaches_them_at_each_stages_own_length() -> None:
    """16 sequences a step: 2,000 tokens of 32-token sequences end after step 4 (2,048 tokens); 6,144 tokens
    in all, the second stage's sequences 64 tokens long, end after step 8."""
    data = DataConfig(seq_len=32, sources=NAMED_SOURCES, stages=[
        StageConfig(name="code", until_tokens=2000, weights={"code": 1}),
        StageConfig(name="both", until_tokens=6144, seq_len=64, weights={"code": 1, "text": 1}),
        StageConfig(name="text", weights={"text": 1})])
    assert data.stage_ends(16) == [4, 8, None]
    assert [(stage.first_sample, stage.seq_len) for stage in data_stages(data, 16)] == [(0, None), (64, 64), (128, None)]


def test_one_stage_of_the_sources_own_weights_is_the_plain_mixture() -> None:
    code, text = mixture().components
    one = StagedSamples([code, text], data_stages(DataConfig(
        sources=NAMED_SOURCES, stages=[StageConfig(name="all", weights={"code": 0.7, "text": 0.3})]), 16), 0)
    assert all(np.array_equal(one.sample(i), mixture().sample(i)) for i in range(0, 9000, 13))


@pytest.mark.parametrize("samples", [mixture, staged])
def test_mixture_resumes_exactly_on_another_world_size(samples: Callable[[], Samples]) -> None:
    """Resumed at step 3 on half the ranks: for the stages, the first step of the second stage."""
    def rows(world: int, start: int, steps: int) -> list[list[tuple]]:
        out: list[list[tuple]] = []
        for rank in range(world):
            batches = DataParallelBatches(samples(), 16, 16 // world // 2, rank, world, torch.device("cpu"), position=start)
            for step in range(steps):
                got = [tuple(r.tolist()) for inputs, _ in batches.next_step() for r in inputs]
                if rank == 0:
                    out.append(got)
                else:
                    out[step] += got
        return [sorted(step) for step in out]

    straight = rows(4, 0, 6)
    assert rows(2, 3 * 16, 3) == straight[3:]  # resumed at step 3 on half the ranks


def test_a_separate_validation_source(tmp_path) -> None:
    docs = tmp_path / "held_out"
    docs.mkdir()
    for i in range(3):
        (docs / f"v{i}.txt").write_text(stdlib_source_files()[-1 - i].read_text())
    plan = stdlib_plan(tmp_path / "c", documents=8, validation={"source": str(docs)})
    data = open_data(plan, SEQ, 0)
    assert plan.validation is not None and data.validation is not None
    assert len(data.validation) == (plan.validation.tokens - 1) // SEQ
    chosen = data.validation.select(10**9)  # a separate source: every window, every target scored
    assert len(chosen) == len(data.validation) and all((w.lo, w.hi) == (0, SEQ) for w in chosen)


# --- preparing on Ray ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """16 jsonl files of standard-library sources: one prepare unit each."""
    folder = tmp_path_factory.mktemp("jsonl_corpus")
    files = stdlib_source_files()
    for i in range(16):
        with (folder / f"part{i:03d}.jsonl").open("w") as out:
            for path in files[3 * i : 3 * i + 3]:
                out.write(json.dumps({"text": path.read_text()}) + "\n")
    return folder


def prepare_job(corpus: Path, output: Path, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "jobs/prepare_data.py", "--output", str(output), f"data.source={corpus}",
               "data.prepare_unit_bytes=1", "data.vocab_size=512", "metrics.progress_interval_s=0", *extra]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def shard_bytes(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.glob("shard-*.bin"))}


def test_prepare_on_ray_with_one_or_two_cpus_and_after_a_kill_writes_the_same_shards(corpus_dir, tmp_path) -> None:
    """Two CPUs in one go; one CPU killed midway (the whole process group: driver and its local Ray),
    then two CPUs again: the same shards, byte for byte."""
    job = prepare_job(corpus_dir, tmp_path / "cpus2", "--max-parallel=2")
    output, _ = job.communicate(timeout=300)
    assert job.returncode == 0, output
    [unbroken] = [p for p in (tmp_path / "cpus2").iterdir() if p.name != "tokenizers"]
    assert "16/16 shards" in output and "tok/s" in output
    assert len(shard_bytes(unbroken)) == 16
    fingerprint = json.loads((unbroken / "manifest.json").read_text())["fingerprint"]

    killed = tmp_path / "killed"
    job = prepare_job(corpus_dir, killed, "--max-parallel=1")
    deadline = time.monotonic() + 120
    while len(list(killed.glob("*/shard-*.json"))) < 3:
        assert job.poll() is None and time.monotonic() < deadline, "prepare ended before it could be killed"
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGKILL)
    job.communicate(timeout=60)
    [store] = [p for p in killed.iterdir() if p.name != "tokenizers"]
    assert not (store / "manifest.json").exists()
    with pytest.raises(ConfigError, match="prepare was interrupted; run jobs/prepare_data.py again"):
        TokenStore(str(store))
    done_before = len(list(store.glob("shard-*.json")))
    rerun = prepare_job(corpus_dir, killed, "--max-parallel=2")
    output, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, output
    reused = int(output.split(" re-used")[0].rsplit("(", 1)[1])
    assert reused >= min(done_before, 3) - 1  # a shard being written at the kill is redone
    # The shards written on one CPU before the kill and on two after it are the two-CPU run's.
    assert shard_bytes(store) == shard_bytes(unbroken)
    assert json.loads((store / "manifest.json").read_text())["fingerprint"] == fingerprint
    verify_store(str(store))


# --- bad input ----------------------------------------------------------------------------------


@pytest.fixture
def store_copy(plan, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(plan.stores[0].url, tmp_path / "store"))


def test_truncated_shard_is_named(store_copy: Path) -> None:
    shard = store_copy / "shard-000001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"shard .*shard-000001.bin holds \d+ bytes, its manifest says"):
        TokenStore(str(store_copy))


def test_replaced_shard_fails_its_checksum(store_copy: Path) -> None:
    shard = store_copy / "shard-000000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    TokenStore(str(store_copy))  # same size: opening only checks sizes
    with pytest.raises(ConfigError, match="shard-000000.bin does not match its manifest checksum"):
        verify_store(str(store_copy))


def test_store_of_another_format_version(store_copy: Path) -> None:
    manifest = json.loads((store_copy / "manifest.json").read_text())
    (store_copy / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(ConfigError, match="written in token store format 99, this meshtrain reads format 1"):
        TokenStore(str(store_copy))


def test_a_store_is_used_directly_as_data_source(plan, store_copy: Path, tmp_path) -> None:
    cfg = load_config(None, [f"data.source={store_copy}"])
    direct = prepare_data(cfg.data, str(tmp_path / "unused"), SEQ, use_ray=False, log=print)
    assert direct.stores[0].fingerprint == plan.stores[0].fingerprint
    assert not (tmp_path / "unused").exists() or not any((tmp_path / "unused").glob("*/manifest.json"))


def test_an_occupied_output_is_never_overwritten(plan, tmp_path, corpus_dir) -> None:
    from meshtrain.config import SourceConfig
    from meshtrain.data.prepare import prepare_store
    from meshtrain.data.sources import plan_source

    url = plan.stores[0].url
    before = {p.name: p.stat().st_mtime_ns for p in Path(url).iterdir()}
    other = plan_source(SourceConfig(source=str(corpus_dir)), 1 << 20)
    with pytest.raises(ConfigError, match="already holds a store of another source"):
        prepare_store(other, plan.tokenizer_json, url, use_ray=False)
    assert {p.name: p.stat().st_mtime_ns for p in Path(url).iterdir()} == before


NAMED = "[{source: stdlib, name: a}, {source: stdlib, name: b, max_documents: 9}]"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.sources=[{source: stdlib, weight: 0}]"], "data.sources.0.weight: .*positive finite number"),
        (["data.sources=[{source: stdlib, weight: -1}]"], "data.sources.0.weight"),
        (["data.sources=[]"], "data.sources: an empty list"),
        (["data.source=hf:wikitext", "data.sources=[{source: stdlib}]"], "set either data.source or data.sources"),
        (["data.validation.fraction=0.6"], "data.validation.fraction"),
        (["data.stages=[{name: a, weights: {x: 1}}]"], "data.stages: stages weigh data.sources by name"),
        ([f"data.sources={NAMED}", "data.stages=[{name: a, until_step: 9, weights: {a: 1}}, "
          "{name: a, weights: {b: 1}}]"], "data.stages: stage names repeat"),
        ([f"data.sources={NAMED}", "data.stages=[{name: s, weights: {a: 1, c: 1}}]"],
         "data.stages: stage 's' weighs 'c', not among data.sources' names"),
        ([f"data.sources={NAMED}", "data.stages=[{name: s, weights: {a: 1}}, {name: t, weights: {b: 1}}]"],
         "data.stages: stage 's' has no until_step; only the last stage runs to the end"),
        ([f"data.sources={NAMED}", "data.stages=[{name: s, until_step: 9, weights: {a: 1}}, "
          "{name: t, until_step: 9, weights: {b: 1}}]"], r"data.stages: until_step must increase from stage to stage \(got 9, 9\)"),
        ([f"data.sources={NAMED}", "data.stages=[{name: s, weights: {a: 0}}]"], "give at least one source a positive"),
        ([f"data.sources={NAMED}", "data.stages=[{name: s, until_step: 4, until_tokens: 9, weights: {a: 1}}, "
          "{name: t, weights: {b: 1}}]"], "data.stages: stage 's' gives until_step and until_tokens; give one"),
        ([f"data.sources={NAMED}", "data.stages=[{name: s, until_step: 4, weights: {a: 1}}, "
          "{name: t, until_tokens: 1000, weights: {b: 1}}, {name: u, weights: {a: 1}}]"],
         r"data.stages: stage 't' ends with until_tokens=1,000 \(the stages before it trained 8,192 tokens by step 4\)"),
        ([f"data.sources={NAMED}", "train.steps=20", "data.stages=[{name: s, until_step: 10, weights: {a: 1}}]"],
         "the last stage, 's', ends at step 10, before train.steps=20; unset its until_step"),
    ],
)
def test_bad_mixture_and_validation_settings(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_bad_source_files(tmp_path) -> None:
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "mixed" / "b.txt").write_text("y")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_text("")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "a.parquet").write_bytes(b"not parquet at all")
    for folder, message in (("mixed", "mixes formats"), ("empty", "a.jsonl is empty"), ("broken", "cannot read .*a.parquet")):
        with pytest.raises(ConfigError, match=f"data.source: .*{message}") as info:
            prepare_data(DataConfig(source=str(tmp_path / folder)), str(tmp_path / "c"), SEQ, use_ray=False, log=print)
        assert "\n" not in str(info.value)


def test_a_store_read_with_another_tokenizer_is_refused(plan, tmp_path) -> None:
    from meshtrain.data.tokenizer import train_tokenizer

    other = tmp_path / "other-tokenizer.json"
    other.write_text(train_tokenizer(iter(["a different sample of text"] * 50), 300).to_str())
    store = plan.stores[0].url
    with pytest.raises(ConfigError, match=r"data.tokenizer: .*other-tokenizer.json' is not the tokenizer the token store was encoded with; prepare the store again with it .*model.init_from is unset, leave data.tokenizer=train") as info:
        prepare_data(DataConfig(source=store, tokenizer=str(other)), str(tmp_path / "c"), SEQ, use_ray=False, log=print)
    assert "\n" not in str(info.value)


def test_resume_on_other_data_is_refused(plan, tmp_path) -> None:
    from meshtrain.cluster.resume import data_for_resume

    cfg = load_config(None, [f"run.storage_path={tmp_path}", "run.name=r"])
    step = tmp_path / "r" / "checkpoints" / "step-00000010"
    step.mkdir(parents=True)
    (step / "COMMITTED").write_text(json.dumps({"step": 10, "data_fingerprint": "0" * 64, "files": {}}))
    with pytest.raises(ConfigError, match=f"trained on data 0000000000000000, this launch reads {plan.fingerprint[:16]}.*allow_fingerprint_change"):
        data_for_resume(cfg.checkpoint, cfg.run, plan, allow_fingerprint_change=False)
    data_for_resume(cfg.checkpoint, cfg.run, plan, allow_fingerprint_change=True)
    (step / "COMMITTED").write_text(json.dumps({"step": 10, "data_fingerprint": plan.fingerprint, "files": {}}))
    data_for_resume(cfg.checkpoint, cfg.run, plan, allow_fingerprint_change=False)


def test_hub_source_without_network_fails_fast_in_one_line(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        prepare_data(DataConfig(source="hf:meshtrain-tests/no-such-dataset"), str(tmp_path), SEQ, use_ray=False, log=print)
    assert str(info.value).startswith("data.source: ") and "\n" not in str(info.value)


# --- remote stores ------------------------------------------------------------------------------


def test_a_store_on_s3_is_prepared_cached_locally_and_checked(plan, tmp_path, monkeypatch) -> None:
    import s3fs

    monkeypatch.setenv("MESHTRAIN_TOKEN_CACHE", str(tmp_path / "local_cache"))
    with moto_s3(monkeypatch, "data") as options:
        data = DataConfig(max_documents=24, vocab_size=512, seq_len=SEQ, prepare_unit_bytes=100_000,
                          storage_options=options, validation={"fraction": 0.0})
        remote = prepare_data(data, "s3://data/token_stores", SEQ, run_tokenizer=plan.tokenizer_json, use_ray=False, log=print)
        assert remote.stores[0].url.startswith("s3://data/token_stores/")
        assert remote.fingerprint == plan.fingerprint  # the same tokens wherever they are stored
        local = TokenStore(plan.stores[0].url)
        store = TokenStore(remote.stores[0].url, options)
        assert np.array_equal(store.read(0, len(store)), local.read(0, len(local)))
        # The node cache holds what was read, each range rounded to whole check blocks, never more.
        from meshtrain.data.remote import CHECK_BYTES

        cached = [p for p in (tmp_path / "local_cache").rglob("*") if p.is_file() and p.name != "index.npy"]
        read_bytes = len(store) * store.dtype.itemsize
        assert cached and read_bytes <= sum(p.stat().st_size for p in cached) <= read_bytes + len(cached) * CHECK_BYTES

        fs = s3fs.S3FileSystem(**options)
        shard = f"{remote.stores[0].url}/shard-000001.bin"
        fs.pipe(shard, b"\0\0" * store.manifest.shards[1].tokens)  # same size, other bytes
        monkeypatch.setenv("MESHTRAIN_TOKEN_CACHE", str(tmp_path / "fresh_cache"))
        fresh = TokenStore(remote.stores[0].url, options)
        with pytest.raises(CorruptTokens, match=r"^data.source: shard s3://.*shard-000001.bin is corrupt at byte offset \d+: "
                           r"its 1024-byte block \d+ \(bytes \d+-\d+\) does not match the checksum in shard-000001.crc32"):
            fresh.read(0, len(fresh))


def test_a_rerun_may_move_the_cache_or_allow_other_data_but_not_change_the_source(tmp_path) -> None:
    from meshtrain.cluster.launcher import resolve_run
    from meshtrain.cluster.resume import write_run_config

    def rerun(*overrides: str) -> None:
        write_run_config(*resolve_run(load_config(None, [f"run.storage_path={tmp_path}", "run.name=r", *overrides])))

    (tmp_path / "text.txt").write_text("other data")
    rerun()
    rerun(f"data.cache_dir={tmp_path / 'elsewhere'}", "data.allow_fingerprint_change=true")
    committed = tmp_path / "r" / "checkpoints" / "step-00000010"  # a run with a checkpoint to resume
    committed.mkdir(parents=True)
    (committed / "COMMITTED").write_text("{}")
    with pytest.raises(ConfigError, match="data.source: run r was started with 'stdlib'"):
        rerun(f"data.source={tmp_path / 'text.txt'}")


# --- prepare tasks that die ------------------------------------------------------------------------


class _Ref:
    """A task's result (or the error it ended with), hashable by identity as Ray's object refs are; ``run``
    (a task) runs when the result is first asked for, as a task runs while the driver waits."""

    def __init__(self, value=None, run=None) -> None:
        self._value, self._run = value, run

    @property
    def value(self):
        if self._run is not None:
            run, self._run = self._run, None
            try:
                self._value = run()
            except Exception as exc:  # noqa: BLE001 - what ray.get raises
                self._value = exc
        return self._value


class _Handle:
    """An actor's handle in this process: ``handle.method.remote(*args)`` runs the method at once."""

    def __init__(self, instance) -> None:
        self.instance = instance

    def __getattr__(self, name):
        method = getattr(self.instance, name)
        return type("Method", (), {"remote": staticmethod(lambda *args: _Ref(method(*args)))})()


class _StandInRay:
    """Enough of Ray for prepare's task loop, run in this process: the first ``kills[unit]`` tries of a
    unit end as a task the memory monitor killed (Ray's OutOfMemoryError) instead of running; the first
    ``slow_waits`` waits with a timeout (not a poll, timeout=0) time out with nothing done (as while long
    tasks run)."""

    def __init__(self, kills: dict[int, int], slow_waits: int = 0) -> None:
        import importlib

        self.exceptions = importlib.import_module("ray.exceptions")  # the exception classes only: nothing starts
        self.kills, self.options, self.tries, self.cancelled = dict(kills), {}, {}, []
        self.slow_waits, self.actors = slow_waits, {}

    def remote(self, function):
        stand_in = self
        if isinstance(function, type):  # an actor (prepare's progress board): its methods run at once

            class Actor:
                def options(self, name=None, **options):
                    self.name = name
                    return self

                def remote(self, *args):
                    stand_in.actors[self.name] = _Handle(function(*args))
                    return stand_in.actors[self.name]

            return Actor()

        class Task:
            def options(self, **options):
                stand_in.options = options
                return self

            def remote(self, *args):
                index = args[1].index
                stand_in.tries[index] = stand_in.tries.get(index, 0) + 1
                if stand_in.kills.get(index, 0) > 0:
                    stand_in.kills[index] -= 1
                    return _Ref(stand_in.exceptions.OutOfMemoryError(
                        "Task was killed due to the node running low on memory.\nMemory on the node was 31.9GB / 32GB"))
                return _Ref(run=lambda: function(*args))

        return Task()

    def get_actor(self, name):
        if name not in self.actors:
            raise ValueError(f"Failed to look up actor with name '{name}'.")
        return self.actors[name]

    def put(self, value):
        return value

    def wait(self, refs, num_returns, timeout=None):
        if self.slow_waits and timeout:
            self.slow_waits -= 1
            refs[0].value  # it runs, and is not done yet
            return [], refs
        return refs[:num_returns], refs[num_returns:]

    def kill(self, actor):
        pass

    def get(self, ref, timeout=None):
        if isinstance(ref.value, BaseException):
            raise ref.value
        return ref.value

    def cancel(self, ref):
        self.cancelled.append(ref)


def test_a_prepare_task_killed_for_memory_is_tried_three_times_then_named_in_one_line(tmp_path, monkeypatch) -> None:
    """Ray would retry a task its memory monitor kills without end, so prepare turns Ray's retries off
    (max_retries=0, no retry of a task's own errors) and tries a unit whose task died TASK_TRIES times
    in all: a unit killed twice still gives the same store; one killed every time ends the prepare with
    one line naming its shard and what to lower, and the shards already written are kept."""
    from meshtrain.config import SourceConfig
    from meshtrain.data import sources
    from meshtrain.data.prepare import TASK_TRIES, prepare_store
    from meshtrain.data.sources import plan_source
    from meshtrain.data.tokenizer import train_tokenizer

    documents = [f"document {i}: " + "the quick brown fox " * (5 + i % 7) for i in range(60)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    monkeypatch.setattr(sources, "MIN_UNIT_BYTES", 1000)
    plan = plan_source(SourceConfig(source=str(corpus)), 2000)
    assert len(plan.units) >= 4
    tokenizer_json = train_tokenizer(iter(documents), 300).to_str()
    unbroken = prepare_store(plan, tokenizer_json, str(tmp_path / "in_process"), use_ray=False, progress_interval_s=1e9)

    ray = _StandInRay({1: TASK_TRIES - 1})
    monkeypatch.setitem(sys.modules, "ray", ray)
    survived = prepare_store(plan, tokenizer_json, str(tmp_path / "survived"), max_parallel=2, progress_interval_s=1e9)
    assert ray.options["max_retries"] == 0 and ray.options["retry_exceptions"] is False
    assert ray.tries == {unit.index: TASK_TRIES if unit.index == 1 else 1 for unit in plan.units}
    assert survived.manifest.fingerprint == unbroken.manifest.fingerprint

    ray = _StandInRay({2: TASK_TRIES + 5})
    monkeypatch.setitem(sys.modules, "ray", ray)
    killed = tmp_path / "killed"
    with pytest.raises(ConfigError, match=(
        r"^data.source: the task preparing shard-000002.bin \(\S+corpus.jsonl bytes \d+-\d+\) was killed for lack of "
        r"memory 3 times \(OutOfMemoryError: Task was killed due to the node running low on memory.\); lower "
        r"data.prepare_unit_bytes \(this unit holds 0.0 MiB of source\), run fewer tasks at once "
        r"\(jobs/prepare_data.py --max-parallel\) or give the nodes more memory; the shards written are kept$")):
        prepare_store(plan, tokenizer_json, str(killed), max_parallel=2, progress_interval_s=1e9)
    assert ray.tries[2] == TASK_TRIES and not (killed / "manifest.json").exists()
    assert (killed / "shard-000000.json").exists() and (killed / "shard-000001.json").exists()


def test_the_progress_line_moves_inside_a_unit_in_process_and_on_ray(tmp_path, monkeypatch, capsys) -> None:
    """A unit of one long document: while its task encodes, the progress line shows the source bytes read
    and the tokens encoded so far, reported by the task every REPORT_INTERVAL_S (0 here), in process and
    through the Ray path's progress board (a stand-in Ray whose first waits time out; the board starts at
    once with progress_interval_s=0, and the task finds it by name), not only when the shard is done."""
    import re

    import meshtrain.data.sources as sources
    from meshtrain.config import SourceConfig
    from meshtrain.data import prepare as prepare_module
    from meshtrain.data.sources import plan_source
    from meshtrain.data.tokenizer import train_tokenizer

    monkeypatch.setattr(prepare_module, "REPORT_INTERVAL_S", 0.0)
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 2000)
    monkeypatch.setattr(sources, "LONG_LINE_BYTES", 4096)
    monkeypatch.setattr(sources, "LONG_STRING_BYTES", 100)
    monkeypatch.setattr(sources, "READ_BYTES", 1000)
    document = "".join(f"the quick brown fox {i} " for i in range(2000))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": document}) + "\n")
    plan = plan_source(SourceConfig(source=str(corpus)), 1 << 20)
    tokenizer_json = train_tokenizer(iter([document]), 300).to_str()
    size = f"{corpus.stat().st_size / 1e3:.1f} kB"
    pattern = re.compile(r"^\[meshtrain\] prepare: (\d)/1 shards, ([\d.]+) kB of " + size + r" read, ([\d,]+) tokens, [\d,]+ tok/s$")

    def progress_lines() -> list[tuple[int, float, int]]:
        lines = [line for line in capsys.readouterr().out.splitlines() if "prepare:" in line]
        matches = [pattern.match(line) for line in lines]
        assert all(matches), lines
        return [(int(m[1]), float(m[2]), int(m[3].replace(",", ""))) for m in matches if m]

    store = prepare_module.prepare_store(plan, tokenizer_json, str(tmp_path / "in_process"), use_ray=False,
                                         progress_interval_s=0)
    lines = progress_lines()
    inside = [(read, tokens) for done, read, tokens in lines if done == 0]
    assert len(inside) >= 5 and inside == sorted(inside) and 0 < inside[0][1] < store.manifest.tokens
    assert 0 < inside[0][0] < inside[-1][0] <= corpus.stat().st_size / 1e3
    assert lines[-1][0] == 1 and f"{lines[-1][1]:.1f} kB" == size and lines[-1][2] == store.manifest.tokens

    ray = _StandInRay({}, slow_waits=3)
    monkeypatch.setitem(sys.modules, "ray", ray)
    on_ray = prepare_module.prepare_store(plan, tokenizer_json, str(tmp_path / "on_ray"), progress_interval_s=0)
    assert on_ray.manifest.fingerprint == store.manifest.fingerprint and len(ray.actors) == 1
    lines = progress_lines()
    assert [done for done, _, _ in lines] == [0, 0, 1], lines
    assert lines[0] == lines[1] and lines[0][1] > 0 and lines[0][2] > 0  # the task's last report, twice
    assert lines[2] == (1, lines[0][1], store.manifest.tokens)

