"""Small token stores prepared in-process (no Ray) for tests that train on real text."""

from __future__ import annotations

import json
from pathlib import Path

from meshtrain.config import DataConfig
from meshtrain.data import DataPlan, prepare_data
from meshtrain.cluster.worker_plan import worker_plan


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


def trained_tiny_run(storage: Path, stores: Path, name: str, checkpoint_interval: int) -> Path:
    """The run folder of a tiny model (tied embeddings, GQA) trained 4 steps in this process, with
    committed checkpoints every ``checkpoint_interval`` steps and its tokenizer, as the launcher leaves one."""
    import torch

    from meshtrain.checkpoint.storage import checkpoint_root
    from meshtrain.config.loading import load_config
    from meshtrain.distributed.layout import WorkerLayout
    from meshtrain.train.trainer import train

    cfg = load_config(None, [
        "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
        "model.tie_embeddings=true", "data.max_documents=8", "data.vocab_size=300", "data.seq_len=64",
        "train.steps=4", "train.global_batch_size=4", "train.micro_batch_size=2", "optim.warmup_steps=2",
        "scaling.num_workers=1", f"checkpoint.interval={checkpoint_interval}", "checkpoint.mode=sync",
        "eval.interval=null", f"run.storage_path={storage}", f"run.name={name}",
    ])
    corpus = prepare_data(cfg.data, str(stores), cfg.data.seq_len, use_ray=False, log=lambda _: None)
    train(worker_plan(cfg, corpus), WorkerLayout(), torch.device("cpu"))
    run_dir = Path(checkpoint_root(cfg.checkpoint, cfg.run)).parent
    (run_dir / "tokenizer.json").write_text(corpus.tokenizer_json)
    return run_dir
