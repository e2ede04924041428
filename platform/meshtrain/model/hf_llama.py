"""Hugging Face Llama directories: parameter names and ``config.json``, both ways.

One table maps meshtrain's parameter names to ``LlamaForCausalLM``'s and one maps ``ModelArgs``
fields to ``config.json`` keys; the export writes with them and ``model.init_from`` reads with them
(:func:`llama_shape` checks a directory and gives its shape; loading the weights is
``meshtrain.checkpoint.hf_weights``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from meshtrain.config import ConfigError, ModelArgs, RopeScaling
from meshtrain.config.model import shape_problem

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"

# meshtrain name inside a block → Hugging Face name inside ``model.layers.N``.
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# ModelArgs field → config.json key (init_std, meshtrain's own, is not part of the shape). rope_scaling
# is a mapping, read and written by the functions below (transformers 5 spells it rope_parameters).
CONFIG_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "vocab_size": "vocab_size",
    "max_seq_len": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "rope_scaling": "rope_parameters",
}
_VALUE_KEYS = {field: key for field, key in CONFIG_KEYS.items() if field != "rope_scaling"}
_LLAMA3_ROPE = "llama3"
_REQUIRED_KEYS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"
)
# LlamaConfig's defaults for the keys a config.json may leave out (num_key_value_heads: MHA).
_LLAMA_DEFAULTS = {
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# Llama variants meshtrain's model does not implement: key → the only value it supports.
_SUPPORTED_VALUES = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def hf_name(name: str) -> str:
    """The ``LlamaForCausalLM`` name of a meshtrain parameter."""
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        return f"model.layers.{index}.{_LAYER_NAMES[rest]}"
    return _TOP_NAMES[name]


def hf_config(args: ModelArgs, eos_token_id: int | None = None, dtype: str = "float32") -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` with this shape (plain JSON, no transformers needed)."""
    shape = {key: getattr(args, field) for field, key in _VALUE_KEYS.items()}
    # transformers < 5 reads rope_theta and rope_scaling; 5.x reads rope_parameters (and would fold
    # rope_theta in), or rope_scaling first where a config has it.
    rope: dict[str, Any] = {"rope_type": "default"}
    if args.rope_scaling is not None:
        rope = {"rope_type": _LLAMA3_ROPE, **args.rope_scaling.model_dump()}
        shape["rope_scaling"] = rope
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "head_dim": args.head_dim,
        "rope_parameters": {**rope, "rope_theta": args.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": args.init_std,
        # LlamaConfig's defaults (bos 1, eos 2) belong to Meta's tokenizer, not to this run's.
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
    }


def llama_shape(directory: str) -> dict[str, Any]:
    """The ``ModelArgs`` shape fields of a local Hugging Face Llama directory; ConfigError if not one."""
    root = Path(directory)
    where = f"model.init_from: {directory!r}"
    if not root.is_dir():
        raise ConfigError(
            f"{where} is not a directory; give a local Hugging Face Llama directory "
            f"({CONFIG_FILE} + safetensors weights)"
        )
    config = _read_json(root / CONFIG_FILE, where)
    architectures = config.get("architectures") or ["LlamaForCausalLM"]
    if config.get("model_type") != "llama" or architectures != ["LlamaForCausalLM"]:
        raise ConfigError(
            f"{where}: {CONFIG_FILE} describes model_type={config.get('model_type')!r} "
            f"architectures={config.get('architectures')!r}, not LlamaForCausalLM; give Llama weights"
        )
    _check_weight_files(root, where)
    rope_key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"  # as transformers 5 picks
    rope = config.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: {CONFIG_FILE} has {rope_key}={rope!r}, not a mapping; fix or replace it")
    for key, supported in _SUPPORTED_VALUES.items():
        if config.get(key, supported) != supported:
            raise ConfigError(
                f"{where}: {CONFIG_FILE} has {key}={config[key]!r}; meshtrain's model implements only "
                f"{key}={supported!r}"
            )
    missing = [key for key in _REQUIRED_KEYS if key not in config]
    if missing:
        raise ConfigError(f"{where}: {CONFIG_FILE} lacks {', '.join(missing)}; give a complete Llama config")
    values = {**_LLAMA_DEFAULTS, **config}
    values["rope_theta"] = rope.get("rope_theta", values["rope_theta"])
    if values.get("num_key_value_heads") is None:  # absent or null: multi-head attention, as LlamaConfig reads it
        values["num_key_value_heads"] = values["num_attention_heads"]
    shape = {field: values[key] for field, key in _VALUE_KEYS.items()}
    # Every value read is checked (type, sign, bounds, heads) before anything computes with it.
    problem = shape_problem(shape, lambda field: _config_key(field, rope_key if "rope_theta" in rope else None))
    if problem is not None:
        raise ConfigError(f"{where}: {CONFIG_FILE}: {problem}; fix {CONFIG_FILE} or give other weights")
    shape["rope_scaling"] = _rope_scaling(rope, where, rope_key)
    head_dim = config.get("head_dim")
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0):
        raise ConfigError(f"{where}: {CONFIG_FILE} has head_dim={head_dim!r}, not a positive integer; fix or drop it")
    if head_dim is not None and head_dim * shape["n_heads"] != shape["dim"]:
        raise ConfigError(
            f"{where}: {CONFIG_FILE} has head_dim={head_dim}, but meshtrain's model uses hidden_size / "
            f"num_attention_heads = {shape['dim'] / shape['n_heads']:g}; give weights where they agree"
        )
    return shape


