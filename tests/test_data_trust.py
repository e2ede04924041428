"""Token reads are checked: every block a local read touches against the shard's checksum list, every
token against the vocabulary; a mismatch is one permanent line naming the shard, the byte and the
command that prepares the shard again (which then re-encodes that shard only)."""

from __future__ import annotations

import random
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from meshtrain_bench.data import flip_token_bit
from meshtrain.config import DataConfig, PermanentError
from meshtrain.config.loading import load_config
from meshtrain.data import DataParallelBatches, PackedSequences, TokenStore, prepare_data
from meshtrain.data import sources as sources_module
from meshtrain.data.integrity import CorruptTokens
from meshtrain.data.remote import LEGACY_CHECK_BYTES, block_crcs
from meshtrain.data.open_files import OPEN_SHARDS
from meshtrain.data.store_format import shard_name

UNIT_BYTES = 4096


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus, store): 8 text files prepared in-process into 8 shards of 2-3 checksum blocks."""
    root = tmp_path_factory.mktemp("trust")
    corpus = root / "corpus"
    corpus.mkdir()
    for index in range(8):
        (corpus / f"doc{index:02d}.txt").write_text(f"document {index}: " + f"some words number {index} to encode " * 150)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sources_module, "MIN_UNIT_BYTES", 1024)
        data = DataConfig(source=str(corpus), vocab_size=300, seq_len=8, prepare_unit_bytes=UNIT_BYTES)
        plan = prepare_data(data, str(root / "cache"), 8, use_ray=False, log=lambda _: None)
    return corpus, Path(plan.stores[0].url)


@pytest.fixture
def store(prepared, tmp_path) -> Path:
    """A copy of the prepared store to damage, at the path the prepare would give it under tmp_path/cache."""
    return Path(shutil.copytree(prepared[1], tmp_path / "cache" / prepared[1].name))


def stream_of(store: Path) -> np.ndarray:
    """The store's tokens straight from its shard files (no reader involved)."""
    return np.concatenate([np.fromfile(path, dtype="<u2") for path in sorted(store.glob("shard-*.bin"))])


def test_a_clean_store_reads_as_its_shards_with_bounded_descriptors(store: Path) -> None:
    expected = stream_of(store)
    tokens = TokenStore(str(store))
    assert tokens.index.shards > 4 and (store / "shard-000000.crc32").exists()
    before = len(list(Path("/proc/self/fd").iterdir()))
    picker = random.Random(0)
    for _ in range(1000):  # across blocks and shard boundaries
        start = picker.randrange(0, len(expected) - 700)
        stop = start + picker.randrange(1, 700)
        assert np.array_equal(tokens.read(start, stop), expected[start:stop])
    assert np.array_equal(tokens.read(0, len(expected)), expected)
    assert len(list(Path("/proc/self/fd").iterdir())) - before <= OPEN_SHARDS
    tokens.close()


