"""Data: every source kind (plain text without `datasets`, the rest through it), packing without padding, disjoint per-rank slices."""

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


def test_text_files_are_read_as_datasets_text_loader_reads_them(tmp_path) -> None:
    """Plain-text files are read without `datasets` (a GPU image may lack it), document for document as its
    text loader gives them: UTF-8, universal newlines."""
    import datasets

    for i, doc in enumerate(["plain\n", "windows\r\nline ends\r\n", "old mac\rline ends", "unicode \u00e9 \u2603\n"]):
        (tmp_path / f"doc{i}.txt").write_bytes(doc.encode())
    plan = plan_source(SourceConfig(source=str(tmp_path)), 1 << 20)
    files = [name for unit in plan.units for name in unit.files]
    theirs = datasets.load_dataset("text", data_files=files, split="train", streaming=True, sample_by="document")
    assert all_documents(SourceConfig(source=str(tmp_path))) == [row["text"] for row in theirs]


def test_missing_text_column_is_a_config_error(tmp_path) -> None:
    source = tmp_path / "corpus.jsonl"
    source.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ConfigError, match="data.text_field: column 'text' not in"):
        all_documents(SourceConfig(source=str(source)))


@pytest.mark.parametrize(
    "columns, files, message",
    [
        ({"text": [[1, 2, 3]]}, ["a.parquet"],
         r"^data.text_field: column 'text' of \S+a.parquet holds int values \(row 0\), not text; set data.text_field to the "
         "column holding the text$"),
        ({"text": [["one", None, "three"]]}, ["a.parquet"],
         r"^data.text_field: row 1 of \S+a.parquet has no text \(column 'text' is null\); drop or fill that row, or set "
         "data.text_field to a column with text in every row$"),
        ({"text": [["one", "two"], ["three", None]]}, ["a.parquet", "b.parquet"],  # one unit of two files
         r"^data.text_field: row 1 of \S+b.parquet has no text \(column 'text' is null\)"),
    ],
    ids=["integer-column", "null-row", "null-row-in-the-second-file"],
)
def test_a_parquet_column_that_is_not_text_is_one_line_naming_the_file(tmp_path, columns, files, message) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for k, name in enumerate(files):
        pq.write_table(pa.table({field: values[k] for field, values in columns.items()}), tmp_path / name)
    with pytest.raises(ConfigError, match=message) as info:
        all_documents(SourceConfig(source=str(tmp_path)))
    assert "\n" not in str(info.value)


def test_a_small_corpus_is_cut_finer_than_the_unit_size_but_not_below_one_mib() -> None:
    from meshtrain.data.sources import MIN_UNIT_BYTES, UNITS_WANTED, unit_target

    assert unit_target(100 * 2**30, 64 * 2**20) == 64 * 2**20
    assert unit_target(UNITS_WANTED * 3 * 2**20, 64 * 2**20) == 3 * 2**20
    assert unit_target(5 * 2**20, 64 * 2**20) == MIN_UNIT_BYTES
    assert unit_target(5 * 2**20, 1000) == 1000  # an explicit small size is kept (tests, tiny corpora)
    units = plan_source(SourceConfig(), 64 * 2**20).units  # the default job's corpus, about 5 MB of files
    assert 3 <= len(units) <= 8 and all(unit.start is None for unit in units)


def write_jsonl(path, documents: list[str], field: str = "text") -> None:
    path.write_text("".join(json.dumps({field: d, "n": i}) + "\n" for i, d in enumerate(documents)))


def read_in_tiny_parts(monkeypatch, read_bytes: int = 13) -> None:
    """Lines over 64 bytes are read as long records, ``read_bytes`` at a time, strings over 16 bytes left out
    of the parsed skeleton: the long-record path on small files."""
    import meshtrain.data.sources as sources

    monkeypatch.setattr(sources, "LONG_LINE_BYTES", 64)
    monkeypatch.setattr(sources, "LONG_STRING_BYTES", 16)
    monkeypatch.setattr(sources, "READ_BYTES", read_bytes)


