"""Loading a Hugging Face Llama directory's weights into a (possibly FSDP-sharded) model.

Loading goes through DCP's ``HuggingFaceStorageReader``: DCP plans the reads from each parameter's
(possibly FSDP-sharded) local tensor, so every rank reads only its own rows of each safetensors
tensor and no process ever holds the whole model.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshtrain.config import ConfigError, one_line
from meshtrain.model.hf_llama import CONFIG_FILE, hf_name, weight_files
from meshtrain.model.llama import Transformer


def load_hf_weights(model: Transformer, directory: str) -> None:
    """Fill ``model``'s parameters (sharded or not) from a Hugging Face Llama directory, then its RoPE tables.

    With tied embeddings the model has one parameter for both names, so ``lm_head.weight`` (which
    such checkpoints leave out) is not asked for.
    """
    state = {hf_name(name): param for name, param in model.named_parameters()}
    check_weight_headers(directory, {name: tuple(param.shape) for name, param in state.items()})
    reader = HuggingFaceStorageReader(directory)
    _check_stored(state, reader.read_metadata().state_dict_metadata, directory)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=reader)
    model.reset_rope()


# Floating-point tensors DCP copies (converting) into the fp32 parameters; integer and float8 tensors are
# quantized weights, whose scales meshtrain's model does not apply.
LOADABLE_DTYPES = ("F32", "BF16", "F16", "F64")
# The __metadata__ entry of a file DCP wrote sharded (torch.distributed.checkpoint._hf_utils.CUSTOM_METADATA_KEY):
# its reader would place the file's tensors at offsets that entry gives, so the shapes here would not be theirs.
_DCP_SHARDING_KEY = "DCP_SHARDING_INFO"


def check_weight_headers(directory: str, expected: dict[str, tuple[int, ...]]) -> None:
    """One-line ConfigError unless every safetensors file of ``directory`` has a sound header and, across
    them, each tensor of ``expected`` (Hugging Face name -> shape) is stored once, with that shape, in a
    dtype meshtrain loads. Only the headers are read: ``safe_open`` parses the length prefix and the JSON
    header, and checks every tensor's dtype, shape and data offsets against each other and the file's size
    (what an interrupted download breaks); no tensor is loaded."""
    where = f"model.init_from: {directory!r}"
    stored: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # name -> file, dtype, shape
    for file in weight_files(Path(directory)):
        path = Path(directory) / file
        try:
            with safe_open(str(path), framework="pt") as handle:
                sharded = _DCP_SHARDING_KEY in (handle.metadata() or {})
                tensors = [(name, handle.get_slice(name)) for name in handle.keys()]
                found = [(name, piece.get_dtype(), tuple(piece.get_shape())) for name, piece in tensors]
        except Exception as exc:  # SafetensorError for a damaged header, OSError for an unreadable file
            size = f" ({path.stat().st_size:,} bytes)" if path.is_file() else ""
            raise ConfigError(
                f"{where}: {file}{size} is not a readable safetensors file ({one_line(exc, limit=160)}); an "
                "interrupted download leaves such a file: download it again"
            ) from None
        if sharded:
            raise ConfigError(
                f"{where}: {file} holds a sharded DCP save ({_DCP_SHARDING_KEY} in its metadata); give "
                "consolidated Hugging Face weights"
            )
        for name, dtype, shape in found:
            if name in stored:
                raise ConfigError(f"{where}: {name} is stored in both {stored[name][0]} and {file}; keep one copy")
            stored[name] = (file, dtype, shape)
    missing = [name for name in expected if name not in stored]
    if missing:
        raise ConfigError(
            f"{where}: the weights lack {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; they do not "
            f"match {CONFIG_FILE} (complete the download, or give the config.json written with these weights)"
        )
    for name, shape in expected.items():
        file, dtype, stored_shape = stored[name]
        if stored_shape != shape:
            raise ConfigError(
                f"{where}: {name} in {file} has shape {stored_shape}, {CONFIG_FILE} gives {shape}; give the "
                "config.json written with these weights"
            )
        if dtype not in LOADABLE_DTYPES:
            raise ConfigError(
                f"{where}: {name} in {file} is {dtype}; meshtrain loads {', '.join(LOADABLE_DTYPES)} weights "
                "(not quantized ones): give unquantized weights"
            )


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
