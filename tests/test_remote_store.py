"""Remote token stores at scale: exact ranged reads checked per 4 KiB block, a node cache that ranks
share and that stays under its bound, older stores read as they were written, and storage that
stops answering reported in one line."""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshtrain_bench.synthetic_store import write_store
from meshtrain.config import ConfigError, PermanentError
from meshtrain.data import TokenStore
from meshtrain.data import remote as remote_module
from meshtrain.data.integrity import CorruptTokens
from meshtrain.data.remote import StorageUnavailable
from meshtrain.data.location import ReadSettings
from ports import free_port
from s3server import moto_s3


BLOCK = remote_module.CHECK_BYTES  # shards of 10,000 uint16 tokens hold 20 check blocks


def _upload(folder: Path, options: dict[str, Any], prefix: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    for path in sorted(folder.iterdir()):
        if path.is_file():
            fs.put_file(str(path), f"data/{prefix}/{path.name}")
    return f"s3://data/{prefix}"


def _random_reads(store: TokenStore, count: int, seed: int, longest: int = 5000) -> list[tuple[int, int]]:
    picker = random.Random(seed)
    spans = []
    for _ in range(count):
        start = picker.randrange(0, len(store) - longest)
        spans.append((start, start + picker.randrange(1, longest)))
    return spans



@contextlib.contextmanager
def black_hole() -> Iterator[tuple[int, list[socket.socket]]]:
    """An endpoint that accepts connections and never answers: its port, and the connections it held."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1], held
    finally:
        server.close()
        for connection in held:
            connection.close()


def test_remote_reads_equal_local_reads_and_download_only_what_they_read(tmp_path, monkeypatch) -> None:
    summary = write_store(tmp_path / "store", shards=12, tokens_per_shard=10_000, sparse=False)
    local = TokenStore(summary["url"])
    with moto_s3(monkeypatch, "data") as options:
        url = _upload(tmp_path / "store", options, "s")
        reading = ReadSettings(cache_max_bytes=10**9, local_cache_dir=str(tmp_path / "cache"), read_timeout_s=30)
        store = TokenStore(url, options, reading=reading)
        assert store.fingerprint == local.fingerprint and len(store) == len(local)
        spans = _random_reads(store, 60, seed=1)
        spans += [(9_990, 10_010), (2 * BLOCK // 2 - 3, 2 * BLOCK // 2 + 3)]  # across a shard and a block boundary
        for start, stop in spans:
            assert np.array_equal(store.read(start, stop), local.read(start, stop))
        stats = store.stats()
        pieces = sum(1 + (start // 10_000 != (stop - 1) // 10_000) for start, stop in spans)  # one per shard touched
        read = sum(2 * (stop - start) for start, stop in spans)
        blocks = sum(-(-(2 * (stop - start)) // BLOCK) + 1 for start, stop in spans) + pieces
        # Each read rounded out to check blocks (at most a block more per piece) and their checksums.
        assert stats["bytes_downloaded"] <= read + pieces * 2 * BLOCK + 4 * blocks
        # Data and checksums in one round trip, unless an earlier read fetched the same blocks.
        assert stats["requests"] == store._opening_requests + 2 * (pieces - stats["cache_hits"])
        # A second reader of the node finds the blocks in the shared cache and downloads none.
        again = TokenStore(url, options, reading=reading)
        for start, stop in spans:
            assert np.array_equal(again.read(start, stop), local.read(start, stop))
        assert again.stats()["cache_hits"] >= len(spans) and again.stats()["bytes_downloaded"] == 0


def _reader(url: str, options: dict[str, Any], cache: str, bound: int, seed: int, expected: str, out: Any) -> None:
    store = TokenStore(url, options, reading=ReadSettings(cache_max_bytes=bound, local_cache_dir=cache, read_timeout_s=30))
    local = np.load(expected)
    for start, stop in _random_reads(store, 150, seed):
        if not np.array_equal(store.read(start, stop), local[start:stop]):
            out.put(f"wrong tokens at {start}:{stop}")
            return
    out.put(store.stats())


def test_two_ranks_share_a_cache_that_stays_under_its_bound(tmp_path, monkeypatch) -> None:
    summary = write_store(tmp_path / "store", shards=16, tokens_per_shard=10_000, sparse=False)
    local = TokenStore(summary["url"])
    np.save(tmp_path / "stream.npy", local.read(0, len(local)))
    bound = 24 * BLOCK  # far less than the store's 80 blocks
    with moto_s3(monkeypatch, "data") as options:
        url = _upload(tmp_path / "store", options, "s")
        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        ranks = [context.Process(target=_reader, args=(url, options, str(tmp_path / "cache"), bound, seed,
                                                        str(tmp_path / "stream.npy"), out)) for seed in (1, 2)]
        for rank in ranks:
            rank.start()
        results = [out.get(timeout=120) for _ in ranks]
        for rank in ranks:
            rank.join(timeout=30)
    assert all(isinstance(r, dict) for r in results), results
    cache = next((tmp_path / "cache").iterdir())
    size = sum(p.stat().st_size for p in cache.iterdir() if p.is_file())
    largest = 2 * 5000 + 2 * BLOCK  # one read rounded out to check blocks
    assert size <= bound + 2 * (bound // 16 + largest), size  # each process may be a sixteenth and a read past it
    assert sum(r["bytes_downloaded"] for r in results) > bound  # it did evict: more came in than it holds


def test_a_corrupted_block_is_refused_in_one_line(tmp_path, monkeypatch) -> None:
    import s3fs

    summary = write_store(tmp_path / "store", shards=3, tokens_per_shard=10_000, sparse=False)
    with moto_s3(monkeypatch, "data") as options:
        url = _upload(Path(summary["url"]), options, "s")
        fs = s3fs.S3FileSystem(**options)
        data = bytearray(fs.cat_file("data/s/shard-000001.bin"))
        data[3 * BLOCK + 10] ^= 0xFF  # one bit pattern in block 3 of shard 1, size unchanged
        fs.pipe_file("data/s/shard-000001.bin", bytes(data))
        store = TokenStore(url, options, reading=ReadSettings(local_cache_dir=str(tmp_path / "c"), read_timeout_s=10))
        assert len(store.read(10_000, 10_000 + BLOCK)) == BLOCK  # blocks 0-2 of shard 1 are intact
        with pytest.raises(CorruptTokens, match=rf"^data.source: shard s3://data/s/shard-000001.bin is corrupt at byte "
                           rf"offset {3 * BLOCK}: its {BLOCK}-byte block 3 \(bytes {3 * BLOCK}-{4 * BLOCK}\) does not match the "
                           r"checksum in shard-000001.crc32; prepare the store again") as info:
            store.read(10_000 + 3 * BLOCK // 2, 10_000 + 3 * BLOCK // 2 + 8)
    assert isinstance(info.value, PermanentError) and "\n" not in str(info.value)


def test_a_token_past_the_vocabulary_is_refused_on_s3_too(tmp_path, monkeypatch) -> None:
    """A block that matches its checksum but holds an id past the vocabulary (a shard written wrong) is
    named like a local one: shard, byte and the command that prepares it again."""
    summary = write_store(tmp_path / "store", shards=2, tokens_per_shard=10_000, sparse=False)
    shard = Path(summary["url"]) / "shard-000001.bin"
    tokens = np.fromfile(shard, dtype="<u2")
    tokens[1234] = 40_000  # the store's vocabulary is 512
    shard.write_bytes(tokens.tobytes())
    shard.with_suffix(".crc32").write_bytes(remote_module.block_crcs(tokens.tobytes()))
    with moto_s3(monkeypatch, "data") as options:
        url = _upload(Path(summary["url"]), options, "s")
        store = TokenStore(url, options, reading=ReadSettings(local_cache_dir=str(tmp_path / "c"), read_timeout_s=10))
        assert np.array_equal(store.read(10_000, 11_234), tokens[:1234])
        with pytest.raises(CorruptTokens, match=r"^data.source: shard s3://data/s/shard-000001.bin is corrupt at byte offset "
                           "2468: token id 40000 is outside the tokenizer's vocabulary of 512; prepare the store again") as info:
            store.read(11_000, 11_300)
    assert isinstance(info.value, PermanentError) and "\n" not in str(info.value)


def test_a_cache_bound_smaller_than_one_read_is_one_line(tmp_path, monkeypatch) -> None:
    summary = write_store(tmp_path / "store", shards=2, tokens_per_shard=10_000, sparse=False)
    with moto_s3(monkeypatch, "data") as options:
        url = _upload(Path(summary["url"]), options, "s")
        with pytest.raises(ConfigError, match=r"^data.cache_max_bytes=1000 is smaller than one checked block \(1024 bytes\)") as info:
            TokenStore(url, options, reading=ReadSettings(cache_max_bytes=1000, local_cache_dir=str(tmp_path / "c")))
        assert "\n" not in str(info.value)
        store = TokenStore(url, options, reading=ReadSettings(cache_max_bytes=12 * BLOCK, local_cache_dir=str(tmp_path / "c")))
        with pytest.raises(ConfigError, match=r"^data.cache_max_bytes=12288 is smaller than one read \(16384 bytes of "
                           r"s3://data/s/shard-000000.bin\); raise it") as info:
            store.read(0, 8000)


def test_storage_that_stops_answering_is_named_in_one_line(tmp_path, monkeypatch) -> None:
    summary = write_store(tmp_path / "store", shards=4, tokens_per_shard=10_000, sparse=False)
    with moto_s3(monkeypatch, "data") as options:
        url = _upload(Path(summary["url"]), options, "s")
        store = TokenStore(url, options, reading=ReadSettings(local_cache_dir=str(tmp_path / "c"), read_timeout_s=2))
        store.read(0, 100)
    # The endpoint is gone: every request is refused.
    with pytest.raises(StorageUnavailable, match=r"^data.source: s3://data/s/shard-00000\d\.bin \(or its \.crc32 list\) did not answer for 2s") as info:
        store.read(25_000, 25_100)
    assert "\n" not in str(info.value)


def test_an_endpoint_that_accepts_and_never_answers_is_named_in_one_line(tmp_path, monkeypatch) -> None:
    """A black hole (connections accepted, no reply ever): per-request timeouts end every try, the
    retries end at data.read_timeout_s, and the run gets one line, not a hang."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with black_hole() as (port, held):
        options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"}}
        with pytest.raises(StorageUnavailable, match=r"^data.source: s3://data/store did not answer for 2s \(Read timeout") as info:
            TokenStore("s3://data/store", options, reading=ReadSettings(read_timeout_s=2, local_cache_dir=str(tmp_path)))
        # One of meshtrain's tries fills the 2 s budget: s3fs's five, one connection each.
        assert 1 <= len(held) <= 5, len(held)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("lists", ["legacy", "none"])
def test_stores_prepared_by_earlier_versions_are_read_as_they_were_written(lists, tmp_path, monkeypatch) -> None:
    """A store with the first ranged reader's 64 KiB .crc lists is read in 64 KiB blocks; one with no
    lists in whole shards checked by sha256. Either way the tokens are the local ones, and the store's
    kind is learnt once: later reads make no failed requests."""
    summary = write_store(tmp_path / "store", shards=4, tokens_per_shard=50_000, sparse=False)
    folder = Path(summary["url"])
    for shard in sorted(folder.glob("shard-*.bin")):
        shard.with_suffix(".crc32").unlink()
        if lists == "legacy":
            shard.with_suffix(".crc").write_bytes(remote_module.block_crcs(shard.read_bytes(), remote_module.LEGACY_CHECK_BYTES))
    local = TokenStore(summary["url"])
    with moto_s3(monkeypatch, "data") as options:
        url = _upload(folder, options, "s")
        store = TokenStore(url, options, reading=ReadSettings(local_cache_dir=str(tmp_path / "c"), read_timeout_s=10))
        spans = _random_reads(store, 20, seed=3, longest=3000)
        for start, stop in spans:
            assert np.array_equal(store.read(start, stop), local.read(start, stop))
        requests = store.stats()["requests"] - store._opening_requests
        pieces = sum(1 + (a // 50_000 != (b - 1) // 50_000) for a, b in spans)
        if lists == "legacy":  # a failed .crc32 probe, then a round trip of two requests per piece at most
            assert requests == 2 + 2 * (pieces - store.stats()["cache_hits"])
        else:  # failed .crc32 and .crc probes, then each shard once, whole
            touched = len({k for a, b in spans for k in range(a // 50_000, (b - 1) // 50_000 + 1)})
            assert requests == 4 + touched
        downloaded = store.stats()["bytes_downloaded"]
        for start, stop in spans:  # everything is in the node cache now
            assert np.array_equal(store.read(start, stop), local.read(start, stop))
        assert store.stats()["bytes_downloaded"] == downloaded


# --- preflight of an s3:// source ------------------------------------------------------------------

LIVE_KEY, LIVE_SECRET = "AKIAPREFLIGHT0001", "preflightSecret/0002"


def _dry_run(
    tmp_path: Path, options: dict[str, Any], capsys: pytest.CaptureFixture[str], *overrides: str
) -> tuple[int, str]:
    """``pretrain.py --dry-run`` (no Ray) with these data.storage_options: (exit code, stderr)."""
    import yaml

    from meshtrain.cli.pretrain import main

    config = tmp_path / "config.yaml"
    settings = {"data": {"storage_options": options}, "run": {"storage_path": str(tmp_path / "runs")}}
    config.write_text(yaml.safe_dump(settings))
    code = main(["--config", str(config), "--dry-run", *overrides])
    err = capsys.readouterr().err
    for secret in (LIVE_KEY, LIVE_SECRET):
        assert secret not in err
    return code, err


def _with_credentials(options: dict[str, Any]) -> dict[str, Any]:
    return {**options, "key": LIVE_KEY, "secret": LIVE_SECRET}


def test_an_s3_source_that_refuses_denies_or_holds_no_store_is_one_line_before_ray(
    tmp_path, monkeypatch, capsys
) -> None:
    """preflight asks an s3:// data source for its manifest: a refused endpoint, a 403 and a bucket
    without a store are each one line naming the setting, the bucket and endpoint and the error's class
    (exit 2, before Ray starts), and never show a credential; a real store passes."""
    import http.server
    import re

    class Denied(http.server.BaseHTTPRequestHandler):
        def _deny(self) -> None:
            body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            body = b"" if self.command == "HEAD" else body
            self.send_response(403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_HEAD = _deny

        def log_message(self, *args: Any) -> None:
            pass

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    refused = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}", "region_name": "us-east-1"}}
    code, err = _dry_run(tmp_path, _with_credentials(refused), capsys, "data.source=s3://data/store")
    endpoint = refused["client_kwargs"]["endpoint_url"]
    assert code == 2 and err.count("\n") == 1, err
    assert re.match(rf"^meshtrain: config error: data.source: cannot reach s3://data/store \(bucket 'data' at "
                    rf"{endpoint}: EndpointConnectionError: .*\); check the endpoint and bucket in "
                    r"data.storage_options", err)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Denied)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        denied = {"client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        code, err = _dry_run(tmp_path, _with_credentials(denied), capsys,
                             "data.sources=[{source: stdlib}, {source: 's3://data/store'}]")
    finally:
        server.shutdown()
        server.server_close()
    assert code == 2 and err.count("\n") == 1, err
    assert re.match(r"^meshtrain: config error: data.sources.1.source: s3://data/store cannot be read with these "
                    rf"credentials \(bucket 'data' at {endpoint}: PermissionError: .*\); give credentials", err)

    summary = write_store(tmp_path / "store", shards=2, tokens_per_shard=1_000, sparse=False)
    with moto_s3(monkeypatch, "data") as options:
        url = _upload(Path(summary["url"]), options, "s")
        code, err = _dry_run(tmp_path, options, capsys, "data.validation.source=s3://data/elsewhere")
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith("meshtrain: config error: data.validation.source: s3://data/elsewhere holds no token "
                              "store (no manifest.json); fix the bucket and path, or prepare one with "
                              "jobs/prepare_data.py")
        code, err = _dry_run(tmp_path, options, capsys, f"data.source={url}")
        assert code == 0, err


def test_an_s3_source_that_never_answers_fails_preflight_within_its_timeouts(tmp_path, monkeypatch) -> None:
    """A black hole (connections accepted, never answered): preflight's question times out per request
    (data.read_timeout_s / 10, at least 0.2 s, one attempt inside botocore) and s3fs's own tries end, so the launch gets one line and
    the endpoint saw a bounded number of connections."""
    from meshtrain.cluster.preflight import preflight
    from meshtrain.config.loading import load_config

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    cfg = load_config(None, [f"run.storage_path={tmp_path}", "data.source=s3://data/store", "data.read_timeout_s=2"])
    with black_hole() as (port, held):
        cfg.data.storage_options = _with_credentials(
            {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"}})
        with pytest.raises(ConfigError, match=r"^data.source: s3://data/store did not answer \(bucket 'data' at "
                           r"http://127.0.0.1:\d+: ReadTimeoutError: .*\); check the endpoint in data.storage_options "
                           r"and that it is up, or raise data.read_timeout_s \(now 2\)$") as info:
            preflight(cfg)
    # One question, which s3fs tries 5 times, one connection each: a bounded count, not a wait without end.
    assert 1 <= len(held) <= 5 and LIVE_SECRET not in str(info.value)
