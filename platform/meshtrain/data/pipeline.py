"""The data of a run: prepared once on the driver's side, opened by every worker.

``prepare_data`` (driver) resolves the tokenizer, prepares or re-uses a token store for every raw
source (cached under ``data.cache_dir`` by the fingerprint of source + tokenizer + format) and
returns a small :class:`DataPlan`; ``open_data`` (each worker) maps the stores and builds the
training and validation samples. Nothing corpus-sized passes through Ray.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshtrain.config import ConfigError, DataConfig, SourceConfig, redact_url, source_labels
from meshtrain.data.prepare import prepare_store, store_key
from meshtrain.data.sampling import MixtureSamples, PackedSequences, Samples, window_count
from meshtrain.data.skips import SkipRange
from meshtrain.data.stages import DataStage, StagedSamples, unstaged
from meshtrain.data.schemes import SAMPLING_SCHEME
from meshtrain.data.splits import SpanSplit, WholeStream, validation_split
from meshtrain.data.validation import ValidationPart, ValidationSet
from meshtrain.data.sources import SourcePlan, plan_source
from meshtrain.data.location import ReadSettings, StoreLocation
from meshtrain.data.store import TokenStore, is_token_store, read_manifest, write_index
from meshtrain.data.store_format import FORMAT, FORMAT_VERSION, TOKENIZER
from meshtrain.data.tokenizer import (
    eos_token_id,
    load_tokenizer_file,
    sample_documents,
    tokenizer_sha256,
    train_tokenizer,
)


@dataclass(frozen=True)
class StoreRef:
    url: str
    weight: float
    fingerprint: str
    tokens: int
    documents: int
    name: str = "source"  # the source's label in per-source validation metrics


@dataclass(frozen=True)
class DataPlan:
    """What workers need to open a run's data: store locations and the tokenizer, nothing more."""

    stores: tuple[StoreRef, ...]
    tokenizer_json: str
    vocab_size: int
    eos_id: int
    validation_fraction: float = 0.0
    validation: StoreRef | None = None
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)  # credentials: Ray shows str(plan)
    sampling: str = SAMPLING_SCHEME  # the order and split scheme (a resumed run keeps its checkpoints')
    validation_span_tokens: int = 65536
    reading: ReadSettings = field(default_factory=ReadSettings)  # how workers read remote stores

    @property
    def fingerprint(self) -> str:
        """One id for the training data: every store's content fingerprint and weight, and the split."""
        parts = [[s.fingerprint, s.weight] for s in self.stores]
        split: Any = self.validation.fingerprint if self.validation else self.validation_fraction
        if self.validation is None and self.validation_fraction and self.sampling == SAMPLING_SCHEME:
            split = [self.validation_fraction, self.validation_span_tokens]  # spans decide what trains
        return hashlib.sha256(json.dumps([parts, split]).encode()).hexdigest()

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.stores)

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.stores)


def tokenizer_cache_key(plans: list[SourcePlan], weights: list[float], vocab_size: int, sample_bytes: int) -> str:
    text = json.dumps([FORMAT, FORMAT_VERSION, [p.fingerprint for p in plans], weights, vocab_size, sample_bytes])
    return hashlib.sha256(text.encode()).hexdigest()


def _train_tokenizer_task(plans: list[SourcePlan], weights: list[float], vocab_size: int, sample_bytes: int) -> str:
    return train_tokenizer(sample_documents(plans, weights, sample_bytes), vocab_size).to_str()


