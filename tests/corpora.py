"""Small token stores prepared in-process (no Ray) for tests that train on real text."""

from __future__ import annotations

from pathlib import Path

from meshtrain.config import DataConfig
from meshtrain.data import DataPlan, prepare_data


def stdlib_plan(cache: Path, documents: int = 24, vocab_size: int = 512, seq_len: int = 32, **settings) -> DataPlan:
    """The first ``documents`` standard-library files, tokenized into a store under ``cache``."""
    data = DataConfig(max_documents=documents, vocab_size=vocab_size, seq_len=seq_len, **settings)
    return prepare_data(data, str(cache), seq_len, use_ray=False, log=lambda _: None)
