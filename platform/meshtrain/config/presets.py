"""Model shape presets.

``debug`` trains in minutes on two CPU cores; ``125m`` is a GPT-2-small-sized Llama; the
``llama3_*`` entries are the published Llama 3 / 3.2 shapes (vocabulary 128256, RoPE base 500000) with
plain RoPE over 8192 positions. ``llama3.2_1b``, ``llama3.2_3b`` and ``llama3.1_8b`` are Meta's Llama
3.2 / 3.1 configs in full: 131072 positions with the Llama 3 RoPE scaling their weights were trained with.
"""

from __future__ import annotations

from typing import Any

_LLAMA3_COMMON: dict[str, Any] = {
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "norm_eps": 1e-5,
    "max_seq_len": 8192,
    "init_std": 0.02,
}


# The shapes shared by the plain-RoPE and the long-context presets of one size.
_LLAMA3_1B: dict[str, Any] = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 8192,
                              "tie_embeddings": True}
_LLAMA3_8B: dict[str, Any] = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336,
                              "tie_embeddings": False}


def _llama3_long_context(factor: float) -> dict[str, Any]:
    """Llama 3.1 / 3.2's context: 131072 positions, rope_scaling {rope_type: llama3, factor: ...}."""
    scaling = {
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return {**_LLAMA3_COMMON, "max_seq_len": 131072, "rope_scaling": scaling}


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "debug": {
        "dim": 128,
        "n_layers": 4,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 384,
        "vocab_size": None,
        "max_seq_len": 1024,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": False,
        "init_std": 0.02,
    },
    "125m": {
        "dim": 768,
        "n_layers": 12,
        "n_heads": 12,
        "n_kv_heads": 4,
        "ffn_dim": 2048,
        "vocab_size": 32000,
        "max_seq_len": 2048,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": False,
        "init_std": 0.02,
    },
    "llama3_1b": {**_LLAMA3_COMMON, **_LLAMA3_1B},
    "llama3_8b": {**_LLAMA3_COMMON, **_LLAMA3_8B},
    "llama3_70b": {
        **_LLAMA3_COMMON,
        "dim": 8192,
        "n_layers": 80,
        "n_heads": 64,
        "n_kv_heads": 8,
        "ffn_dim": 28672,
        "tie_embeddings": False,
    },
    "llama3_405b": {  # Llama 3 405B's published shape, the largest Llama 3 (past one node: pipeline parallel)
        **_LLAMA3_COMMON,
        "dim": 16384,
        "n_layers": 126,
        "n_heads": 128,
        "n_kv_heads": 8,
        "ffn_dim": 53248,
        "tie_embeddings": False,
    },
    "llama3.2_1b": {**_llama3_long_context(factor=32.0), **_LLAMA3_1B},
    "llama3.2_3b": {
        **_llama3_long_context(factor=32.0),
        "dim": 3072,
        "n_layers": 28,
        "n_heads": 24,
        "n_kv_heads": 8,
        "ffn_dim": 8192,
        "tie_embeddings": True,
    },
    "llama3.1_8b": {**_llama3_long_context(factor=8.0), **_LLAMA3_8B},
}