def _resolve_tokenizer(
    data: DataConfig,
    raw: list[tuple[SourceConfig, SourcePlan]],
    store_tokenizers: dict[str, str],
    cache: StoreLocation,
    run_tokenizer: str | None,
    use_ray: bool,
) -> str:
    """The tokenizer every store of the run is encoded with."""
    if store_tokenizers:
        hashes = {tokenizer_sha256(text) for text in store_tokenizers.values()}
        if len(hashes) > 1:
            raise ConfigError(
                f"data.sources: the token stores {', '.join(store_tokenizers)} were encoded with different tokenizers; "
                "prepare them with one tokenizer"
            )
        text = next(iter(store_tokenizers.values()))
        if data.tokenizer != "train" and tokenizer_sha256(load_tokenizer_file(data.tokenizer).to_str()) != tokenizer_sha256(text):
            raise ConfigError(
                f"data.tokenizer: {data.tokenizer!r} is not the tokenizer the token store was encoded with; "
                "prepare the store again with it (jobs/prepare_data.py data.tokenizer=<that file>), or, when "
                "model.init_from is unset, leave data.tokenizer=train to use the store's own"
            )
        return text
    if run_tokenizer is not None:
        return run_tokenizer
    if data.tokenizer != "train":
        return load_tokenizer_file(data.tokenizer).to_str()
    plans = [plan for _, plan in raw]
    weights = [source.weight for source, _ in raw]
    key = tokenizer_cache_key(plans, weights, data.vocab_size, data.tokenizer_sample_bytes)
    name = f"tokenizers/{key[:24]}.json"
    if cache.exists(name):
        return cache.read_text(name)
    if use_ray:
        import ray

        from meshtrain.config import config_error_in

        task = ray.remote(_train_tokenizer_task).options(num_cpus=1)
        try:
            text = ray.get(task.remote(plans, weights, data.vocab_size, data.tokenizer_sample_bytes))
        except ray.exceptions.RayTaskError as exc:
            raise config_error_in(exc) or exc from None
    else:
        text = _train_tokenizer_task(plans, weights, data.vocab_size, data.tokenizer_sample_bytes)
    cache.write_text(name, text)
    return text


def prepare_data(
    data: DataConfig,
    cache_url: str,
    seq_len: int,
    *,
    run_tokenizer: str | None = None,
    use_ray: bool = True,
    log: Callable[[str], None] = print,
    progress_interval_s: float = 30.0,
    max_parallel: int | None = None,
) -> DataPlan:
    """Make sure every source has a complete token store and say where they are."""
    options = data.storage_options
    cache = StoreLocation(cache_url, options)
    entries: list[tuple[SourceConfig, bool]] = [(s, False) for s in data.source_list()]
    validation_source = data.validation_source()
    if validation_source is not None:
        entries.append((validation_source, True))
    labels = source_labels([source for source, _ in entries])
    raw: list[tuple[SourceConfig, SourcePlan]] = []
    store_tokenizers: dict[str, str] = {}
    for source, _ in entries:
        if is_token_store(source.source, options):
            store_tokenizers[source.source] = StoreLocation(source.source, options).read_text(TOKENIZER)
        else:
            raw.append((source, plan_source(source, data.prepare_unit_bytes)))
    tokenizer_json = _resolve_tokenizer(data, raw, store_tokenizers, cache, run_tokenizer, use_ray)
    plans = dict((id(source), plan) for source, plan in raw)

    refs: list[StoreRef] = []
    for (source, _), label in zip(entries, labels):
        plan = plans.get(id(source))
        if plan is None:
            url = source.source
        else:
            url = f"{cache.url}/{store_key(plan, tokenizer_sha256(tokenizer_json), data.prepare_unit_bytes)[:24]}"
            report = prepare_store(
                plan, tokenizer_json, url, options, use_ray=use_ray, max_parallel=max_parallel,
                progress_interval_s=progress_interval_s,
            )
            if report.prepared_tokens:
                log(
                    f"[meshtrain] prepared {redact_url(source.source)!r}: {report.manifest.tokens:,} tokens in "
                    f"{len(report.manifest.shards)} shards ({report.reused_shards} re-used), {report.seconds:.1f}s "
                    f"({report.tokens_per_s:,.0f} tok/s) -> {url}"
                )
        location = StoreLocation(url, options)
        manifest = read_manifest(location)
        write_index(location, manifest)  # a store prepared before the index existed gets one here
        if manifest.tokenizer_sha256 != tokenizer_sha256(tokenizer_json):
            raise ConfigError(f"data.source: {url} was encoded with another tokenizer than this run's; prepare it again")
        if manifest.tokens < seq_len + 1:
            raise ConfigError(
                f"data.source: {redact_url(source.source)!r} holds {manifest.tokens} tokens, fewer than data.seq_len+1="
                f"{seq_len + 1}; add documents or lower data.seq_len"
            )
        refs.append(StoreRef(url, source.weight, manifest.fingerprint, manifest.tokens, manifest.documents, label))

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    validation = refs.pop() if validation_source is not None else None
    return DataPlan(
        stores=tuple(refs),
        tokenizer_json=tokenizer_json,
        vocab_size=tokenizer.get_vocab_size(),
        eos_id=eos_token_id(tokenizer),
        validation_fraction=data.validation.fraction,
        validation=validation,
        storage_options=dict(options),
        validation_span_tokens=data.validation.span_tokens,
        reading=ReadSettings(cache_max_bytes=data.cache_max_bytes, local_cache_dir=data.local_cache_dir,
                             read_timeout_s=data.read_timeout_s),
    )