@pytest.mark.parametrize("in_parts", [False, True], ids=["lines", "long-records-in-parts"])
@pytest.mark.parametrize("range_bytes", [7, 50, 333, 4096])
def test_a_big_jsonl_file_is_split_into_byte_ranges_that_read_every_line_once(
    tmp_path, monkeypatch, range_bytes: int, in_parts: bool
) -> None:
    """Split anywhere, even inside a line or between the bytes of a newline-free long line, the
    ranges together read exactly the documents `datasets` reads from the whole file, in order (also
    where every line is a long record, read in parts)."""
    import meshtrain.data.sources as sources

    if in_parts:
        read_in_tiny_parts(monkeypatch)
    documents = DOCS + ["x" * 1000, "", "ünïcödé ✓"] + DOCS[:3]
    write_jsonl(tmp_path / "a.jsonl", documents)
    (tmp_path / "b.jsonl").write_text("\n" + json.dumps({"text": "after a blank line"}) + "\n\n")
    monkeypatch.setattr(sources, "MIN_UNIT_BYTES", range_bytes)
    plan = plan_source(SourceConfig(source=str(tmp_path)), range_bytes)
    size = (tmp_path / "a.jsonl").stat().st_size
    ranges = [(u.start, u.end) for u in plan.units if u.files == (str(tmp_path / "a.jsonl"),)]
    if size >= 2 * range_bytes:
        assert len(ranges) >= size // range_bytes // 2 and ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(end == next_start for (_, end), (next_start, _) in zip(ranges, ranges[1:]))
    else:
        assert all(unit.start is None for unit in plan.units)
    split = [text for unit in plan.units for text in read_unit(plan, unit)]
    import datasets

    whole = [row["text"] for row in datasets.load_dataset(
        "json", data_files=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], split="train", streaming=True)]
    assert split == whole == documents + ["after a blank line"]


def test_a_store_of_split_ranges_holds_the_whole_files_tokens(tmp_path, monkeypatch) -> None:
    """Ranges that hold no line start become empty shards; the stream skips them."""
    import meshtrain.data.sources as sources
    from tokenizers import Tokenizer

    from meshtrain.data import prepare_data

    documents = DOCS + ["y" * 600] + DOCS
    write_jsonl(tmp_path / "corpus.jsonl", documents)
    monkeypatch.setattr(sources, "MIN_UNIT_BYTES", 64)
    data = DataConfig(source=str(tmp_path / "corpus.jsonl"), vocab_size=300, seq_len=8, prepare_unit_bytes=64)
    plan = prepare_data(data, str(tmp_path / "cache"), 8, use_ray=False, log=lambda _: None)
    store = TokenStore(plan.stores[0].url)
    assert any(s.tokens == 0 for s in store.manifest.shards) and len(store.manifest.shards) > 20
    tokenizer = Tokenizer.from_str(plan.tokenizer_json)
    expected = [i for e in tokenizer.encode_batch(documents) for i in e.ids + [plan.eos_id]]
    assert store.read(0, len(store)).tolist() == expected
    assert store.read(5, len(store) - 5).tolist() == expected[5:-5]


def test_a_broken_jsonl_line_is_named_with_its_file_and_byte(tmp_path) -> None:
    source = tmp_path / "corpus.jsonl"
    source.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"data.source: .*corpus.jsonl is not JSON Lines at byte 17 .*fix or remove"):
        all_documents(SourceConfig(source=str(source)))
    source.write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(ConfigError, match="data.text_field: column 'text' of .* holds int, not text"):
        all_documents(SourceConfig(source=str(source)))


def _tricky_texts() -> list[str]:
    """Texts whose JSON has escapes of every kind: surrogate pairs, runs of backslashes before quotes and
    escapes, control characters, multi-byte UTF-8 (as written raw) and a BOM."""
    import random

    rng = random.Random(49)
    alphabet = ["a", " ", "\\", '"', "\n", "\t", "\x01", "é", "中", "😀", "\ud800"[:1] + "x", "\\u", "/", "\ufeff"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(40, 400))) for _ in range(12)]
    return texts + ["😀" * 50, "\\" * 61 + '"', "plain " * 30, ""]


