"""Checks of a config against the world, before anything starts.

The schema (``meshtrain.config``) checks what a config says; this step checks what it names: that
data sources and stores exist, that a tokenizer file is one and fits the model, that a
``model.init_from`` directory holds Llama weights whose shape the config does not contradict, that
the mesh fits the declared node layout, and that run and checkpoint storage take a written file. Errors are the same one-line ``ConfigError`` (exit 2).
The CLI (run, ``--dry-run``, ``prepare_data.py``) and the launcher call :func:`preflight`; once Ray
is connected, the launcher also asks whether the cluster can hold the workers (``capacity``).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import fsspec
from fsspec.core import split_protocol

from meshtrain.checkpoint.hf_weights import check_weight_headers
from meshtrain.checkpoint.storage import CheckpointStorage, checkpoint_root
from meshtrain.cluster.worker_env import worker_env
from meshtrain.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    MetricsConfig,
    ModelArgs,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    ScalingConfig,
    TrainConfig,
    one_line,
    redact_url,
    require_extra,
)
from meshtrain.config.evaluation import DownstreamEvalConfig
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import expand_local_source, tokenizer_vocab_size
from meshtrain.data.location import with_timeouts
from meshtrain.data.store import is_token_store
from meshtrain.distributed.float8 import (
    Float8Unavailable,
    accelerator_lacks_float8,
    check_float8_device,
    float8_requirement,
)
from meshtrain.distributed.mesh import resolve_mesh_shape
from meshtrain.distributed.plan import pipeline_order
from meshtrain.distributed.torch_support import check_torch
from meshtrain.distributed.replicas import check_torchft
from meshtrain.evaluate.harness import HarnessRun, task_manager
from meshtrain.model.args import model_args
from meshtrain.model.flops import flops_per_token, highest_peak_flops
from meshtrain.model.hf_llama import CONFIG_KEYS, hf_name, init_from_tokenizer, llama_shape
from meshtrain.model.llama import build_model, count_parameters
from meshtrain.observe.mlflow_tracker import check_mlflow
from meshtrain.observe.wandb_tracker import check_wandb


class Preflighted(NamedTuple):
    config: MeshtrainConfig
    model: ModelArgs  # the model's shape as far as it is known before the data is prepared (the dry run's)


def preflight(cfg: MeshtrainConfig, *, tokenizer_fits: bool = True, trains: bool = True) -> MeshtrainConfig:
    """``cfg`` checked against the world, with what it takes from it: with ``model.init_from`` and
    ``data.tokenizer=train``, the tokenizer the weights were trained with. ``tokenizer_fits`` also
    loads a ``data.tokenizer`` file and checks its vocabulary against the model (a run and its dry
    run; preparing data does not need the model). ``trains``: training follows (a launch), where a dry
    run and data preparation only plan. Calling it again on its result changes nothing."""
    return preflighted(cfg, tokenizer_fits=tokenizer_fits, trains=trains).config


def preflighted(cfg: MeshtrainConfig, *, tokenizer_fits: bool = True, trains: bool = True) -> Preflighted:
    """:func:`preflight`, with the model's shape it checked."""
    check_torch()
    cfg = cfg.model_copy(deep=True)
    resumes = cfg.model.init_from is not None and _resumes_from_checkpoint(cfg.checkpoint, cfg.run)
    _check_init_from_shape(cfg.model, resumes=resumes)
    _check_data_paths(cfg.data)
    _check_local_directory(Path(cfg.run.storage_path), "run.storage_path")
    if cfg.checkpoint.enabled and cfg.checkpoint.path is not None:
        _check_checkpoint_root(cfg.checkpoint.path, cfg.checkpoint.storage_options)
    if cfg.model.init_from is not None and cfg.data.tokenizer == "train":
        # Continued pretraining keeps the tokenizer the weights were trained with.
        cfg.data.tokenizer = init_from_tokenizer(cfg.model.init_from)
    # The model's shape, resolved once for every check below. The schema checked the shape it could
    # resolve without files; this one has model.init_from's config.json and, with tokenizer_fits,
    # the tokenizer file's vocabulary (a broken file, or one too large for the model, fails here).
    args = model_args(cfg.model, _tokenizer_vocab(cfg.data, cfg.model, loads_tokenizer=tokenizer_fits))
    cfg.check_seq_len(args)
    cfg.parallel.check_model(args)
    if cfg.parallel.shard != "auto" or cfg.scaling.workers_per_node is not None:
        resolve_mesh_shape(
            cfg.scaling.num_workers,
            cfg.scaling.workers_per_node or cfg.scaling.num_workers,
            cfg.parallel.strategy,
            cfg.parallel.shard,
            cfg.parallel.context,
            cfg.parallel.tensor,
            cfg.parallel.pipeline,
        )
    if cfg.parallel.pipeline > 1:
        pipeline_order(cfg.parallel)  # torch's own schedule takes the layout, or its reason is one line
    if cfg.fault_tolerance.mode == "replica":
        check_torchft()
    _check_preemption_budget(cfg.run, cfg.scaling, cfg.train, cfg.data.longest_seq_len(), args)
    _check_metrics_address(cfg.metrics)
    _check_float8(cfg.parallel, cfg.scaling)
    _check_downstream(cfg.eval.downstream, cfg.scaling.use_gpu, args)
    worker_env(cfg.run, cfg.scaling, cfg.memory, os.environ)  # an allocator setting that conflicts with the environment's
    check_wandb(cfg.metrics)
    check_mlflow(cfg.metrics)
    return Preflighted(cfg, args)


