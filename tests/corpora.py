"""Small token stores prepared in-process (no Ray) for tests that train on real text."""

from __future__ import annotations

import json
from pathlib import Path

from meshtrain.config import DataConfig
from meshtrain.data import DataPlan, prepare_data


def stdlib_plan(cache: Path, documents: int = 24, vocab_size: int = 512, seq_len: int = 32, **settings) -> DataPlan:
    """The first ``documents`` standard-library files, tokenized into a store under ``cache``."""
    data = DataConfig(max_documents=documents, vocab_size=vocab_size, seq_len=seq_len, **settings)
    return prepare_data(data, str(cache), seq_len, use_ray=False, log=lambda _: None)


def short_documents_plan(cache: Path, documents: int = 1500, vocab_size: int = 512, seq_len: int = 32,
                         **settings) -> DataPlan:
    """Documents of a few standard-library source lines each (tens of tokens), so most packed windows of
    ``seq_len`` hold a document boundary: where the document mask changes what a token sees."""
    import argparse

    lines = [line for line in Path(argparse.__file__).read_text().splitlines() if line.strip()]
    corpus = cache / "short_documents.jsonl"
    cache.mkdir(parents=True, exist_ok=True)
    with corpus.open("w") as handle:
        for index in range(documents):
            start = (index * 7) % (len(lines) - 6)
            handle.write(json.dumps({"text": "\n".join(lines[start : start + 2 + index % 4])}) + "\n")
    data = DataConfig(source=str(corpus), vocab_size=vocab_size, seq_len=seq_len, **settings)
    return prepare_data(data, str(cache), seq_len, use_ray=False, log=lambda _: None)
