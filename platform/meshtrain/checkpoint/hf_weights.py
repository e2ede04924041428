"""Loading a Hugging Face Llama directory's weights into a (possibly FSDP-sharded) model.

Loading goes through DCP's ``HuggingFaceStorageReader``: DCP plans the reads from each parameter's
(possibly FSDP-sharded) local tensor, so every rank reads only its own rows of each safetensors
tensor and no process ever holds the whole model.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshtrain.config import ConfigError
from meshtrain.model.hf_llama import CONFIG_FILE, hf_name
from meshtrain.model.llama import Transformer


def load_hf_weights(model: Transformer, directory: str) -> None:
    """Fill ``model``'s parameters (sharded or not) from a Hugging Face Llama directory, then its RoPE tables.

    With tied embeddings the model has one parameter for both names, so ``lm_head.weight`` (which
    such checkpoints leave out) is not asked for.
    """
    state = {hf_name(name): param for name, param in model.named_parameters()}
    reader = HuggingFaceStorageReader(directory)
    _check_stored(state, reader.read_metadata().state_dict_metadata, directory)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=reader)
    model.reset_rope()


def _check_stored(state: dict[str, torch.Tensor], stored: dict[str, Any], directory: str) -> None:
    """One-line errors for weights that do not match their own config.json (DCP's are per-rank dumps)."""
    where = f"model.init_from: {directory!r}"
    missing = [name for name in state if not isinstance(stored.get(name), TensorStorageMetadata)]
    if missing:
        raise ConfigError(
            f"{where}: the weights lack {', '.join(missing[:3])}; they do not match {CONFIG_FILE}"
        )
    for name, tensor in state.items():
        if tuple(stored[name].size) != tuple(tensor.shape):
            raise ConfigError(
                f"{where}: {name} has shape {tuple(stored[name].size)}, {CONFIG_FILE} gives "
                f"{tuple(tensor.shape)}; the weights do not match their config"
            )