def _tokenizer_vocab(data: DataConfig, model: ModelConfig, loads_tokenizer: bool) -> int | None:
    """The tokenizer's vocabulary as far as it is known before the data is prepared: data.vocab_size for
    one to be trained (it has at most that many tokens); a tokenizer file's own when ``loads_tokenizer``;
    without loading it, none with model.init_from (its config.json gives the vocabulary), else the
    schema's stand-in (model.vocab_size, or data.vocab_size)."""
    if data.tokenizer == "train":
        return data.vocab_size
    if loads_tokenizer:
        return tokenizer_vocab_size(data.tokenizer, data.vocab_size)
    if model.init_from is not None:
        return None
    return model.vocab_size or data.vocab_size


def _check_float8(parallel: ParallelConfig, scaling: ScalingConfig) -> None:
    """parallel.float8 needs torchao, and a GPU of compute capability 8.9+ when the type is known
    (workers check their device again: an unnamed type is only known there)."""
    if not parallel.float8:
        return
    require_extra("parallel.float8", "torchao", "float8")
    accelerator = scaling.accelerator_type
    if scaling.use_gpu and accelerator is not None and accelerator_lacks_float8(accelerator):
        raise ConfigError(
            f"{float8_requirement(parallel.float8_recipe)}; scaling.accelerator_type={accelerator} is older: "
            f"set parallel.float8=false"
        )
    if scaling.use_gpu and accelerator is None and not os.environ.get("RAY_ADDRESS"):
        # A local Ray trains on this machine's GPUs, so they can be asked now.
        import torch

        for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            try:
                check_float8_device(torch.device("cuda", index), holder="this machine",
                                    recipe=parallel.float8_recipe)
            except Float8Unavailable as exc:
                raise ConfigError(str(exc)) from None


def _check_downstream(downstream: DownstreamEvalConfig, use_gpu: bool, args: ModelArgs) -> None:
    """eval.downstream: the harness installed, every task known, and a memory reservation that can
    hold the weights of the model of shape ``args`` (fp32 on CPU, bf16 on a GPU; ``use_gpu``:
    scaling.use_gpu, the default of eval.downstream.num_gpus)."""
    if not downstream.enabled:
        return
    if importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("accelerate") is None:
        raise ConfigError("eval.downstream.tasks needs lm-evaluation-harness: pip install -e '.[eval]', or set "
                          "eval.downstream.tasks=[]")
    task_manager(HarnessRun.of(downstream))
    if downstream.memory_gb is not None:
        on_gpu = (downstream.num_gpus if downstream.num_gpus is not None else float(use_gpu)) > 0
        weights = count_parameters(build_model(args, "meta"))
        weights *= 2 if on_gpu else 4
        if weights > downstream.memory_gb * 2**30:
            raise ConfigError(
                f"eval.downstream.memory_gb={downstream.memory_gb:g} cannot hold the model's weights "
                f"({weights / 2**30:.1f} GiB in {'bf16' if on_gpu else 'fp32'}) and the harness's batches; raise it "
                f"above {weights / 2**30:.1f} or leave it unset"
            )


