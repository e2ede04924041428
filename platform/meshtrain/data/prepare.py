"""Tokenize a source into a token store: one task per unit, resumable, independent of parallelism.

Every unit becomes exactly one shard, encoded on its own, so the bytes of each shard depend only on
the unit's documents and the tokenizer, never on how many tasks ran at once or in which order they
finished. A unit whose shard record is already in the store, with a shard of the recorded size, is
not redone; the manifest is written last, after every shard is in place.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshtrain.config import ConfigError, one_line, redact_url
from meshtrain.data.remote import BlockCrcs, crc_name
from meshtrain.data.sources import ReadProgress, SourcePlan, Unit, unit_documents
from meshtrain.data.location import StoreLocation
from meshtrain.data.store import read_manifest, write_index
from meshtrain.data.store_format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PLAN,
    TOKENIZER,
    Manifest,
    ShardRecord,
    manifest_text,
    shard_name,
    store_fingerprint,
    token_dtype,
)
from meshtrain.data.tokenizer import eos_token_id, tokenizer_sha256

ENCODE_BATCH = 256
# The most characters encoded in one call, and in one batch: the tokenizer holds ~170 bytes per
# character while it encodes (measured: 1M characters, 180 MiB), so a 200 MB JSON Lines record encoded
# whole took tens of GB and was killed. Longer documents are read in parts and encoded in pieces (see
# document_pieces), so no task holds a whole long document either.
PIECE_CHARS = 1_000_000
# How often a running task reports its progress (bytes read, tokens) at most: cheap next to encoding;
# and how often a Ray prepare's driver wakes while its tasks run, to show their progress.
REPORT_INTERVAL_S = 1.0
DRIVER_WAKE_S = 1.0
# A Ray prepare starts its progress board (an actor: one more worker process, about a second of a CPU)
# once it has run this long, or after progress_interval_s where that is shorter; until a task finds it
# (by name) it looks every BOARD_LOOKUP_S.
BOARD_AFTER_S = 10.0
BOARD_LOOKUP_S = 2.0
# Tokenizer threads in a prepare task: one per Ray CPU, so 1 vs N CPUs means what it says.
TASK_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def _record_name(index: int) -> str:
    return shard_name(index).replace(".bin", ".json")


def _unit_key(plan: SourcePlan, unit: Unit, tokenizer_hash: str, limit: int | None) -> str:
    text = json.dumps([FORMAT_VERSION, plan.fingerprint, plan.field, unit.model_dump(), tokenizer_hash, limit])
    return hashlib.sha256(text.encode()).hexdigest()


def store_key(plan: SourcePlan, tokenizer_hash: str, unit_bytes: int) -> str:
    """Cache key of the store a source + tokenizer + format prepare into."""
    source = plan.source.model_dump(exclude={"weight"})
    units = [unit.model_dump(exclude={"files"}) for unit in plan.units]  # how it is cut into shards
    text = json.dumps([FORMAT, FORMAT_VERSION, source, plan.fingerprint, tokenizer_hash, unit_bytes, units], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def document_pieces(parts: Iterable[str], limit: int = PIECE_CHARS) -> Iterator[tuple[str, bool]]:
    """The text given as consecutive ``parts`` in consecutive pieces of at most ``limit`` characters
    (one piece when it fits), each with whether it is the last; at most about ``limit`` characters plus
    one part are held at once.

    A long document is split rather than refused: a book or a dump of code is data a user means to
    train on, and a bound that refused it would leave them to cut their corpus by hand. Each cut goes
    before a space that follows a non-space character, the last one in the piece's second half: the
    byte-level pre-tokenizer splits the text there anyway (its words take their leading space), so the
    pieces encode to exactly the whole document's tokens. A second half without such a space (base64,
    text without spaces) is cut at ``limit``, where the tokens of the few characters around the cut may
    differ from those of the whole document's encoding. The cuts depend on the text alone, never on how
    it was parted.
    """
    rest, more, floor = "", iter(parts), limit // 2
    while True:
        while len(rest) <= limit and (part := next(more, None)) is not None:
            rest = rest + part if rest else part
        if len(rest) <= limit:
            yield rest, True
            return
        cut = rest.rfind(" ", floor + 1, limit)
        while cut > floor and rest[cut - 1].isspace():
            cut = rest.rfind(" ", floor + 1, cut)
        cut = cut if cut > floor else limit
        yield rest[:cut], False
        rest = rest[cut:]


def _template_trimmed(encoding: Any, first: bool, last: bool) -> list[int]:
    """The ids of one piece of a split document, without the special tokens the tokenizer's template
    adds (a beginning-of-text token, say) where the piece does not begin or end its document."""
    ids, mask = encoding.ids, encoding.special_tokens_mask  # content tokens are 0 in the mask, even special ones
    begin, end = 0, len(ids)
    if not first:
        while begin < end and mask[begin]:
            begin += 1
    if not last:
        while end > begin and mask[end - 1]:
            end -= 1
    return ids[begin:end]


def tokenize_unit(
    plan: SourcePlan, unit: Unit, tokenizer_json: str, url: str, storage_options: dict[str, Any],
    limit: int | None = None, report: Callable[[int, int], None] | None = None,
) -> ShardRecord:
    """Encode one unit's documents (each followed by the end-of-document token) into its shard.

    At most ``PIECE_CHARS`` characters are encoded at once, and a document is read in parts
    (:func:`unit_documents`) and cut into pieces as it is read (:func:`document_pieces`), so what a task
    holds beside its tokens is bounded whatever its documents' length: pieces are encoded in order, the
    end-of-document token after a document's last piece only; a batch holds up to ``ENCODE_BATCH``
    documents. The tokens are kept as one compact array per batch and written to the shard from there.
    ``report(source bytes read, tokens)`` is called every ``REPORT_INTERVAL_S`` or so while it runs
    (prepare's progress line), between batches.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    dtype = token_dtype(tokenizer.get_vocab_size()).newbyteorder("<")
    end_of_document = np.asarray([eos_token_id(tokenizer)], dtype=dtype)
    arrays: list[np.ndarray] = []  # the tokens, one array per encoded batch
    tokens = documents = 0
    batch: list[str] = []
    places: list[tuple[bool, bool]] = []  # per batch entry: (first piece, last piece) of its document
    batched = 0  # characters in the batch

    read = ReadProgress()
    reported = time.monotonic()

    def flush() -> None:
        nonlocal batched, tokens, reported
        encoded = []
        for encoding, (first, last) in zip(tokenizer.encode_batch(batch), places):
            ids = encoding.ids if first and last else _template_trimmed(encoding, first, last)
            encoded.append(np.asarray(ids, dtype=dtype))
            if last:
                encoded.append(end_of_document)
        if encoded:
            arrays.append(np.concatenate(encoded))
            tokens += len(arrays[-1])
        batch.clear()
        places.clear()
        batched = 0
        if report is not None and time.monotonic() - reported >= REPORT_INTERVAL_S:
            report(read.bytes, tokens)
            reported = time.monotonic()

    texts = unit_documents(plan, unit, read)
    while limit is None or documents < limit:
        document = next(texts, None)
        if document is None:
            break
        documents += 1
        first = True
        for piece, last in document_pieces(document, PIECE_CHARS):
            if batch and (batched + len(piece) > PIECE_CHARS or len(batch) == ENCODE_BATCH):
                flush()
            batch.append(piece)
            places.append((first, last))
            batched += len(piece)
            first = False
    flush()
    texts.close()
    location = StoreLocation(url, storage_options)
    name = shard_name(unit.index)
    digest, crcs = hashlib.sha256(), BlockCrcs()

    def shard_bytes() -> Iterator[memoryview]:
        for array in arrays:
            data = array.data.cast("B")
            digest.update(data)
            crcs.update(data)
            yield data

    location.write_parts(name, shard_bytes())
    location.write_bytes(crc_name(name), crcs.digest())  # remote readers check every block they fetch
    record = ShardRecord(
        file=name,
        unit=_unit_key(plan, unit, tokenizer_sha256(tokenizer_json), limit),
        tokens=tokens,
        documents=documents,
        sha256=digest.hexdigest(),
        source_bytes=read.bytes,
    )
    location.write_text(_record_name(unit.index), record.model_dump_json())
    return record


def _finished_records(location: StoreLocation, keys: dict[int, str], itemsize: int) -> dict[int, ShardRecord]:
    """The records of shards an earlier prepare finished, by unit index: a record whose unit key is
    the unit's and whose shard holds the recorded bytes.

    The shard is not read again: its record is written only after the shard itself is in place
    (renamed into place locally, one whole-object upload remotely), and its checksum was taken from
    the bytes written, so a record proves a complete shard. A shard damaged later is caught where it
    is read (remote copies are checked against the checksum) or by ``verify_store``. Sizes come from
    one listing and the records are fetched together, so resuming a 60,000-shard prepare costs a
    listing and a batch of small reads, not a read of every shard.
    """
    sizes = location.sizes()
    names = {index: _record_name(index) for index in keys if _record_name(index) in sizes}
    if not names:
        return {}
    contents = location.fs.cat([location.path(name) for name in names.values()])
    finished = {}
    for index, name in names.items():
        try:
            record = ShardRecord.model_validate_json(contents[location.path(name)])
        except ValueError:
            continue
        if record.unit == keys[index] and sizes.get(record.file) == record.tokens * itemsize:
            finished[index] = record
    return finished


@dataclass
class PrepareReport:
    manifest: Manifest
    url: str
    seconds: float
    reused_shards: int
    prepared_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.prepared_tokens / self.seconds if self.seconds > 0 else 0.0


class _Progress:
    """A progress line for prepare: rewritten in place on a terminal, throttled otherwise (one line every
    ``interval_s``, and the last). It counts finished shards and, inside the running units, the source
    bytes read and the tokens encoded that their tasks reported, so a long unit moves the line too."""

    def __init__(self, units: tuple[Unit, ...], interval_s: float) -> None:
        self.total, self.source_bytes, self.interval_s = len(units), sum(unit.bytes for unit in units), interval_s
        self.done = self.read = self.tokens = self.reused_tokens = 0
        self.running: dict[str, tuple[int, int]] = {}  # by shard file: (bytes read, tokens) reported
        self.started = self.last = time.perf_counter()
        self.tty = sys.stdout.isatty()

    def due(self) -> bool:
        return self.tty or time.perf_counter() - self.last >= self.interval_s

    def update(self, record: ShardRecord, reused: bool = False) -> None:
        """A shard is in place (``reused``: from an earlier prepare)."""
        self.done += 1
        self.read += record.source_bytes
        self.tokens += record.tokens
        self.reused_tokens += record.tokens if reused else 0
        self.running.pop(record.file, None)
        self._show(self.done == self.total)

    def report(self, reports: dict[int, tuple[int, int]]) -> None:
        """What the tasks of the units running now (by index) last reported: (source bytes read, tokens)."""
        self.running = {shard_name(index): figures for index, figures in reports.items()}
        self._show(False)

    def _show(self, last: bool) -> None:
        now = time.perf_counter()
        if not last and not self.due():
            return
        self.last = now
        tokens = self.tokens + sum(tokens for _, tokens in self.running.values())
        rate = (tokens - self.reused_tokens) / max(now - self.started, 1e-9)
        read = "" if not self.source_bytes else (
            f"{_size(self.read + sum(read for read, _ in self.running.values()))} of {_size(self.source_bytes)} read, ")
        line = f"[meshtrain] prepare: {self.done}/{self.total} shards, {read}{tokens:,} tokens, {rate:,.0f} tok/s"
        print(f"\r{line}" if self.tty else line, end="" if self.tty and not last else "\n", flush=True)


def _size(count: int) -> str:
    """Bytes as 31.2 kB, 812.3 MB or 1.24 GB (powers of 10, as file managers show them)."""
    if count >= 1e9:
        return f"{count / 1e9:.2f} GB"
    return f"{count / 1e6:.1f} MB" if count >= 1e6 else f"{count / 1e3:.1f} kB"


def prepare_store(
    plan: SourcePlan,
    tokenizer_json: str,
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    use_ray: bool = True,
    max_parallel: int | None = None,
    progress_interval_s: float = 30.0,
    on_shard: Callable[[ShardRecord], None] | None = None,
) -> PrepareReport:
    """Prepare (or finish, or reuse) the store of ``plan`` encoded with ``tokenizer_json`` at ``url``.

    ``max_parallel`` bounds the Ray tasks in flight (default: as many as Ray will run). A source
    with ``max_documents`` and one document per row is read in order in this process.
    """
    started = time.perf_counter()
    storage_options = dict(storage_options or {})
    location = StoreLocation(url, storage_options)
    tokenizer_hash = tokenizer_sha256(tokenizer_json)
    plan_text = json.dumps(
        {"format": FORMAT, "version": FORMAT_VERSION, "source": plan.describe(), "tokenizer_sha256": tokenizer_hash},
        indent=1,
    )
    if location.exists(MANIFEST):
        manifest = read_manifest(location)
        if manifest.source_fingerprint != plan.fingerprint or manifest.tokenizer_sha256 != tokenizer_hash:
            raise ConfigError(
                f"data.cache_dir: {location.url} already holds a store of another source or tokenizer; "
                "choose another output folder (nothing was changed)"
            )
        return PrepareReport(manifest, location.url, time.perf_counter() - started, len(manifest.shards), 0)
    if location.exists(PLAN) and location.read_text(PLAN) != plan_text:
        raise ConfigError(
            f"data.cache_dir: {location.url} holds an unfinished prepare of another source or tokenizer; "
            "choose another output folder or remove that one"
        )
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    dtype = token_dtype(tokenizer.get_vocab_size())
    location.write_text(PLAN, plan_text)
    location.write_text(TOKENIZER, tokenizer_json)

    sequential_limit = plan.source.max_documents if plan.loader not in {"text"} else None
    records: dict[str, ShardRecord] = {}  # by shard file
    if sequential_limit is None:
        keys = {unit.index: _unit_key(plan, unit, tokenizer_hash, None) for unit in plan.units}
        records = {record.file: record for record in _finished_records(location, keys, dtype.itemsize).values()}
    todo = [unit for unit in plan.units if shard_name(unit.index) not in records]
    reused = len(records)
    progress = _Progress(plan.units, progress_interval_s)
    for record in records.values():
        progress.update(record, reused=True)

    def finished(record: ShardRecord) -> None:
        records[record.file] = record
        progress.update(record)
        if on_shard is not None:
            on_shard(record)

    def reporter(unit: Unit) -> Callable[[int, int], None]:
        return lambda read, tokens: progress.report({unit.index: (read, tokens)})

    if sequential_limit is not None:
        remaining = sequential_limit
        for unit in todo:
            record = tokenize_unit(plan, unit, tokenizer_json, location.url, storage_options, remaining, reporter(unit))
            remaining -= record.documents
            finished(record)
    elif use_ray and todo:
        _run_on_ray(plan, todo, tokenizer_json, location.url, storage_options, max_parallel, finished, progress)
    else:
        for unit in todo:
            finished(tokenize_unit(plan, unit, tokenizer_json, location.url, storage_options, None, reporter(unit)))

    shards = tuple(records[shard_name(unit.index)] for unit in plan.units)
    manifest = Manifest(
        format=FORMAT,
        version=FORMAT_VERSION,
        complete=True,
        dtype=dtype.name,
        vocab_size=tokenizer.get_vocab_size(),
        eos_id=eos_token_id(tokenizer),
        tokenizer_sha256=tokenizer_hash,
        source=plan.describe(),
        source_fingerprint=plan.fingerprint,
        documents=sum(s.documents for s in shards),
        tokens=sum(s.tokens for s in shards),
        shards=shards,
        fingerprint=store_fingerprint(dtype.name, tokenizer_hash, shards),
    )
    if manifest.documents == 0:
        raise ConfigError(f"data.source: {redact_url(plan.source.source)!r} holds no documents; point it at files with text")
    text = manifest_text(manifest)
    write_index(location, manifest, len(text.encode()))  # derived from the manifest, so written before it
    location.write_text(MANIFEST, text)
    prepared = sum(records[shard_name(u.index)].tokens for u in todo)
    return PrepareReport(manifest, location.url, time.perf_counter() - started, reused, prepared)


# Tries of a unit whose task ended without an answer (killed for memory, its worker or node lost). Ray's
# own retries are off: it retries a task its memory monitor kills without end ("infinite oom retries").
TASK_TRIES = 3


def _run_on_ray(
    plan: SourcePlan,
    units: list[Unit],
    tokenizer_json: str,
    url: str,
    storage_options: dict[str, Any],
    max_parallel: int | None,
    finished: Callable[[ShardRecord], None],
    progress: _Progress,
) -> None:
    """Every unit on Ray, at most ``max_parallel`` at once. An error a task raises (bad data) ends the
    prepare at once, never retried; a task that died is tried again, ``TASK_TRIES`` times in all, then
    the prepare ends with one line naming its shard. Shards already written stay for the next run.
    The tasks report their progress to a small actor (started after ``BOARD_AFTER_S``), read when the
    progress line is due."""
    import ray

    from meshtrain.config import config_error_in

    task = ray.remote(tokenize_unit).options(
        num_cpus=1, runtime_env={"env_vars": TASK_ENV}, max_retries=0, retry_exceptions=False,
    )
    died = (ray.exceptions.OutOfMemoryError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
            ray.exceptions.LocalRayletDiedError)
    plan_ref, tokenizer_ref = ray.put(plan), ray.put(tokenizer_json)
    board: Any = None
    asked: Any = None  # the board's answer, while awaited
    started, board_name = time.perf_counter(), f"meshtrain-prepare-progress-{uuid.uuid4().hex}"
    waiting = list(units)
    running: dict[Any, Unit] = {}
    tries: dict[int, int] = {}
    limit = max_parallel or len(units)
    try:
        while waiting or running:
            while waiting and len(running) < limit:
                unit = waiting.pop(0)
                tries[unit.index] = tries.get(unit.index, 0) + 1
                report = _BoardReport(board_name, unit.index, tries[unit.index])
                running[task.remote(plan_ref, unit, tokenizer_ref, url, storage_options, None, report)] = unit
            if board is None and time.perf_counter() - started >= min(BOARD_AFTER_S, progress.interval_s):
                board = ray.remote(_ProgressBoard).options(name=board_name, num_cpus=0).remote()
            done, _ = ray.wait(list(running), num_returns=1, timeout=DRIVER_WAKE_S)
            if not done:  # never waits on the board: a slow answer is taken a second later
                if asked is not None and ray.wait([asked], num_returns=1, timeout=0)[0]:
                    reports = _running_reports(ray, asked, running.values(), tries)
                    asked = None
                    if reports is not None:
                        progress.report(reports)
                if board is not None and asked is None and progress.due():
                    asked = board.read.remote()
                continue
            unit = running.pop(done[0])
            try:
                record = ray.get(done[0])
            except died as exc:
                if tries[unit.index] >= TASK_TRIES:
                    out_of_memory = isinstance(exc, ray.exceptions.OutOfMemoryError)
                    raise _task_died(unit, tries[unit.index], exc, out_of_memory) from None
                waiting.insert(0, unit)
                continue
            finished(record)
    except BaseException as exc:
        for ref in running:
            ray.cancel(ref)
        if isinstance(exc, ray.exceptions.RayTaskError):
            raise config_error_in(exc) or exc from None
        raise
    finally:
        try:
            if board is not None:
                ray.kill(board)
        except Exception:  # Ray going down takes the actor with it
            pass


class _ProgressBoard:
    """A Ray actor: what each running prepare task last reported, by unit index: (try, bytes read, tokens)."""

    def __init__(self) -> None:
        self.reports: dict[int, tuple[int, int, int]] = {}

    def report(self, index: int, attempt: int, read: int, tokens: int) -> None:
        self.reports[index] = (attempt, read, tokens)

    def read(self) -> dict[int, tuple[int, int, int]]:
        return self.reports


class _BoardReport:
    """A task's ``report``: one message to the progress board, not waited for. The driver starts the board
    only once the prepare has run ``BOARD_AFTER_S`` (a short prepare never pays for its worker process),
    so a task looks it up by name, at most every ``BOARD_LOOKUP_S``, until it is there."""

    def __init__(self, name: str, index: int, attempt: int) -> None:
        self.name, self.index, self.attempt = name, index, attempt
        self._board: Any = None
        self._looked = -math.inf

    def __call__(self, read: int, tokens: int) -> None:
        if self._board is None:
            if time.monotonic() - self._looked < BOARD_LOOKUP_S:
                return
            self._looked = time.monotonic()
            import ray

            try:
                self._board = ray.get_actor(self.name)
            except Exception:  # not started yet (ValueError), or gone: progress never fails a task
                return
        try:
            self._board.report.remote(self.index, self.attempt, read, tokens)
        except Exception:  # the board is gone (the driver ended it): look it up again later
            self._board = None


def _running_reports(
    ray: Any, answer: Any, running: Iterable[Unit], tries: dict[int, int],
) -> dict[int, tuple[int, int]] | None:
    """(bytes read, tokens) of the running units, from their current tries' reports in the board's
    ``answer``; None where the board failed (progress only: the shards still count when they finish)."""
    try:
        reports = ray.get(answer)
    except Exception:
        return None
    indexes = {unit.index for unit in running}
    return {index: (read, tokens) for index, (attempt, read, tokens) in reports.items()
            if index in indexes and attempt == tries.get(index)}


def _task_died(unit: Unit, tries: int, exc: BaseException, out_of_memory: bool) -> ConfigError:
    """The one line that ends a prepare whose task for ``unit`` died ``tries`` times."""
    if unit.hub_shard is not None:
        place = f"hub shard {unit.hub_shard}"
    elif unit.start is not None:
        place = f"{unit.files[0]} bytes {unit.start}-{unit.end}"
    else:
        place = unit.files[0] + (f" and {len(unit.files) - 1} more files" if len(unit.files) > 1 else "")
    what = "was killed for lack of memory" if out_of_memory else "died"
    return ConfigError(
        f"data.source: the task preparing {shard_name(unit.index)} ({place}) {what} {tries} times "
        f"({one_line(exc, limit=160)}); {'' if out_of_memory else 'if it ran out of memory, '}lower "
        f"data.prepare_unit_bytes (this unit holds {unit.bytes / 2**20:.1f} MiB of source), run fewer tasks at once "
        "(jobs/prepare_data.py --max-parallel) or give the nodes more memory; the shards written are kept"
    )