@pytest.mark.parametrize("ascii_only", [True, False], ids=["escaped", "raw-utf8"])
def test_a_long_jsonl_record_is_read_in_parts_that_join_to_its_value(tmp_path, monkeypatch, ascii_only) -> None:
    """A record over LONG_LINE_BYTES is read READ_BYTES at a time, never whole: its text comes in parts of
    about that size that join to exactly what json.loads gives the whole line, whatever the cut splits (an
    escape, a surrogate pair, a UTF-8 character, a run of backslashes), wherever the text field is and
    whatever other long strings the record holds."""
    import meshtrain.data.sources as sources
    from meshtrain.data.sources import unit_documents

    texts = _tricky_texts()
    lines = []
    for i, text in enumerate(texts):
        if i % 2:
            record = {"other": text[::-1] * 2, "text": text, "n": [i, {"deep": text[:30]}]}
            lines.append(json.dumps(record, ensure_ascii=ascii_only))
        else:  # a duplicate key: json.loads keeps the last
            lines.append('{"text": "a decoy, replaced by the later key", "meta": {"x": 1.5e3}, "text": '
                         + json.dumps(text, ensure_ascii=ascii_only) + "}")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(("\n".join(lines) + "\n   \n").encode("utf-8", "surrogatepass"))
    whole = [json.loads(line.encode("utf-8", "surrogatepass"))["text"] for line in lines]
    assert whole == texts
    for read_bytes in (1, 2, 3, 5, 7, 64):
        read_in_tiny_parts(monkeypatch, read_bytes)
        plan = plan_source(SourceConfig(source=str(corpus)), 1 << 20)
        documents = [list(parts) for unit in plan.units for parts in unit_documents(plan, unit)]
        assert ["".join(parts) for parts in documents] == texts, read_bytes
        assert max(len(part) for parts in documents for part in parts) <= max(read_bytes + 12, 64), read_bytes
    monkeypatch.setattr(sources, "READ_BYTES", 1 << 20)
    monkeypatch.setattr(sources, "LONG_LINE_BYTES", 1 << 22)
    assert all_documents(SourceConfig(source=str(corpus))) == texts  # and whole lines, as before


@pytest.mark.parametrize(("line", "error"), [
    ('{"text": "' + "x" * 80 + '" "n": 1}', r"not JSON Lines at byte 18 \(Expecting ',' delimiter"),
    ('{"text": "' + "x" * 80 + '\\q"}', r"not JSON Lines at byte 18 \(Invalid \\escape"),
    ('{"text": "' + "x" * 80 + "\t" + '"}', r"not JSON Lines at byte 18 \(Invalid control character"),
    ('{"text": "' + "x" * 80, r"not JSON Lines at byte 18 \(Unterminated string"),
    ('{"text": "' + "x" * 80 + '\\ud83d\\u12"}', r"not JSON Lines at byte 18 \(Invalid \\uXXXX escape"),
    ('["' + "x" * 80 + '"]', r"data.text_field: column 'text' not in \S+ at byte 18 \(columns: a list, not an object\)"),
    ('{"body": "' + "x" * 80 + '"}', r"data.text_field: column 'text' not in \S+ at byte 18 \(columns: body\)"),
    ('{"text": ["' + "x" * 80 + '"]}', r"data.text_field: column 'text' of \S+ at byte 18 holds list, not text"),
], ids=["structure", "escape", "control", "unterminated", "unicode-escape", "not-object", "no-field", "not-text"])
def test_a_broken_long_record_is_named_as_a_line_is(tmp_path, monkeypatch, line, error) -> None:
    read_in_tiny_parts(monkeypatch, 7)
    source = tmp_path / "corpus.jsonl"
    source.write_bytes(json.dumps({"text": "fine"}).encode() + b"\n\n" + line.encode() + b"\n")
    with pytest.raises(ConfigError, match=error):
        all_documents(SourceConfig(source=str(source)))


@pytest.mark.parametrize("read_bytes", [1, 3, 8, 1 << 20])
def test_a_text_file_is_read_in_parts_that_join_to_the_file(tmp_path, monkeypatch, read_bytes) -> None:
    """Parts of READ_BYTES characters; newlines are translated across the parts' edges as a whole read
    translates them (a \\r\\n split between two parts is one newline)."""
    import meshtrain.data.sources as sources
    from meshtrain.data.sources import unit_documents

    text = "one\r\ntwo\rthree\n\r\n\r\r\nü中😀\r\n" * 5 + "\ufeff end\r"
    (tmp_path / "a.txt").write_bytes(text.encode())
    monkeypatch.setattr(sources, "READ_BYTES", read_bytes)
    plan = plan_source(SourceConfig(source=str(tmp_path / "a.txt")), 1 << 20)
    [[parts]] = [list(unit_documents(plan, unit)) for unit in plan.units]
    parts = list(parts)
    assert "".join(parts) == (tmp_path / "a.txt").read_text() == text.replace("\r\n", "\n").replace("\r", "\n")
    assert max(len(part) for part in parts) <= read_bytes