def _check_metrics_address(metrics: MetricsConfig) -> None:
    """A local run's workers serve /metrics on this machine: an address it does not have is refused here
    (on a cluster each worker checks its own node, and a wrong address stops the run at once)."""
    address = metrics.bind_address
    if not metrics.port or ipaddress.ip_address(address).is_unspecified or os.environ.get("RAY_ADDRESS"):
        return
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as exc:
            raise ConfigError(
                f"metrics.bind_address={address} is not an address of this machine ({exc.strerror}); use 0.0.0.0 "
                "(every interface), 127.0.0.1, or one of its addresses"
            ) from None


def _check_preemption_budget(run: RunConfig, scaling: ScalingConfig, train: TrainConfig, seq_len: int,
                             args: ModelArgs) -> None:
    """run.preemption_save_s must hold at least one step. A step's time is known once measured (the
    trainer then warns); before that, a known GPU type bounds it from below: the step's model FLOPs per
    rank (of ``seq_len``-token windows, a model of shape ``args``) at the highest peak that type may
    have, i.e. at 100% MFU on its fastest variant."""
    budget = run.preemption_save_s
    if budget is None or not scaling.use_gpu or scaling.accelerator_type is None:
        return
    peak = highest_peak_flops(scaling.accelerator_type)
    if peak is None:
        return
    tokens_per_rank = train.global_batch_size * seq_len / scaling.num_workers
    floor_s = tokens_per_rank * flops_per_token(args, seq_len) / peak
    if budget < floor_s:
        raise ConfigError(
            f"run.preemption_save_s={budget:g} is shorter than one step: {tokens_per_rank:,.0f} tokens per "
            f"{scaling.accelerator_type} take at least {floor_s:.1f} s even at 100% MFU; raise it toward the "
            "notice period (AWS spot: 120 s) or lower train.global_batch_size"
        )


def _check_init_from_shape(model: ModelConfig, resumes: bool = False) -> None:
    """model.init_from is a Llama directory, and no explicit shape field contradicts its config.json; unless
    the run ``resumes`` from a checkpoint (its weights are not read then), the weight files are intact."""
    if model.init_from is None:
        return
    shape = llama_shape(model.init_from)  # every config.json value read is checked there, bounds included
    for name, value in shape.items():
        explicit = getattr(model, name)
        if name == "rope_scaling" and explicit is not None:
            _check_rope_scaling(explicit.model_dump(exclude_none=True), value or {})
            continue
        if explicit is not None and explicit != value:
            raise ConfigError(
                f"model.{name}: {explicit!r} conflicts with {CONFIG_KEYS[name]}={value!r} in "
                f"model.init_from's config.json; drop model.{name} (the weights fix the shape)"
            )
    if not resumes:
        _check_init_from_weights(model, shape)


def _resumes_from_checkpoint(checkpoint: CheckpointConfig, run: RunConfig) -> bool:
    """Whether the run will resume from a committed checkpoint (then, as the trainer decides, it reads no
    init_from weights). Storage that cannot be listed counts as no: the weights are checked then."""
    if not (checkpoint.enabled and checkpoint.resume) or run.name is None:
        return False
    options = checkpoint.storage_options
    if split_protocol(checkpoint.path or "")[0] in ("s3", "s3a"):
        options = with_timeouts(options, _PROBE_TIMEOUT_S)  # an unreachable endpoint does not hang the check
    try:
        return bool(CheckpointStorage(checkpoint_root(checkpoint, run), options).all_committed())
    except Exception:  # unreachable or refused: _check_checkpoint_root says why, in one line
        return False


def _check_init_from_weights(model: ModelConfig, shape: dict[str, Any]) -> None:
    """The safetensors headers (not the tensors) hold every weight of the shape config.json gives, intact:
    a truncated download or mismatched files fail here, not on every worker."""
    assert model.init_from is not None
    expected = build_model(model.resolved(None, shape), "meta").named_parameters()  # a tied head is one parameter
    check_weight_headers(model.init_from, {hf_name(name): tuple(param.shape) for name, param in expected})


def _check_rope_scaling(explicit: dict[str, Any], loaded: dict[str, Any]) -> None:
    """The model.rope_scaling fields a config sets must be those of the weights' config.json."""
    for key, value in explicit.items():
        if loaded.get(key) != value:
            raise ConfigError(
                f"model.rope_scaling.{key}: {value!r} conflicts with rope_scaling.{key}={loaded.get(key)!r} in "
                f"model.init_from's config.json; drop model.rope_scaling.{key} (the weights fix the shape)"
            )


