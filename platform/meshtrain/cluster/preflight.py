"""Checks of a config against the world, before anything starts.

The schema (``meshtrain.config``) checks what a config says; this step checks what it names: that
data sources and stores exist, that a tokenizer file is one and fits the model, that a
``model.init_from`` directory holds Llama weights whose shape the config does not contradict, and
that the mesh fits the declared node layout. Errors are the same one-line ``ConfigError`` (exit 2).
The CLI (run, ``--dry-run``, ``prepare_data.py``) and the launcher call :func:`preflight`; once Ray
is connected, the launcher also asks whether the cluster can hold the workers (``capacity``).
"""

from __future__ import annotations

import os
from pathlib import Path

from meshtrain.config import ConfigError, DataConfig, MeshtrainConfig, ModelConfig, require_extra
from meshtrain.data import expand_local_source, tokenizer_vocab_size
from meshtrain.data.store import is_token_store
from meshtrain.distributed.float8 import Float8Unavailable, accelerator_lacks_float8, check_float8_device
from meshtrain.distributed.mesh import resolve_mesh_shape
from meshtrain.model.args import model_args
from meshtrain.model.flops import flops_per_token, highest_peak_flops
from meshtrain.model.hf_llama import CONFIG_KEYS, init_from_tokenizer, llama_shape
from meshtrain.observe.mlflow_tracker import check_mlflow
from meshtrain.observe.wandb_tracker import check_wandb


def preflight(cfg: MeshtrainConfig, *, tokenizer_fits: bool = True) -> MeshtrainConfig:
    """``cfg`` checked against the world, with what it takes from it: with ``model.init_from`` and
    ``data.tokenizer=train``, the tokenizer the weights were trained with. ``tokenizer_fits`` also
    loads a ``data.tokenizer`` file and checks its vocabulary against the model (a run and its dry
    run; preparing data does not need the model). Calling it again on its result changes nothing."""
    cfg = cfg.model_copy(deep=True)
    _check_init_from_shape(cfg.model)
    _check_data_paths(cfg.data)
    if cfg.model.init_from is not None:
        if cfg.data.tokenizer == "train":
            # Continued pretraining keeps the tokenizer the weights were trained with.
            cfg.data.tokenizer = init_from_tokenizer(cfg.model.init_from)
        cfg.check_seq_len(model_args(cfg, None))
    if cfg.parallel.shard != "auto" or cfg.scaling.workers_per_node is not None:
        resolve_mesh_shape(
            cfg.scaling.num_workers,
            cfg.scaling.workers_per_node or cfg.scaling.num_workers,
            cfg.parallel.strategy,
            cfg.parallel.shard,
        )
    if tokenizer_fits and cfg.data.tokenizer != "train":
        # A broken tokenizer file, or one too large for the model, fails here, before Ray starts.
        model_args(cfg, tokenizer_vocab_size(cfg.data.tokenizer, cfg.data.vocab_size))
    _check_preemption_budget(cfg)
    _check_float8(cfg)
    check_wandb(cfg)
    check_mlflow(cfg)
    return cfg


def _check_float8(cfg: MeshtrainConfig) -> None:
    """parallel.float8 needs torchao, and a GPU of compute capability 8.9+ when the type is known
    (workers check their device again: an unnamed type is only known there)."""
    if not cfg.parallel.float8:
        return
    require_extra("parallel.float8", "torchao", "float8")
    accelerator = cfg.scaling.accelerator_type
    if cfg.scaling.use_gpu and accelerator is not None and accelerator_lacks_float8(accelerator):
        raise ConfigError(
            f"parallel.float8=true needs compute capability 8.9+ (H100, H200, L4, L40S, B200); "
            f"scaling.accelerator_type={accelerator} is older: set parallel.float8=false"
        )
    if cfg.scaling.use_gpu and accelerator is None and not os.environ.get("RAY_ADDRESS"):
        # A local Ray trains on this machine's GPUs, so they can be asked now.
        import torch

        for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            try:
                check_float8_device(torch.device("cuda", index), holder="this machine")
            except Float8Unavailable as exc:
                raise ConfigError(str(exc)) from None


def _check_preemption_budget(cfg: MeshtrainConfig) -> None:
    """fault.preemption_save_s must hold at least one step. A step's time is known once measured (the
    trainer then warns); before that, a known GPU type bounds it from below: the step's model FLOPs per
    rank at the highest peak that type may have, i.e. at 100% MFU on its fastest variant."""
    budget = cfg.fault.preemption_save_s
    if budget is None or not cfg.scaling.use_gpu or cfg.scaling.accelerator_type is None:
        return
    peak = highest_peak_flops(cfg.scaling.accelerator_type)
    if peak is None:
        return
    vocab = cfg.data.vocab_size if cfg.data.tokenizer == "train" else (cfg.model.vocab_size or cfg.data.vocab_size)
    args = model_args(cfg, vocab)
    tokens_per_rank = cfg.train.global_batch_size * cfg.data.seq_len / cfg.scaling.num_workers
    floor_s = tokens_per_rank * flops_per_token(args, cfg.data.seq_len) / peak
    if budget < floor_s:
        raise ConfigError(
            f"fault.preemption_save_s={budget:g} is shorter than one step: {tokens_per_rank:,.0f} tokens per "
            f"{cfg.scaling.accelerator_type} take at least {floor_s:.1f} s even at 100% MFU; raise it toward the "
            "notice period (AWS spot: 120 s) or lower train.global_batch_size"
        )


def _check_init_from_shape(model: ModelConfig) -> None:
    """model.init_from is a Llama directory, and no explicit shape field contradicts its config.json."""
    if model.init_from is None:
        return
    for name, value in llama_shape(model.init_from).items():
        explicit = getattr(model, name)
        if explicit is not None and explicit != value:
            raise ConfigError(
                f"model.{name}: {explicit!r} conflicts with {CONFIG_KEYS[name]}={value!r} in "
                f"model.init_from's config.json; drop model.{name} (the weights fix the shape)"
            )


def _check_data_paths(data: DataConfig) -> None:
    for index, item in enumerate(data.source_list()):
        where = "data.source" if data.sources is None else f"data.sources.{index}.source"
        _check_source_exists(item.source, where, data)
    if data.validation.source is not None:
        _check_source_exists(data.validation.source, "data.validation.source", data)
    if data.tokenizer != "train" and not Path(data.tokenizer).expanduser().is_file():
        raise ConfigError(f"data.tokenizer: {data.tokenizer!r} is not a file; give a tokenizer.json path or 'train'")


def _check_source_exists(source: str, where: str, data: DataConfig) -> None:
    if source == "stdlib" or source.startswith("hf:") or "://" in source:
        return
    if not is_token_store(source, data.storage_options) and not expand_local_source(source):
        raise ConfigError(
            f"{where}: no files at {source!r}; give an existing file, directory or glob, a token store, "
            "'stdlib', or 'hf:<dataset>'"
        )