def test_a_flipped_low_bit_is_one_line_and_its_command_prepares_that_shard_again(prepared, store: Path) -> None:
    corpus, _ = prepared
    expected = stream_of(store)
    tokens = TokenStore(str(store))
    target = tokens.index.start(2) + 700  # token 700 of shard 2: byte 1400, in its block 1
    shard, byte = flip_token_bit(str(store), target, 0)
    assert (shard, byte) == (store / shard_name(2), 1400)
    assert np.array_equal(tokens.read(target - 200, target - 188), expected[target - 200 : target - 188])  # block 0
    with pytest.raises(CorruptTokens) as info:
        tokens.read(target - 2, target + 3)
    message = str(info.value)
    assert isinstance(info.value, PermanentError) and "\n" not in message
    end = tokens.index.tokens(2) * 2  # block 1 is the shard's last
    assert message.startswith(f"data.source: shard {shard} is corrupt at byte offset 1024: its 1024-byte block 1 "
                              f"(bytes 1024-{end}) does not match the checksum in shard-000002.crc32; re-prepare it: remove "
                              f"{store}/manifest.json and {store}/shard-000002.json, then run python jobs/prepare_data.py "
                              f"--output {store.parent} data.source={corpus} data.tokenizer={store}/tokenizer.json with")

    # What the message says to do, with the one setting this store was prepared with beside the defaults.
    for name in ("manifest.json", "shard-000002.json"):
        (store / name).unlink()
    command = shlex.split(message.split(", then run ", 1)[1].split(" with the other", 1)[0])
    assert command[:4] == ["python", "jobs/prepare_data.py", "--output", str(store.parent)]
    others = {path.name: path.stat().st_mtime_ns for path in store.glob("shard-*.bin") if path.name != shard.name}
    cfg = load_config(None, [*command[4:], f"data.prepare_unit_bytes={UNIT_BYTES}"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sources_module, "MIN_UNIT_BYTES", 1024)
        again = prepare_data(cfg.data, command[3], cfg.data.seq_len, use_ray=False, log=lambda _: None)
    assert again.stores[0].url == str(store) and again.stores[0].fingerprint == tokens.fingerprint
    assert {path.name: path.stat().st_mtime_ns for path in store.glob("shard-*.bin") if path.name != shard.name} == others
    assert np.array_equal(TokenStore(str(store)).read(0, len(expected)), expected)


@pytest.mark.parametrize("lists", ["crc32", "legacy", "none"])
def test_a_high_bit_flip_is_refused_by_the_checksum_or_else_the_vocabulary(store: Path, lists: str) -> None:
    """In a store with checksum lists (the 1 KiB .crc32 ones, or the legacy 64 KiB .crc ones) the block
    check names the flip; without lists the id it makes is past the vocabulary."""
    for shard in sorted(store.glob("shard-*.bin")):
        if lists != "crc32":
            shard.with_suffix(".crc32").unlink()
        if lists == "legacy":
            shard.with_suffix(".crc").write_bytes(block_crcs(shard.read_bytes(), LEGACY_CHECK_BYTES))
    tokens = TokenStore(str(store))
    target = tokens.index.start(1) + 10
    flip_token_bit(str(store), target, 15)
    value = int(stream_of(store)[target])
    assert value >= 1 << 15
    found = {
        "crc32": "is corrupt at byte offset 0: its 1024-byte block 0 (bytes 0-1024) does not match the checksum in "
                 "shard-000001.crc32",
        "legacy": f"is corrupt at byte offset 0: its 65536-byte block 0 (bytes 0-{tokens.index.tokens(1) * 2}) does not "
                  "match the checksum in shard-000001.crc",
        "none": f"is corrupt at byte offset 20: token id {value} is outside the tokenizer's vocabulary of "
                f"{tokens.vocab_size}",
    }[lists]
    line = f"data.source: shard {store}/shard-000001.bin {found}; re-prepare it: "
    with pytest.raises(CorruptTokens, match="^" + re.escape(line)) as info:
        tokens.read(target - 1, target + 1)
    assert "\n" not in str(info.value)


def test_a_token_past_the_vocabulary_is_refused_even_when_its_checksum_matches(store: Path) -> None:
    """A shard written wrong (another tokenizer's ids, say) passes its checksums; the range check names it."""
    shard = store / "shard-000000.bin"
    tokens = TokenStore(str(store))
    data = np.fromfile(shard, dtype="<u2")
    data[5] = tokens.vocab_size  # one past the last id
    shard.write_bytes(data.tobytes())
    shard.with_suffix(".crc32").write_bytes(block_crcs(data.tobytes()))
    line = (f"data.source: shard {shard} is corrupt at byte offset 10: token id {tokens.vocab_size} is outside the "
            f"tokenizer's vocabulary of {tokens.vocab_size}; re-prepare it: remove ")
    with pytest.raises(CorruptTokens, match="^" + re.escape(line)):
        tokens.read(0, 8)
    assert np.array_equal(tokens.read(6, 20), data[6:20])  # the rest of the block reads


def test_a_short_checksum_list_is_corruption_too(store: Path) -> None:
    crcs = store / "shard-000001.crc32"
    crcs.write_bytes(crcs.read_bytes()[:4])
    tokens = TokenStore(str(store))
    tokens.read(tokens.index.start(1), tokens.index.start(1) + 10)  # block 0 has its checksum
    with pytest.raises(CorruptTokens, match=r"shard-000001.bin is corrupt at byte offset 1020: its shard-000001.crc32 list "
                       "ends before the checksum of block 1; re-prepare it"):
        tokens.read(tokens.index.start(1) + 510, tokens.index.start(1) + 520)


def test_corruption_reaches_the_training_loop_as_itself_through_the_read_ahead_threads(store: Path) -> None:
    tokens = TokenStore(str(store))
    samples = PackedSequences(tokens, 8, seed=0)
    flip_token_bit(str(store), samples.locate(3).start + 2, 0)
    batches = DataParallelBatches(samples, 16, 4, 0, 1, torch.device("cpu"), read_ahead_steps=2, read_threads=4)
    with pytest.raises(CorruptTokens, match="does not match the checksum"):
        list(batches.next_step())  # read in a read-ahead thread, raised in the step
    batches.close()


def test_flipping_a_bit_outside_the_store_is_refused(store: Path) -> None:
    tokens = len(TokenStore(str(store)))
    with pytest.raises(ValueError, match=rf"token {tokens} bit 0 is not in"):
        flip_token_bit(str(store), tokens, 0)
    with pytest.raises(ValueError, match="bit 16 is not in"):
        flip_token_bit(str(store), 0, 16)
