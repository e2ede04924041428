"""The model section: a preset or explicit shape, and the fully resolved shape the model code consumes."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from meshtrain.config.errors import ConfigError
from meshtrain.config.presets import MODEL_PRESETS
from meshtrain.config.section import Section


class RopeScalingConfig(Section):
    """Llama 3 RoPE scaling fields set in the config; unset ones come from the preset or init_from."""

    factor: float | None = Field(
        None, gt=0, description="Low-frequency wavelengths are stretched by this (Llama 3.1: 8, 3.2: 32)."
    )
    low_freq_factor: float | None = Field(
        None, gt=0, description="Wavelengths above original context / this are stretched (Llama 3.x: 1)."
    )
    high_freq_factor: float | None = Field(
        None, gt=0, description="Wavelengths below original context / this are kept (Llama 3.x: 4)."
    )
    original_max_position_embeddings: int | None = Field(
        None, gt=0, description="The context the unscaled RoPE was trained on (Llama 3.x: 8192)."
    )

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # Only the fields set: what a message quoting this section is about.
        return ((name, value) for name, value in super().__repr_args__() if value is not None)


class ModelConfig(Section):
    preset: str = Field("debug", description="Model shape preset: " + ", ".join(MODEL_PRESETS) + ".")
    dim: int | None = Field(None, gt=0, description="Hidden size; overrides the preset.")
    n_layers: int | None = Field(None, gt=0, description="Number of transformer blocks; overrides the preset.")
    n_heads: int | None = Field(None, gt=0, description="Attention (query) heads; overrides the preset.")
    n_kv_heads: int | None = Field(
        None, gt=0, description="Key/value heads for grouped-query attention; must divide n_heads."
    )
    ffn_dim: int | None = Field(None, gt=0, description="Hidden size of the SwiGLU feed-forward block.")
    vocab_size: int | None = Field(
        None,
        gt=0,
        description="Embedding rows; unset = the tokenizer's vocabulary rounded up to a multiple of 64.",
    )
    max_seq_len: int | None = Field(None, gt=0, description="Longest sequence the RoPE table covers.")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base frequency.")
    norm_eps: float | None = Field(None, gt=0, description="RMSNorm epsilon.")
    rope_scaling: RopeScalingConfig | None = Field(
        None,
        description="Llama 3.1-3.3 RoPE scaling (Hugging Face rope_type llama3): model.rope_scaling.factor, "
        ".low_freq_factor, .high_freq_factor, .original_max_position_embeddings; the llama3.x presets and "
        "init_from's config.json set them, and fields set here override a preset's.",
    )
    tie_embeddings: bool | None = Field(None, description="Share the input embedding with the output head.")
    init_std: float | None = Field(None, gt=0, description="Std of the normal weight initialization.")
    document_mask: bool = Field(
        True,
        description="Attend only within each packed document (split at the end-of-document token, which "
        "opens the next one) with RoPE positions restarting per document; false = across the whole window.",
    )
    init_from: str | None = Field(
        None,
        description="Continued pretraining: a local Hugging Face Llama directory (config.json + safetensors, "
        "on storage every worker reads); its weights replace the initialization and its config.json gives "
        "the shape, so leave the shape fields unset.",
    )

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in MODEL_PRESETS:
            raise ValueError(f"unknown preset {value!r}; choose one of {', '.join(MODEL_PRESETS)}")
        return value

    @field_validator("init_from")
    @classmethod
    def _absolute_init_from(cls, value: str | None) -> str | None:
        # Absolute, because Ray workers may not run in the driver's working directory.
        return None if value is None else str(Path(value).expanduser().absolute())

    def resolved(
        self, tokenizer_vocab_size: int | None = None, init_shape: Mapping[str, Any] | None = None
    ) -> "ModelArgs":
        """Preset values, or ``init_shape`` (the shape model.init_from's config.json gives, read by
        ``meshtrain.model.args.model_args``), with the explicitly set fields over them."""
        values = dict(MODEL_PRESETS[self.preset])
        if init_shape is not None:
            values.update(init_shape)
        explicit = self.model_dump(exclude={"preset", "init_from", "document_mask", "rope_scaling"})
        values.update({k: v for k, v in explicit.items() if v is not None})
        values["rope_scaling"] = self._rope_scaling(values.get("rope_scaling"))
        if values.get("vocab_size") is None:
            if tokenizer_vocab_size is None:
                raise ConfigError("model.vocab_size: unknown; set it or let the tokenizer define it")
            values["vocab_size"] = _round_up(tokenizer_vocab_size, 64)
        elif tokenizer_vocab_size is not None and tokenizer_vocab_size > values["vocab_size"]:
            if self.init_from is not None:
                raise ConfigError(
                    f"data.tokenizer: its {tokenizer_vocab_size} tokens do not fit the {values['vocab_size']}"
                    f" embedding rows (vocab_size) of model.init_from={self.init_from!r}; "
                    "use the tokenizer the weights were trained with"
                )
            raise ConfigError(
                f"model.vocab_size: {values['vocab_size']} is smaller than the tokenizer's "
                f"{tokenizer_vocab_size} tokens; raise it or leave it unset"
            )
        try:
            return ModelArgs(**values)
        except ValidationError as exc:
            raise ConfigError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None

    def _rope_scaling(self, base: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """``base`` (the preset's or init_from's scaling) with model.rope_scaling's set fields over it."""
        if self.rope_scaling is None:
            return None if base is None else dict(base)
        values = {**(base or {}), **self.rope_scaling.model_dump(exclude_none=True)}
        missing = [name for name in RopeScaling.model_fields if name not in values]
        if missing:
            source = "model.init_from's config.json" if self.init_from else f"preset {self.preset!r}"
            raise ConfigError(
                f"model.rope_scaling.{missing[0]}: unset, and {source} has no rope scaling to take it "
                f"from; set {', '.join(f'model.rope_scaling.{name}' for name in missing)} too"
            )
        return values


class RopeScaling(BaseModel):
    """Llama 3.1's RoPE scaling (Hugging Face's ``rope_type: llama3``), applied in ``model/llama.py``.

    Validation errors name ``model.rope_scaling.<field>``; a validation context ``{"name": ...}`` names
    another source (a config.json key).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @field_validator("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    @classmethod
    def _positive(cls, value: float, info: ValidationInfo) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{_source(info)}.{info.field_name}={value!r} must be a positive finite number")
        return value

    @model_validator(mode="after")
    def _bands_ordered(self, info: ValidationInfo) -> "RopeScaling":
        if self.low_freq_factor >= self.high_freq_factor:
            name = _source(info)
            raise ValueError(
                f"{name}.low_freq_factor={self.low_freq_factor!r} must be below "
                f"{name}.high_freq_factor={self.high_freq_factor!r} (Llama 3.x: 1 and 4)"
            )
        return self


def _source(info: ValidationInfo) -> str:
    return (info.context or {}).get("name", "model.rope_scaling")


class ModelArgs(BaseModel):
    """A fully resolved model shape (what the model code consumes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool
    init_std: float
    rope_scaling: RopeScaling | None = None  # None: plain RoPE

    @model_validator(mode="after")
    def _heads_fit(self) -> "ModelArgs":
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"model.dim={self.dim}: the head size model.dim / model.n_heads={self.n_heads} is "
                f"{self.dim // self.n_heads}, which must be even for rotary embeddings; "
                "change model.dim or model.n_heads"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads




def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
