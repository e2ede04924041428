"""Data at pretraining scale: a permutation computed per index (memory that does not grow with the
corpus), a validation split decided per window, positional reads through a bounded set of open files,
resumed runs that keep the sampling scheme their checkpoints were trained with, and a resumed prepare
that trusts finished records instead of reading every shard again."""

from __future__ import annotations

import hashlib
import json
import os
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from meshtrain.cluster.resume import data_for_resume
from meshtrain.config import ConfigError
from meshtrain.config.loading import load_config
from meshtrain.data import LEGACY_SAMPLING, SAMPLING_SCHEME, DataParallelBatches, DataPlan, TokenStore
from meshtrain.data.permutation import FeistelPermutation
from meshtrain.data.sampling import PackedSequences
from meshtrain.data.splits import FeistelSplit, LegacySplit, held_out_count
from meshtrain.data.open_files import OPEN_SHARDS
from meshtrain.data.store_format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    Manifest,
    ShardRecord,
    shard_name,
    store_fingerprint,
)
from meshtrain.train.trainer import Trainer, check_sampling
from trainers import cpu_trainer

SEQ = 16


@pytest.mark.parametrize("n", [*range(1, 70), 255, 256, 257, 1000, 4095, 4097, 65537])
def test_feistel_is_a_bijection_with_an_inverse(n: int) -> None:
    permutation = FeistelPermutation(n, (7, 3))
    image = [permutation(i) for i in range(n)]
    assert sorted(image) == list(range(n))
    assert [permutation.inverse(value) for value in image] == list(range(n))


def test_feistel_depends_on_its_key_only() -> None:
    a, b, c = FeistelPermutation(5000, (1, 0)), FeistelPermutation(5000, (1, 0)), FeistelPermutation(5000, (1, 1))
    order = [a(i) for i in range(5000)]
    assert order == [b(i) for i in range(5000)]
    assert order != [c(i) for i in range(5000)]
    assert sum(order[i] == i for i in range(5000)) < 20  # a shuffle, not the identity
    with pytest.raises(IndexError):
        a(5000)