def test_document_pieces_cut_a_text_where_they_cut_it_whole_however_it_is_parted() -> None:
    """The pieces of a text read in parts are the pieces of the whole text: those of the whole-text cutter
    this one replaced, kept here as the reference."""
    import random

    from meshtrain.data.prepare import document_pieces

    def whole_text_pieces(text: str, limit: int) -> list[str]:
        pieces, start = [], 0
        while len(text) - start > limit:
            end, floor = start + limit, start + limit // 2
            cut = text.rfind(" ", floor + 1, end)
            while cut > floor and text[cut - 1].isspace():
                cut = text.rfind(" ", floor + 1, cut)
            cut = cut if cut > floor else end
            pieces.append(text[start:cut])
            start = cut
        return pieces + [text[start:] if start else text]

    rng = random.Random(7)
    texts = ["", "x", "a b", " " * 50, "nospaces" * 30] + [
        "".join(rng.choice(["word", " ", "  ", "\n ", "\t", "x"]) for _ in range(rng.randrange(1, 300)))
        for _ in range(60)]
    for text in texts:
        for limit in (1, 2, 5, 16, 100, 10_000):
            expected = whole_text_pieces(text, limit)
            for _ in range(3):
                cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 12)))) if text else []
                parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
                pieces = list(document_pieces(iter(parts), limit))
                assert [piece for piece, _ in pieces] == expected, (text, limit, parts)
                assert [last for _, last in pieces] == [False] * (len(expected) - 1) + [True]


def test_block_crcs_of_parts_are_the_block_crcs_of_the_whole() -> None:
    import random

    from meshtrain.data.remote import BlockCrcs, block_crcs

    rng = random.Random(3)
    for size in (0, 1, 1023, 1024, 1025, 5000):
        data = rng.randbytes(size)
        for _ in range(5):
            cuts = sorted(rng.sample(range(size + 1), min(size + 1, rng.randrange(0, 8))))
            crcs = BlockCrcs()
            for a, b in zip([0, *cuts], [*cuts, size]):
                crcs.update(data[a:b])
            assert crcs.digest() == block_crcs(data), (size, cuts)


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


# --- symlinks in a source, and documents longer than one encode -----------------------------------


def test_a_glob_through_a_folder_link_or_a_link_loop_lists_each_file_once(tmp_path, monkeypatch) -> None:
    """`ver/latest -> v2` beside `ver/v2` and a file link: every file is listed (and trained on) once, in
    path order, and a link to a folder elsewhere still adds its files to a glob; a loop `up -> ..` adds
    nothing (glob listed 3 files 41 times, down to the operating system's limit of links in a path); a
    directory source does not enter folder links."""
    from meshtrain.data.sources import expand_local_source

    monkeypatch.chdir(tmp_path)
    for folder in ("ver/v2", "other_disk", "loop/x"):
        (tmp_path / folder).mkdir(parents=True)
    for name in ("a", "b", "c"):
        write_jsonl(tmp_path / "ver" / "v2" / f"{name}.jsonl", [f"document {name}"])
        write_jsonl(tmp_path / "loop" / "x" / f"{name}.jsonl", [f"document {name}"])
    write_jsonl(tmp_path / "other_disk" / "d.jsonl", ["document d"])
    (tmp_path / "ver" / "latest").symlink_to("v2")
    (tmp_path / "ver" / "v2" / "again.jsonl").symlink_to("a.jsonl")
    (tmp_path / "ver" / "extra").symlink_to(tmp_path / "other_disk")
    (tmp_path / "loop" / "x" / "up").symlink_to("..")
    once = ["ver/extra/d.jsonl", "ver/latest/a.jsonl", "ver/latest/b.jsonl", "ver/latest/c.jsonl"]
    for pattern in ("ver/**/*.jsonl", "ver/**", "ver/*/*.jsonl"):
        assert [str(p) for p in expand_local_source(pattern)] == once, pattern
    assert expand_local_source(str(tmp_path / "ver/**/*.jsonl")) == [tmp_path / name for name in once]
    assert [str(p) for p in expand_local_source("ver")] == ["ver/v2/a.jsonl", "ver/v2/b.jsonl", "ver/v2/c.jsonl"]
    assert [str(p) for p in expand_local_source("loop/**/*.jsonl")] == ["loop/x/a.jsonl", "loop/x/b.jsonl",
                                                                         "loop/x/c.jsonl"]
    documents = all_documents(SourceConfig(source="ver/**/*.jsonl"))
    assert documents == ["document d", "document a", "document b", "document c"]


