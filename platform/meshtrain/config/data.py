"""The data section: sources and mixtures, held-out validation data, tokenizer and token-store settings."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from meshtrain.config.redaction import Location, OptionalLocation, StorageOptions
from meshtrain.config.section import MAX_DURATION_S, Section, check_tested_scheme

_SOURCE_HELP = (
    "'stdlib' (the Python standard library's source files, always offline), a local file, directory or "
    "glob of .txt/.jsonl/.json/.parquet files, 'hf:<dataset>' streamed from the Hub, or a prepared token "
    "store (a folder or s3:// URL with a manifest.json)."
)


class SourceConfig(Section):
    """One source of documents (or a prepared token store) and its share of a mixture."""

    source: Location = Field("stdlib", description=_SOURCE_HELP)
    weight: float = Field(1.0, description="Share of training samples drawn from this source (mixtures).")
    text_field: str = Field("text", description="Column holding the document text (jsonl/parquet/hub).")
    hf_config: str | None = Field(None, description="Hub dataset configuration name (hf: sources).")
    split: str = Field("train", description="Dataset split to read (hf: sources).")
    max_documents: int | None = Field(None, gt=0, description="Read at most this many documents.")
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.:-]{1,64}$",
        description="This source's label in per-source validation metrics; default: from the source (file or dataset name).",
    )

    @field_validator("weight")
    @classmethod
    def _positive_weight(cls, value: float) -> float:
        if not value > 0:
            raise ValueError(f"a mixture weight must be a positive finite number, got {value!r}; give e.g. 0.3")
        return value

    def is_hub(self) -> bool:
        return self.source.startswith("hf:")


class StageConfig(Section):
    """One stage of the data: until a step, samples drawn from the named sources in these proportions."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$", description="The stage's label in records, metrics and checkpoints.")
    until_step: int | None = Field(
        None, gt=0, description="The stage's last step (the next starts after it); unset on the last stage = to the end."
    )
    until_tokens: int | None = Field(
        None,
        gt=0,
        description="Instead of until_step: the stage ends with the first step at which the run has trained this many "
        "tokens (train.global_batch_size x each stage's seq_len per step), counted from the run's start.",
    )
    weights: dict[str, float] = Field(
        description="Share of the stage's samples per source, by data.sources[].name; a source left out is not drawn."
    )
    lr_decay_to: float | None = Field(
        None,
        ge=0,
        le=1,
        description="optim.schedule=staged: the stage decays the LR linearly from where it stands at its start to "
        "this ratio of optim.lr by its last step (0: to zero); unset = it holds the LR it starts with.",
    )
    seq_len: int | None = Field(
        None,
        gt=1,
        description="Tokens per sequence in this stage (a long-context stage); unset = data.seq_len. Samples of "
        "another length come from each source's own order at that length, continuing where earlier stages of "
        "that length left it; held-out validation spans stay held out (data.validation.span_tokens must be a "
        "multiple of it).",
    )

    @field_validator("weights")
    @classmethod
    def _some_positive_weight(cls, value: dict[str, float]) -> dict[str, float]:
        bad = next((name for name, weight in value.items() if not (weight >= 0 and math.isfinite(weight))), None)
        if bad is not None:
            raise ValueError(f"weight of {bad!r} is {value[bad]!r}; give a finite number >= 0")
        if not sum(value.values()) > 0:
            raise ValueError("give at least one source a positive weight")
        return value


class SkipConfig(Section):
    """Samples to leave out of training, named by hand (a rollback adds its own in the run folder)."""

    stage: str | None = Field(
        None, description="The data.stages stage whose samples these are; unset in a run without data.stages."
    )
    start: int = Field(ge=0, description="First sample left out, counted in the stage's own sequence of samples.")
    stop: int = Field(gt=0, description="Sample after the last one left out.")

    @model_validator(mode="after")
    def _nonempty(self) -> "SkipConfig":
        if self.stop <= self.start:
            raise ValueError(f"stop={self.stop} must exceed start={self.start} (samples [start, stop) are left out)")
        return self