@dataclass
class TrainingData:
    """What a worker trains and validates on; ``fingerprint`` and ``sampling`` go into every checkpoint."""

    train: Samples
    validation: ValidationSet | None
    vocab_size: int
    fingerprint: str
    sampling: str = SAMPLING_SCHEME
    eos_id: int | None = None  # the end-of-document token, where model.document_mask splits windows
    source_names: tuple[str, ...] = ()  # the training sources' labels, in the mixture's order


def _windows_of_length(stores: Sequence[TokenStore], components: Sequence[PackedSequences], length: int,
                       seed: int) -> list[PackedSequences]:
    """Each source's training windows of ``length`` tokens (a data.stages stage's own seq_len), holding out
    the same token spans as its windows of data.seq_len: a held-out span of ``span_windows x seq_len``
    tokens is one of ``span_windows x seq_len / length`` windows of this length, over as many spans, in the
    same order."""
    windows = []
    for index, (store, base) in enumerate(zip(stores, components)):
        split = None
        if isinstance(base.split, SpanSplit):
            span = base.split.span_windows * base.seq_len
            if span % length:
                raise ConfigError(
                    f"data.stages: a stage's seq_len={length} does not divide the held-out validation spans of "
                    f"{span} tokens; set data.validation.span_tokens to a multiple of {length} (or hold out "
                    "validation by data.validation.source)"
                )
            split = SpanSplit.at_length(base.split, window_count(store, length), span // length)
        elif base.split is not None:
            raise ConfigError(
                f"data.stages: a stage's own seq_len needs the {SAMPLING_SCHEME} sampling scheme (this run's "
                f"checkpoints were trained with {base.scheme}); leave seq_len unset or use another run.name"
            )
        own_seed = (seed, length) if len(stores) == 1 else (seed, index, length)
        windows.append(PackedSequences(store, length, own_seed, split=split, scheme=base.scheme))
    return windows


def open_data(plan: DataPlan, seq_len: int, seed: int, stages: Sequence[DataStage] = (),
              skips: Sequence[SkipRange] = (), may_skip: bool = False) -> TrainingData:
    """Map every store and build this run's training samples (stage by stage with ``stages``, leaving out
    ``skips``, and able to leave out more while training with ``may_skip``) and validation set."""
    stores = [TokenStore(ref.url, plan.storage_options, reading=plan.reading) for ref in plan.stores]
    for store, ref in zip(stores, plan.stores):
        if store.fingerprint != ref.fingerprint:
            raise ConfigError(
                f"data.source: {ref.url} changed after the driver checked it (fingerprint {store.fingerprint[:12]}, "
                f"expected {ref.fingerprint[:12]}); do not rewrite a store while a run reads it"
            )
    components: list[PackedSequences] = []
    held_out: list[ValidationPart] = []
    for index, (store, ref) in enumerate(zip(stores, plan.stores)):
        windows = window_count(store, seq_len)
        split = validation_split(plan.sampling, windows, plan.validation_fraction, seq_len, plan.validation_span_tokens)
        # One source keeps the plain seed, so its order equals the single-stream order of old.
        component_seed = seed if len(stores) == 1 else (seed, index)
        sequences = PackedSequences(store, seq_len, component_seed, split=split, scheme=plan.sampling)
        components.append(sequences)
        if split is not None:
            held_out.append(ValidationPart(ref.name, sequences, split, plan.eos_id))
    other_lengths = {length: _windows_of_length(stores, components, length, seed)
                     for length in sorted({stage.seq_len for stage in stages if stage.seq_len is not None})}
    train: Samples
    if stages or skips or may_skip:
        train = StagedSamples(components, stages or unstaged([ref.weight for ref in plan.stores]), seed, skips=skips,
                              other_lengths=other_lengths)
    elif len(components) == 1:
        train = components[0]
    else:
        train = MixtureSamples(components, [ref.weight for ref in plan.stores], seed)
    validation = None
    if plan.validation is not None:
        store = TokenStore(plan.validation.url, plan.storage_options, reading=plan.reading)
        sequences = PackedSequences(store, seq_len, seed, scheme=plan.sampling)
        validation = ValidationSet([ValidationPart(plan.validation.name, sequences, WholeStream(window_count(store, seq_len)))])
    elif held_out:
        validation = ValidationSet(held_out)
    return TrainingData(train, validation, plan.vocab_size, plan.fingerprint, plan.sampling, plan.eos_id,
                        tuple(ref.name for ref in plan.stores))