def test_a_recursive_glob_lists_what_glob_lists_where_there_are_no_links(tmp_path, monkeypatch) -> None:
    import glob
    from pathlib import Path

    from meshtrain.data.sources import LOADERS_BY_SUFFIX, expand_local_source

    monkeypatch.chdir(tmp_path)
    for name in ("a/1.jsonl", "a/b/2.jsonl", "a/b/c/3.jsonl", "a/b/c/b4.jsonl", ".hidden/x/5.jsonl",
                 "a/.hidden/6.jsonl", "a/.7.jsonl", "d/8.txt", "9.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('{"text": "x"}\n')
    for pattern in ("**/*.jsonl", "a/**", "a/**/b/**/*.jsonl", "**/b*", "*/**/*.jsonl", "a/**/.*", ".*/**/*.jsonl",
                    "**/c/*", "a/*/c/**", "missing/**/*.jsonl", "**/*.txt"):
        expected = sorted(Path(p) for p in glob.glob(pattern, recursive=True)
                          if Path(p).is_file() and Path(p).suffix in LOADERS_BY_SUFFIX)
        assert expand_local_source(pattern) == expected, pattern


@pytest.mark.parametrize("in_parts", [False, True], ids=["whole-lines", "read-in-parts"])
@pytest.mark.parametrize("template", [False, True], ids=["plain", "bos-and-eos-template"])
def test_a_document_longer_than_a_piece_is_encoded_in_pieces_to_its_own_tokens(
    tmp_path, monkeypatch, template, in_parts
) -> None:
    """No encode call gets more than PIECE_CHARS characters, and the shard holds exactly the whole
    documents' encodings (template tokens at the document's ends only), each followed by one
    end-of-document token; also where the long document is read in parts of READ_BYTES."""
    from typing import Any

    import tokenizers
    from tokenizers import processors

    import meshtrain.data.sources as sources
    from meshtrain.data import prepare as prepare_module
    from meshtrain.data.tokenizer import train_tokenizer

    if in_parts:
        monkeypatch.setattr(sources, "LONG_LINE_BYTES", 5000)
        monkeypatch.setattr(sources, "LONG_STRING_BYTES", 100)
        monkeypatch.setattr(sources, "READ_BYTES", 777)

    texts = [p.read_text() for p in stdlib_source_files()[:6]]
    documents = ["a short one", " ".join(texts), "another short one"]
    write_jsonl(tmp_path / "corpus.jsonl", documents)
    tokenizer = train_tokenizer(iter(texts), 400)
    if template:
        tokenizer.add_special_tokens(["<s>", "</s>"])
        specials = [(token, tokenizer.token_to_id(token)) for token in ("<s>", "</s>")]
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=specials)
    expected = [i for e in tokenizer.encode_batch(documents) for i in e.ids + [tokenizer.token_to_id(EOS_TOKEN)]]
    plan = plan_source(SourceConfig(source=str(tmp_path / "corpus.jsonl")), 1 << 20)
    encoded: list[int] = []
    real = tokenizers.Tokenizer

    class Counting:
        """The tokenizer, counting the characters of every encode call."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        @classmethod
        def from_str(cls, text: str) -> "Counting":
            return cls(real.from_str(text))

        def encode_batch(self, batch: list[str]) -> Any:
            encoded.append(sum(len(text) for text in batch))
            return self.inner.encode_batch(batch)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 2000)
    monkeypatch.setattr(tokenizers, "Tokenizer", Counting)
    [unit] = plan.units
    record = prepare_module.tokenize_unit(plan, unit, tokenizer.to_str(), str(tmp_path / "store"), {})
    assert max(encoded) <= 2000 and len(encoded) > len(documents[1]) // 2000
    assert np.fromfile(tmp_path / "store" / record.file, dtype="<u2").tolist() == expected
    assert record.documents == 3