def _check_data_paths(data: DataConfig) -> None:
    for index, item in enumerate(data.source_list()):
        where = "data.source" if data.sources is None else f"data.sources.{index}.source"
        _check_remote_source(item.source, where, data)
        _check_source_exists(item.source, where, data)
    if data.validation.source is not None:
        _check_remote_source(data.validation.source, "data.validation.source", data)
        _check_source_exists(data.validation.source, "data.validation.source", data)
    if data.tokenizer != "train" and not Path(data.tokenizer).expanduser().is_file():
        raise ConfigError(f"data.tokenizer: {data.tokenizer!r} is not a file; give a tokenizer.json path or 'train'")


def _check_remote_source(source: str, where: str, data: DataConfig) -> None:
    """An ``s3://`` source is a token store that answers: asked once for its manifest, with the store's
    timeouts (``data.read_timeout_s``), so a wrong endpoint, a refusal, wrong credentials or an endpoint
    that never answers is one line here, before Ray starts (see :func:`is_token_store`); and one that
    answers without a store is one line too (documents are read from local files only)."""
    if split_protocol(source)[0] != "s3":
        return
    if not is_token_store(source, data.storage_options, setting=where, timeout_s=data.read_timeout_s):
        raise ConfigError(
            f"{where}: {redact_url(source)} holds no token store (no manifest.json); fix the bucket and path, or "
            "prepare one with jobs/prepare_data.py and give the store URL it prints (raw documents must be local)"
        )


def _check_source_exists(source: str, where: str, data: DataConfig) -> None:
    if source == "stdlib" or source.startswith("hf:") or "://" in source:
        return
    if not is_token_store(source, data.storage_options) and not expand_local_source(source):
        raise ConfigError(
            f"{where}: no files at {source!r}; give an existing file, directory or glob, a token store, "
            "'stdlib', or 'hf:<dataset>'"
        )


_PROBE_PREFIX = ".meshtrain-probe-"
_PROBE_TIMEOUT_S = 30.0  # the whole remote probe, retries included


def _check_checkpoint_root(url: str, storage_options: dict[str, Any]) -> None:
    """ConfigError (one line) unless checkpoint.path takes a file: locally see
    :func:`_check_local_directory`; remotely a probe object is written under it and deleted."""
    scheme = split_protocol(url)[0]
    if scheme in (None, "file", "local"):
        _check_local_directory(Path(fsspec.core.url_to_fs(url)[1]), "checkpoint.path")
        return
    options = with_timeouts(storage_options, _PROBE_TIMEOUT_S) if scheme in ("s3", "s3a") else storage_options
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
        probe = f"{root.rstrip('/')}/{_PROBE_PREFIX}{uuid.uuid4().hex}"
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except Exception as exc:  # whatever the backend raises, the storage cannot be written
        raise ConfigError(
            f"checkpoint.path: cannot write and delete a test object under {redact_url(url)} ({_reason(exc)}); "
            "create the bucket or fix the path, and give credentials that may write there (environment, instance "
            "role, or checkpoint.storage_options)"
        ) from None


def _check_local_directory(directory: Path, setting: str) -> None:
    """ConfigError (one line) unless ``directory`` is one, or can be created, where this user can
    write: a probe file is written and deleted in it or its nearest existing parent (nothing else
    is created, so a dry run leaves no trace)."""
    try:
        existing = directory = directory.expanduser().absolute()
        while not existing.exists():
            existing = existing.parent
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot look at {directory} ({_reason(exc)}); give a directory this user can reach") from None
    if not existing.is_dir():
        below = "" if existing == directory else f", on the way to {directory}"
        raise ConfigError(
            f"{setting}: {existing} is a file, not a directory{below}; move the file or choose another {setting}"
        )
    try:
        handle, probe = tempfile.mkstemp(prefix=_PROBE_PREFIX, dir=existing)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"{setting}: cannot write in {existing} ({_reason(exc)}); give a writable directory "
            "(on a cluster, one every node mounts)"
        ) from None


def _reason(exc: BaseException) -> str:
    """The exception in one line, short enough to sit inside a one-line error."""
    return one_line(exc, limit=200)
