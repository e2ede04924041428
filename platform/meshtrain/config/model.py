"""The model section: a preset or explicit shape, and the fully resolved shape the model code consumes."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
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
from pydantic_core import PydanticCustomError

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
            raise ConfigError(_args_problem(exc.errors()[0])) from None

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


def _args_problem(error: Any) -> str:
    """One line for ModelArgs' first validation error, naming the field (pydantic's own messages do not)."""
    if error["type"] in ("value_error", _SHAPE_ERROR):  # ours, which name the field and value
        return error["msg"].removeprefix("Value error, ")
    field = ".".join(str(part) for part in error["loc"])
    return f"model.{field}={error.get('input')!r}: {error['msg']}"


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

    @model_validator(mode="before")
    @classmethod
    def _sane_shape(cls, values: Any) -> Any:
        # Before pydantic's coercion: "64", 64.5 or true in an integer field is refused, naming the field.
        problem = shape_problem(values) if isinstance(values, Mapping) else None
        if problem is not None:  # pydantic's own type keeps the message as it is (a ValueError's gains a prefix)
            raise PydanticCustomError(_SHAPE_ERROR, problem)
        return values

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# Upper bounds of a model shape. The per-field ones lie far above every published Llama-family model
# (Llama 3.1 405B: dim 16384, 126 layers, 128 heads, ffn 53248, 131072 positions; the largest public
# vocabularies hold about 262k tokens, head sizes are 64 to 256), so a real model never meets them, yet a
# typo or a crafted config.json or checkpoint marker is refused in one line instead of failing as an
# allocation on every worker.
SHAPE_LIMITS = {
    "dim": 2**17, "n_layers": 2**12, "n_heads": 2**12, "n_kv_heads": 2**12, "ffn_dim": 2**20,
    "vocab_size": 2**24, "max_seq_len": 2**21,
}
MAX_HEAD_DIM = 2**10  # the RoPE tables are max_seq_len x head size, per rank
# The embedding is bounded by memory: training keeps 16 bytes per element (fp32 weight, gradient and two
# AdamW moments), so an embedding of 2**38 elements needs 4 TiB before the rest of the model: more than the
# accelerator memory of any one machine (8 x 288 GB, the largest GPU node sold: 2.1 TiB).
MAX_EMBEDDING_ELEMENTS = 2**38
_TRAINING_BYTES_PER_ELEMENT = 16
_POSITIVE_FLOATS = ("rope_theta", "norm_eps", "init_std")
_SHAPE_ERROR = "model_shape"


def _model_field(field: str) -> str:
    return f"model.{field}"


def shape_problem(values: Mapping[str, Any], name: Callable[[str], str] = _model_field) -> str | None:
    """What is wrong with a model shape (``ModelArgs`` field -> value; absent fields are not checked), in
    one line naming each field as ``name(field)``; None when nothing is. Every shape meshtrain reads is
    checked with this: a config's (``ModelArgs``), model.init_from's config.json (``llama_shape``), a
    checkpoint's ``COMMITTED`` model_args (``ModelArgs`` again)."""
    for field, limit in SHAPE_LIMITS.items():
        if field not in values:
            continue
        value = values[field]
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{name(field)}={value!r} is not an integer"
        if value <= 0:
            return f"{name(field)}={value} must be positive"
        if value > limit:
            return f"{name(field)}={value} is above {limit:,}, more than any Llama-family model has"
    for field in _POSITIVE_FLOATS:
        value = values.get(field)
        if field in values and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
        ):
            return f"{name(field)}={value!r} must be a positive finite number"
    if "norm_eps" in values and values["norm_eps"] >= 1:
        return f"{name('norm_eps')}={values['norm_eps']!r} must be below 1 (Llama: 1e-5)"
    if "tie_embeddings" in values and not isinstance(values["tie_embeddings"], bool):
        return f"{name('tie_embeddings')}={values['tie_embeddings']!r} must be true or false"
    if "vocab_size" in values and "dim" in values:
        elements = values["vocab_size"] * values["dim"]
        if elements > MAX_EMBEDDING_ELEMENTS:
            tib = elements * _TRAINING_BYTES_PER_ELEMENT / 2**40
            return (
                f"{name('vocab_size')}={values['vocab_size']} x {name('dim')}={values['dim']} is an embedding of "
                f"{elements:,} elements, above {MAX_EMBEDDING_ELEMENTS:,}: training it alone takes {tib:,.0f} TiB "
                f"({_TRAINING_BYTES_PER_ELEMENT} bytes an element), more than any machine holds"
            )
    return _heads_problem(values, name)


def _heads_problem(values: Mapping[str, Any], name: Callable[[str], str]) -> str | None:
    """The attention heads must split the model dimension into even head sizes (checked values only)."""
    if "dim" not in values or "n_heads" not in values:
        return None
    dim, heads = values["dim"], values["n_heads"]
    if dim % heads:
        return f"{name('dim')}={dim} must be divisible by {name('n_heads')}={heads}"
    kv_heads = values.get("n_kv_heads", heads)
    if heads % kv_heads:
        return f"{name('n_kv_heads')}={kv_heads} must divide {name('n_heads')}={heads}"
    if (dim // heads) % 2:
        return (
            f"{name('dim')}={dim}: the head size {name('dim')} / {name('n_heads')}={heads} is {dim // heads}, "
            f"which must be even for rotary embeddings; change {name('dim')} or {name('n_heads')}"
        )
    if dim // heads > MAX_HEAD_DIM:
        return (
            f"{name('dim')}={dim}: the head size {name('dim')} / {name('n_heads')}={heads} is {dim // heads}, "
            f"above {MAX_HEAD_DIM:,} (Llama: 128); change {name('dim')} or {name('n_heads')}"
        )
    return None


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