class ValidationConfig(Section):
    fraction: float = Field(
        0.01,
        ge=0,
        lt=0.5,
        description="Share of each source's windows held out of training for validation (0 = none; "
        "0 when validation.source is set).",
    )
    source: OptionalLocation = Field(
        None, description="A separate validation source (same forms as data.source); all of it is held out."
    )
    text_field: str = Field("text", description="Text column of validation.source.")
    span_tokens: int = Field(
        65536,
        gt=0,
        description="Held-out data comes in spans of this many consecutive tokens (at least one span; shorter only "
        "where a span would exceed 8x the fraction of a small corpus); only documents wholly inside a span are "
        "scored, so raise it for corpora of long documents.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_default_fraction_beside_a_source(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("source") is not None and "fraction" not in values:
            return {**values, "fraction": 0.0}
        return values

    @model_validator(mode="after")
    def _one_kind(self) -> "ValidationConfig":
        if self.source is not None and self.fraction > 0:
            raise ValueError(
                "data.validation: set either validation.fraction or validation.source, not both"
            )
        return self


CHECK_BLOCK_BYTES = 1024  # bytes per checksum of remote reads (meshtrain.data.remote.CHECK_BYTES)


class DataConfig(Section):
    source: Location = Field("stdlib", description=_SOURCE_HELP)
    text_field: str = Field("text", description="Column holding the document text (jsonl/parquet/hub).")
    hf_config: str | None = Field(None, description="Hub dataset configuration name (hf: sources).")
    split: str = Field("train", description="Dataset split to read.")
    max_documents: int | None = Field(None, gt=0, description="Read at most this many documents.")
    sources: list[SourceConfig] | None = Field(
        None,
        description="A mixture: a list of {source, weight, text_field, ...}; samples are drawn in proportion "
        "to the weights. Replaces data.source.",
    )
    stages: list[StageConfig] | None = Field(
        None,
        description="Data stages: a list of {name, until_step, weights}; each stage draws its samples from "
        "data.sources in its own weights, every source continuing where the earlier stages left it. Needs "
        "data.sources with a name each.",
    )
    skip_samples: list[SkipConfig] = Field(
        default_factory=list,
        description="Samples never trained: a list of {stage, start, stop}, counted in the stage's own sequence of "
        "samples (the run's, without data.stages), as a rollback's ranges are listed in the run's summary; the steps "
        "still take train.global_batch_size samples each, reading on after a range.",
    )
    validation: ValidationConfig = Field(default_factory=ValidationConfig, description="Held-out validation data.")
    tokenizer: str = Field(
        "train",
        description="'train' = fit a byte-level BPE on a sample of the data (saved with the run), or a tokenizer.json path.",
    )
    vocab_size: int = Field(2048, ge=260, description="Vocabulary size when the tokenizer is trained.")
    tokenizer_sample_bytes: int = Field(
        64 * 2**20,
        gt=0,
        description="Text the tokenizer is trained on: at most this many bytes, taken evenly across the data.",
    )
    seq_len: int = Field(128, gt=1, description="Tokens per training sequence (packed, no padding).")
    cache_dir: OptionalLocation = Field(
        None,
        description="Where prepared token stores are cached by source+tokenizer fingerprint (local or s3://); "
        "unset = <run.storage_path>/token_stores.",
    )
    prepare_unit_bytes: int = Field(
        64 * 2**20,
        gt=0,
        description="Most source bytes per prepare task and token shard; a small corpus is cut finer (into about 64 "
        "units, none under 1 MiB) and .jsonl files larger than a unit are split at line boundaries (ranges of 1 MiB or more).",
    )
    storage_options: StorageOptions = Field(
        default_factory=dict,
        description="fsspec options for s3:// stores and cache, e.g. {client_kwargs: {endpoint_url: ...}}; "
        "shown redacted wherever meshtrain writes or prints the config.",
    )
    cache_max_bytes: int = Field(
        32 * 2**30,
        ge=2**20,
        description="Bound of the node-local cache of remote (s3://) store blocks, shared by a node's ranks; the "
        "least recently used blocks are removed past it (at least 1 MiB).",
    )
    local_cache_dir: str | None = Field(
        None, description="Node-local folder of that cache; unset = $MESHTRAIN_TOKEN_CACHE or <tmp>/meshtrain-token-cache."
    )
    read_timeout_s: float = Field(
        120.0, gt=0, le=MAX_DURATION_S, description="How long requests to a remote store are retried (with backoff) before the run stops with one line."
    )
    read_ahead_steps: int = Field(
        2, ge=0, description="Steps of training windows each rank reads ahead in background threads (0 = read in the step)."
    )
    read_threads: int = Field(16, gt=0, description="Background threads per rank reading windows ahead (concurrent requests).")
    allow_fingerprint_change: bool = Field(
        False,
        description="Resume checkpoints trained on other token data (deliberately changing the corpus).",
    )

    @model_validator(mode="after")
    def _sources_and_paths(self) -> "DataConfig":
        if self.sources is not None:
            if not self.sources:
                raise ValueError("data.sources: an empty list; give at least one {source, weight} or use data.source")
            # A whole config written back (config.yaml, a checkpoint's manifest, --dry-run) spells out
            # data.source at its default: only another source beside data.sources is a contradiction.
            if "source" in self.model_fields_set and self.source != type(self).model_fields["source"].default:
                raise ValueError("data.sources: set either data.source or data.sources (a mixture), not both")
        if self.stages is not None:
            self._check_stages(self.stages)
        self._check_skips()
        if self.cache_dir is not None:
            check_tested_scheme(self.cache_dir, "data.cache_dir")
        one_read = (self.seq_len + 1) * 4 + 2 * CHECK_BLOCK_BYTES  # a window of uint32 tokens, rounded out to check blocks
        if self.cache_max_bytes < one_read:
            raise ValueError(
                f"data.cache_max_bytes={self.cache_max_bytes} cannot hold one read of data.seq_len={self.seq_len} "
                f"({one_read} bytes); raise data.cache_max_bytes (a few GiB is typical)"
            )
        return self

    def _check_stages(self, stages: list[StageConfig]) -> None:
        if not stages:
            raise ValueError("data.stages: an empty list; give at least one {name, weights} or leave it unset")
        names = [source.name for source in self.sources or []]
        if self.sources is None or None in names:
            raise ValueError("data.stages: stages weigh data.sources by name; list the sources in data.sources, "
                             "each with a name")
        labels = [stage.name for stage in stages]
        if len(set(labels)) != len(labels):
            raise ValueError(f"data.stages: stage names repeat ({', '.join(labels)}); give each stage its own name")
        for stage in stages:
            unknown = sorted(set(stage.weights) - set(names))
            if unknown:
                raise ValueError(f"data.stages: stage {stage.name!r} weighs {', '.join(map(repr, unknown))}, not among "
                                 f"data.sources' names ({', '.join(map(repr, names))})")
        for stage in stages:
            if stage.until_step is not None and stage.until_tokens is not None:
                raise ValueError(f"data.stages: stage {stage.name!r} gives until_step and until_tokens; give one")
        for stage in stages[:-1]:
            if stage.until_step is None and stage.until_tokens is None:
                raise ValueError(f"data.stages: stage {stage.name!r} has no until_step; only the last stage runs to the end")
        ends = [stage.until_step for stage in stages if stage.until_step is not None]
        if any(b <= a for a, b in zip(ends, ends[1:])):
            raise ValueError(f"data.stages: until_step must increase from stage to stage (got {', '.join(map(str, ends))})")

    def _check_skips(self) -> None:
        names = [stage.name for stage in self.stages or []]
        for skip in self.skip_samples:
            if names and skip.stage not in names:
                raise ValueError(f"data.skip_samples: stage {skip.stage!r} is not one of data.stages "
                                 f"({', '.join(map(repr, names))}); name the stage whose samples to leave out")
            if not names and skip.stage is not None:
                raise ValueError(f"data.skip_samples: stage {skip.stage!r} given, but the run has no data.stages; "
                                 "unset stage (the samples are counted in the run's one sequence)")

    def stage_ends(self, global_batch_size: int) -> list[int | None]:
        """Each data.stages stage's last step (None: the last stage, to the end): its until_step, or the first
        step at which the tokens trained, each stage at its own seq_len, reach its until_tokens; ValueError
        when a stage would end before or with the one before it."""
        ends: list[int | None] = []
        step = tokens = 0
        for stage in self.stages or []:
            per_step = global_batch_size * (stage.seq_len or self.seq_len)
            end = stage.until_step
            if stage.until_tokens is not None:
                end = step + -(-(stage.until_tokens - tokens) // per_step)
            if end is not None:
                if end <= step:
                    given = (f"until_tokens={stage.until_tokens:,} (the stages before it trained {tokens:,} tokens by "
                             f"step {step})" if stage.until_tokens is not None else f"until_step={end}")
                    raise ValueError(f"data.stages: stage {stage.name!r} ends with {given}, not after the stage "
                                     "before it; end it later")
                tokens, step = tokens + (end - step) * per_step, end
            ends.append(end)
        return ends

    def longest_seq_len(self) -> int:
        """The longest sequence any stage trains (what the model's RoPE table and memory must hold)."""
        return max([self.seq_len, *(stage.seq_len for stage in self.stages or [] if stage.seq_len is not None)])

    def source_list(self) -> list[SourceConfig]:
        """The mixture's sources, or the single data.source as a one-source list."""
        if self.sources is not None:
            return list(self.sources)
        return [
            SourceConfig(
                source=self.source, text_field=self.text_field, hf_config=self.hf_config,
                split=self.split, max_documents=self.max_documents,
            )
        ]

    def validation_source(self) -> SourceConfig | None:
        if self.validation.source is None:
            return None
        return SourceConfig(source=self.validation.source, text_field=self.validation.text_field)


OVERALL_LABEL = "all"  # the label of the overall validation loss; no source gets it


def source_labels(sources: list[SourceConfig]) -> list[str]:
    """A short, distinct label per source for per-source metrics: its ``name``, or the last part of
    its path or dataset name without the extension (``-2``, ``-3`` after repeats)."""
    labels: list[str] = []
    for source in sources:
        if source.name is not None:
            base = source.name
        else:
            parts = [part for part in source.source.removeprefix("hf:").split("/") if part and not re.search(r"[*?\[]", part)]
            tail = parts[-1] if parts else "source"
            base = re.sub(r"[^A-Za-z0-9_.:-]+", "_", tail.split(".", 1)[0] or tail)[:48] or "source"
        label, repeat = base, 1
        while label in labels or label == OVERALL_LABEL:
            repeat += 1
            label = f"{base}-{repeat}"
        labels.append(label)
    return labels