class _HugeStream:
    """A token stream of ``tokens`` tokens that holds none (reads are zeros)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.zeros(stop - start, dtype=np.uint16)


@pytest.mark.parametrize("tokens", [10**6, 10**12])
def test_order_and_split_take_no_memory_per_window(tokens: int) -> None:
    """A 1T-token stream (62.5 billion windows) costs what a 1M-token one does: nothing per window."""
    windows = (tokens - 1) // SEQ
    tracemalloc.start()
    split = FeistelSplit(windows, 0.01)
    samples = PackedSequences(_HugeStream(tokens), SEQ, seed=0, split=split)
    batches = DataParallelBatches(samples, 64, 8, dp_rank=1, dp_size=2, device=torch.device("cpu"))
    for _ in range(3):
        list(batches.next_step())
    assert split.is_held_out(split.held_out(0)) and not split.is_held_out(samples.window_of(0))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 256 * 1024, f"{peak} bytes for {windows:,} windows"


def test_held_out_windows_never_train_and_every_window_is_one_or_the_other() -> None:
    windows = 997
    split = FeistelSplit(windows, 0.05)
    assert split.held_out_windows == held_out_count(windows, 0.05) == 50
    held = {split.held_out(k) for k in range(split.held_out_windows)}
    samples = PackedSequences(np.arange(windows * SEQ + 1, dtype=np.uint32), SEQ, seed=3, split=split)
    trained = {samples.window_of(i) for i in range(3 * samples.windows)}  # three epochs
    assert held.isdisjoint(trained) and len(held | trained) == windows
    assert all(split.is_held_out(w) == (w in held) for w in range(windows))


def test_each_epoch_visits_every_training_window_once_in_a_new_order() -> None:
    samples = PackedSequences(np.arange(500 * SEQ + 1, dtype=np.uint32), SEQ, seed=1, split=FeistelSplit(500, 0.02))
    epochs = [[samples.window_of(e * samples.windows + i) for i in range(samples.windows)] for e in range(2)]
    assert len(set(epochs[0])) == samples.windows == 490 and set(epochs[0]) == set(epochs[1])
    assert epochs[0] != epochs[1]


def test_the_legacy_scheme_keeps_the_order_runs_were_trained_with() -> None:
    """permutation-v0 is the order of runs whose checkpoints predate the record: a materialized
    permutation per epoch over the training windows (a seeded choice of held-out ids removed)."""
    windows, seed = 300, 5
    split = LegacySplit(windows, 0.1)
    held = np.sort(np.random.default_rng([0x5EED, windows]).choice(windows, size=30, replace=False))
    training = np.setdiff1d(np.arange(windows), held)
    order = np.random.default_rng([seed, 1]).permutation(len(training))  # epoch 1
    samples = PackedSequences(np.arange(windows * SEQ + 1), SEQ, seed, split=split, scheme=LEGACY_SAMPLING)
    assert [samples.window_of(len(training) + i) for i in range(len(training))] == [int(training[k]) for k in order]
    assert [split.held_out(k) for k in range(30)] == held.tolist()


def _write_store(root: Path, shards: int, rng: np.random.Generator) -> np.ndarray:
    """A complete uint16 store of ``shards`` small shards, written directly; returns its stream."""
    root.mkdir(parents=True)
    records, pieces = [], []
    for index in range(shards):
        tokens = rng.integers(0, 500, size=int(rng.integers(40, 90)), dtype=np.uint16)
        (root / shard_name(index)).write_bytes(tokens.tobytes())
        records.append(ShardRecord(file=shard_name(index), unit=str(index), tokens=len(tokens), documents=1,
                                   sha256=hashlib.sha256(tokens.tobytes()).hexdigest(), source_bytes=len(tokens)))
        pieces.append(tokens)
    manifest = Manifest(
        format=FORMAT, version=FORMAT_VERSION, complete=True, dtype="uint16", vocab_size=500, eos_id=0,
        tokenizer_sha256="0" * 64, source={}, source_fingerprint="synthetic", documents=shards,
        tokens=sum(len(p) for p in pieces), shards=tuple(records),
        fingerprint=store_fingerprint("uint16", "0" * 64, records),
    )
    (root / MANIFEST).write_text(manifest.model_dump_json())
    return np.concatenate(pieces)


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mappings() -> int:
    return len(Path("/proc/self/maps").read_text().splitlines())


def test_positional_reads_equal_the_stream_with_bounded_descriptors_and_no_maps(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    stream = _write_store(tmp_path / "store", shards=400, rng=rng)
    store = TokenStore(str(tmp_path / "store"))
    fds, maps = _descriptors(), _mappings()
    picker = random.Random(1)
    for _ in range(3000):  # random windows over every shard, some across shard boundaries
        start = picker.randrange(0, len(stream) - 200)
        stop = start + picker.randrange(1, 200)
        assert np.array_equal(store.read(start, stop), stream[start:stop])
    assert _descriptors() - fds <= OPEN_SHARDS
    assert _mappings() - maps <= 2  # the allocator may map an arena; never one map per shard
    store.close()
    assert _descriptors() <= fds


def test_a_resumed_run_keeps_the_scheme_its_checkpoints_were_trained_with(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.storage_path={tmp_path}", "run.name=r"])
    plan = DataPlan(stores=(), tokenizer_json="{}", vocab_size=10, eos_id=0)

    def resumed() -> DataPlan:
        return data_for_resume(cfg.checkpoint, cfg.run, plan, allow_fingerprint_change=False)

    assert resumed().sampling == SAMPLING_SCHEME  # no checkpoint: the current scheme
    step = tmp_path / "r" / "checkpoints" / "step-00000010"
    step.mkdir(parents=True)
    marker = {"step": 10, "data_fingerprint": plan.fingerprint, "files": {}}
    (step / "COMMITTED").write_text(json.dumps(marker))  # written before checkpoints recorded a scheme
    assert resumed().sampling == LEGACY_SAMPLING
    (step / "COMMITTED").write_text(json.dumps({**marker, "sampling": SAMPLING_SCHEME}))
    assert resumed().sampling == SAMPLING_SCHEME
    (step / "COMMITTED").write_text(json.dumps({**marker, "sampling": "zigzag-v9"}))
    with pytest.raises(ConfigError, match=r"^data: the checkpoints of run r were trained with sampling scheme 'zigzag-v9'"):
        resumed()
    with pytest.raises(ConfigError) as info:
        check_sampling({"step": 10}, SAMPLING_SCHEME, 10)
    assert f"'permutation-v0', this worker reads with '{SAMPLING_SCHEME}'" in str(info.value) and "\n" not in str(info.value)


def _train(cfg_overrides: list[str], plan: DataPlan) -> Trainer:
    cfg = load_config(None, [
        "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=64",
        "data.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=4", "optim.warmup_steps=1",
        "train.log_every=1", "checkpoint.interval=2", "checkpoint.mode=sync", "eval.interval=null",
        "metrics.port=0", "run.hang_timeout_s=null", "train.gc_every=0", "scaling.num_workers=1", *cfg_overrides,
    ])
    trainer = cpu_trainer(cfg, plan)
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer


def test_legacy_checkpoints_resume_exactly_and_refuse_another_scheme(tmp_path: Path) -> None:
    from corpora import stdlib_plan

    legacy = DataPlan(**{**stdlib_plan(tmp_path / "cache", documents=8).__dict__, "sampling": LEGACY_SAMPLING})
    run = [f"run.storage_path={tmp_path}", "optim.schedule_steps=4"]
    unbroken = _train([*run, "run.name=unbroken", "train.steps=4"], legacy)
    _train([*run, "run.name=resumed", "train.steps=2"], legacy)
    marker = tmp_path / "resumed" / "checkpoints" / "step-00000002" / "COMMITTED"
    manifest = json.loads(marker.read_text())
    assert manifest["sampling"] == LEGACY_SAMPLING
    del manifest["sampling"]  # as a checkpoint written before the record (and before markers carried their own checksum)
    manifest.pop("marker_sha256", None)
    marker.write_text(json.dumps(manifest))
    resumed = _train([*run, "run.name=resumed", "train.steps=4"], legacy)
    assert [r.loss for r in resumed.result.records] == [r.loss for r in unbroken.result.records[2:]]
    current = DataPlan(**{**legacy.__dict__, "sampling": SAMPLING_SCHEME})
    with pytest.raises(ConfigError, match=f"trained with sampling scheme 'permutation-v0', this worker reads with '{SAMPLING_SCHEME}'"):
        _train([*run, "run.name=resumed", "train.steps=6"], current)


def test_a_resumed_prepare_trusts_finished_records_and_reads_no_shard(tmp_path: Path, monkeypatch) -> None:
    import fsspec.implementations.local

    import meshtrain.data.sources as sources
    from meshtrain.config import DataConfig
    from meshtrain.data import prepare_data
    from meshtrain.data.location import StoreLocation

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(30):
        (corpus / f"doc{index:02d}.txt").write_text(f"document {index}: " + "some words to encode " * 40)
    monkeypatch.setattr(sources, "MIN_UNIT_BYTES", 1024)
    data = DataConfig(source=str(corpus), vocab_size=300, seq_len=8, prepare_unit_bytes=2048)
    first = prepare_data(data, str(tmp_path / "cache"), 8, use_ray=False, log=lambda _: None)
    store = Path(first.stores[0].url)
    shards = sorted(store.glob("shard-*.bin"))
    assert len(shards) >= 10
    # An interrupted prepare: no manifest, one unit without its record, one shard cut short.
    (store / "manifest.json").unlink()
    (store / "shard-000003.json").unlink()
    shards[5].write_bytes(shards[5].read_bytes()[:-2])

    opened: list[str] = []
    original_open = fsspec.implementations.local.LocalFileSystem._open

    def recording_open(self, path, mode="rb", *args, **kwargs):
        opened.append(f"{mode} {path}")
        return original_open(self, path, mode, *args, **kwargs)

    monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "_open", recording_open)
    monkeypatch.setattr(StoreLocation, "sha256", lambda self, name: pytest.fail(f"re-hashed {name}"))
    lines: list[str] = []
    again = prepare_data(data, str(tmp_path / "cache"), 8, use_ray=False, log=lines.append)
    assert again.stores[0].fingerprint == first.stores[0].fingerprint
    assert f"({len(shards) - 2} re-used)" in lines[0], lines
    shard_reads = [entry for entry in opened if entry.startswith("r") and entry.endswith(".bin")]
    assert shard_reads == [], shard_reads


def test_a_rank_reads_through_the_shard_index_without_parsing_the_manifest(tmp_path: Path, monkeypatch) -> None:
    from meshtrain.data import store as store_module
    from meshtrain.data.shard_index import INDEX_JSON, INDEX_NPY
    from meshtrain.data.location import StoreLocation
    from meshtrain.data.store import read_manifest, write_index

    stream = _write_store(tmp_path / "store", shards=300, rng=np.random.default_rng(3))
    location = StoreLocation(str(tmp_path / "store"))
    manifest = read_manifest(location)
    assert write_index(location, manifest) and (tmp_path / "store" / INDEX_NPY).exists()

    def no_parse(_location: object) -> None:
        raise AssertionError("a rank parsed the manifest")

    monkeypatch.setattr(store_module, "read_manifest", no_parse)
    store = TokenStore(str(tmp_path / "store"))
    assert store.fingerprint == manifest.fingerprint and len(store) == len(stream)
    picker = random.Random(2)
    for _ in range(500):
        start = picker.randrange(0, len(stream) - 300)
        stop = start + picker.randrange(1, 300)
        assert np.array_equal(store.read(start, stop), stream[start:stop])
    assert [store.index.sha256(k) for k in range(300)] == [s.sha256 for s in manifest.shards]
    store.close()
    # An index that does not describe the manifest beside it (another size) is not trusted.
    header = json.loads((tmp_path / "store" / INDEX_JSON).read_text())
    (tmp_path / "store" / INDEX_JSON).write_text(json.dumps({**header, "manifest_bytes": 1}))
    with pytest.raises(AssertionError, match="parsed the manifest"):
        TokenStore(str(tmp_path / "store"))
    monkeypatch.undo()
    assert np.array_equal(TokenStore(str(tmp_path / "store")).read(0, len(stream)), stream)
