"""Data: every source kind through `datasets`, packing without padding, disjoint per-rank slices."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from corpora import stdlib_plan
from meshtrain.config import ConfigError, DataConfig, SourceConfig
from meshtrain.data import EOS_TOKEN, DataParallelBatches, PackedSequences, TokenStore, stdlib_source_files
from meshtrain.data.sources import plan_source, read_unit

DOCS = [f"document {i}: " + "def f(x):\n    return x + %d\n" % i * (i + 1) for i in range(12)]


def all_documents(source: SourceConfig, unit_bytes: int = 1 << 20) -> list[str]:
    plan = plan_source(source, unit_bytes)
    return [text for unit in plan.units for text in read_unit(plan, unit)]


def test_stdlib_corpus_is_the_standard_library() -> None:
    files = stdlib_source_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    docs = all_documents(SourceConfig(max_documents=5), unit_bytes=1)
    assert docs == [f.read_text() for f in files[:5]]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt", "directory"])
def test_user_files_are_read_through_the_same_path(tmp_path, kind: str) -> None:
    if kind == "jsonl":
        source = tmp_path / "corpus.jsonl"
        source.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
        cfg = SourceConfig(source=str(source), text_field="body")
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = tmp_path / "corpus.parquet"
        pq.write_table(pa.table({"text": DOCS}), source)
        cfg = SourceConfig(source=str(source))
    else:
        for i, doc in enumerate(DOCS):
            (tmp_path / f"doc{i:02d}.txt").write_text(doc)
        cfg = SourceConfig(source=str(tmp_path / "*.txt") if kind == "txt" else str(tmp_path))
    assert sorted(all_documents(cfg)) == sorted(DOCS)


def test_missing_text_column_is_a_config_error(tmp_path) -> None:
    source = tmp_path / "corpus.jsonl"
    source.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ConfigError, match="data.text_field: column 'text' not in"):
        all_documents(SourceConfig(source=str(source)))


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return stdlib_plan(tmp_path_factory.mktemp("stores"), documents=12, vocab_size=400, seq_len=16)


@pytest.fixture(scope="module")
def tokens(plan) -> np.ndarray:
    store = TokenStore(plan.stores[0].url)
    return np.asarray(store.read(0, len(store)))


def test_documents_are_joined_by_end_of_document_tokens(plan, tokens) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(plan.tokenizer_json)
    assert tokenizer.token_to_id(EOS_TOKEN) == plan.eos_id
    assert int((tokens == plan.eos_id).sum()) == plan.documents == 12
    assert tokens[-1] == plan.eos_id
    first_doc = tokens[: int(np.argmax(tokens == plan.eos_id))]
    assert tokenizer.decode(first_doc.tolist()) == stdlib_source_files()[0].read_text()


def test_a_user_tokenizer_file_is_used_as_is(tmp_path, plan, tokens) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(plan.tokenizer_json)
    again = stdlib_plan(tmp_path / "stores", documents=12, seq_len=16, tokenizer=str(path))
    assert again.tokenizer_json == plan.tokenizer_json
    store = TokenStore(again.stores[0].url)
    assert np.array_equal(store.read(0, len(store)), tokens)


def test_windows_are_packed_without_padding_and_shifted_by_one(tokens) -> None:
    samples = PackedSequences(tokens, 16, seed=0)
    assert samples.windows == (len(tokens) - 1) // 16
    batches = DataParallelBatches(samples, 4, 4, dp_rank=0, dp_size=1, device=torch.device("cpu"))
    [(inputs, targets)] = list(batches.next_step())
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    stream = torch.from_numpy(tokens.astype(np.int64))
    for row_in, row_target in zip(inputs, targets):
        starts = [s for s in range(0, len(stream) - 16, 16) if torch.equal(stream[s : s + 16], row_in)]
        assert starts and torch.equal(stream[starts[0] + 1 : starts[0] + 17], row_target)


# Token i at position i: every window's contents identify it (real text repeats itself).
UNIQUE_STREAM = np.arange(16 * 50 + 1, dtype=np.uint32)


def test_every_window_is_seen_once_per_epoch_in_a_seeded_order() -> None:
    a, b, c = (PackedSequences(UNIQUE_STREAM, 16, seed) for seed in (0, 0, 1))
    n = a.windows
    first_epoch = [tuple(a.sample(i)) for i in range(n)]
    assert len(set(first_epoch)) == n
    assert first_epoch == [tuple(b.sample(i)) for i in range(n)]
    assert first_epoch != [tuple(c.sample(i)) for i in range(n)]
    assert [tuple(a.sample(n + i)) for i in range(n)] != first_epoch  # a new order each epoch


def rank_samples(samples: PackedSequences, world: int, micro: int, steps: int) -> list[list[set]]:
    """Per step, per rank: the set of windows (as tuples) that rank trains on."""
    per_step: list[list[set]] = [[set() for _ in range(world)] for _ in range(steps)]
    for rank in range(world):
        batches = DataParallelBatches(samples, 8, micro, rank, world, torch.device("cpu"))
        for step in range(steps):
            for inputs, _ in batches.next_step():
                per_step[step][rank].update(tuple(row.tolist()) for row in inputs)
    return per_step


def test_ranks_read_disjoint_slices_of_the_same_global_batch() -> None:
    samples = PackedSequences(UNIQUE_STREAM, 16, seed=3)
    single = rank_samples(samples, world=1, micro=8, steps=3)
    for world, micro in ((2, 2), (4, 2), (4, 1), (8, 1)):
        split = rank_samples(samples, world, micro, steps=3)
        for step in range(3):
            sets = split[step]
            assert sum(len(s) for s in sets) == len(set().union(*sets)) == 8  # disjoint, 8 in all
            assert set().union(*sets) == single[step][0]  # the same global batch as one process


def test_position_state_resumes_the_exact_stream(tokens) -> None:
    samples = PackedSequences(tokens, 16, seed=0)
    straight = DataParallelBatches(samples, 4, 2, 1, 2, torch.device("cpu"))
    for _ in range(3):
        list(straight.next_step())
    resumed = DataParallelBatches(samples, 4, 2, 1, 2, torch.device("cpu"))
    resumed.load_state_dict(straight.state_dict())
    assert resumed.state_dict() == {"position": 12}
    for (a, _), (b, _) in zip(straight.next_step(), resumed.next_step()):
        assert torch.equal(a, b)


def test_too_little_data_for_one_window_is_a_config_error(tmp_path) -> None:
    source = tmp_path / "tiny.txt"
    source.write_text("x")
    from meshtrain.data import prepare_data

    with pytest.raises(ConfigError, match="data.source: .* fewer than data.seq_len"):
        prepare_data(DataConfig(source=str(source), seq_len=64), str(tmp_path / "c"), 64, use_ray=False, log=print)