def _config_key(field: str, rope_key: str | None) -> str:
    """The config.json key a shape field was read from (rope_theta: from the rope mapping where it has one)."""
    return f"{rope_key}.rope_theta" if field == "rope_theta" and rope_key else CONFIG_KEYS[field]


def _rope_scaling(rope: dict[str, Any], where: str, key: str) -> dict[str, Any] | None:
    """The ``ModelArgs.rope_scaling`` of config.json's ``key`` (its rope mapping); ConfigError where the
    model lacks what it asks for."""
    name = f"{CONFIG_FILE} {key}"
    type_key = "rope_type" if "rope_type" in rope else "type"  # transformers < 4.43 wrote "type"
    rope_type = rope.get(type_key, "default")
    if rope_type == "default":
        return None
    if rope_type != _LLAMA3_ROPE:
        raise ConfigError(
            f"{where}: {name}.{type_key}={rope_type!r} is a RoPE variant meshtrain's model does not "
            f"implement ('default' and {_LLAMA3_ROPE!r} only); give Llama weights with one of those"
        )
    fields = {
        field: value for field, value in rope.items() if field not in ("rope_type", "type", "rope_theta")
    }
    try:
        return RopeScaling.model_validate(fields, context={"name": name}).model_dump()
    except ValidationError as exc:
        raise ConfigError(f"{where}: {_rope_scaling_problem(exc.errors()[0], name)}") from None


def _rope_scaling_problem(error: Any, name: str) -> str:
    if error["type"] == "value_error":  # RopeScaling's own message, which names the field and value
        return error["msg"].removeprefix("Value error, ")
    field = f"{name}.{'.'.join(str(part) for part in error['loc'])}"
    if error["type"] == "missing":
        needed = ", ".join(RopeScaling.model_fields)
        return f"{field} is missing; rope_type {_LLAMA3_ROPE!r} needs {needed}"
    if error["type"] == "extra_forbidden":
        return (
            f"{field}={error['input']!r} is set, which meshtrain's {_LLAMA3_ROPE} RoPE does not model; "
            "give weights without it"
        )
    return f"{field}={error['input']!r}: {error['msg']}; fix {CONFIG_FILE}"


def _read_json(path: Path, where: str) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{where} has no {path.name}; give a Hugging Face model directory")
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: {path.name} is not valid JSON ({exc}); fix or replace it") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{where}: {path.name} is not a JSON object; fix or replace it")
    return loaded


def _check_weight_files(root: Path, where: str) -> None:
    """The safetensors files are exactly those the index names (the reader loads every one there)."""
    present = set(weight_files(root))
    if (root / INDEX_FILE).is_file():
        weight_map = _read_json(root / INDEX_FILE, where).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{where}: {INDEX_FILE} has no weight_map; fix or replace it")
        for name, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file or not file.endswith(SAFETENSORS_SUFFIX):
                raise ConfigError(
                    f"{where}: {INDEX_FILE} maps {name!r} to {file!r}, not a .safetensors file name in the "
                    "folder; fix or replace it"
                )
        expected, named_by = set(weight_map.values()), INDEX_FILE
    elif WEIGHTS_FILE in present:
        expected, named_by = {WEIGHTS_FILE}, f"{WEIGHTS_FILE} (there is no {INDEX_FILE})"
    else:
        raise ConfigError(f"{where} has no {WEIGHTS_FILE} or {INDEX_FILE}; give safetensors weights")
    if expected - present:
        raise ConfigError(
            f"{where} lacks {', '.join(sorted(expected - present))}, named by {INDEX_FILE}; "
            "complete the download"
        )
    if present - expected:
        raise ConfigError(
            f"{where} holds {', '.join(sorted(present - expected))} beside {named_by}; every *.safetensors "
            "file there is read, so move the others out"
        )


def weight_files(root: Path) -> list[str]:
    """The names of the safetensors files in ``root``: every name ending in .safetensors, hidden ones too,
    as DCP's HuggingFaceStorageReader lists them (it reads them all)."""
    return sorted(path.name for path in root.iterdir() if path.name.endswith(SAFETENSORS_SUFFIX))


def init_from_tokenizer(directory: str) -> str:
    """The ``tokenizer.json`` of an ``init_from`` directory; ConfigError when it has none."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise ConfigError(
            f"data.tokenizer: model.init_from={directory!r} has no {TOKENIZER_FILE}; set data.tokenizer "
            "to the tokenizer.json the weights were trained with"
        )
    return str(path)
