"""The resolved shape of a run's model: the config's preset and fields, or model.init_from's config.json."""

from __future__ import annotations

from meshtrain.config import ModelArgs, ModelConfig
from meshtrain.model.hf_llama import llama_shape


def model_args(model: ModelConfig, tokenizer_vocab_size: int | None) -> ModelArgs:
    """The model shape for a tokenizer of ``tokenizer_vocab_size`` tokens; ConfigError when they conflict.

    With ``model.init_from`` the shape is read from that directory's ``config.json`` (every call: it
    is small, and a worker may run where the driver's copy of the config was made).
    """
    init_from = model.init_from
    return model.resolved(tokenizer_vocab_size, llama_shape(init_from) if init_from is not None else None)
