"""Credentials in the config (storage_options, a user:password@ URL) are never written or shown:
not in config.yaml, --dry-run, the config's repr, the W&B config or MLflow params, nor a checkpoint's
COMMITTED marker; while fsspec (a moto S3 server here) still receives the live values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from corpora import stdlib_plan
from meshtrain.checkpoint.storage import COMMIT_MARKER, run_checkpoints
from meshtrain.cli.pretrain import main
from meshtrain.cluster.launcher import resolve_run
from meshtrain.cluster.resume import write_run_config
from meshtrain.config import REDACTED, ConfigError, redact_options, redact_url
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.observe.mlflow_tracker import mlflow_params
from meshtrain.observe.run_folder import RunPaths
from meshtrain.train.trainer import train
from meshtrain.cluster.worker_plan import worker_plan
from s3server import moto_s3

KEY, SECRET, TOKEN, NESTED = "AKIALIVEKEY0001", "liveSecretValue/0002", "liveSessionToken0003", "nestedSecret0004"
PASSWORD = "livePassword0005"
SECRETS = (KEY, SECRET, TOKEN, NESTED, PASSWORD)
TINY = [
    "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.ffn_dim=64", "data.vocab_size=300",
    "data.seq_len=16", "data.max_documents=8", "train.steps=2", "train.global_batch_size=2",
    "train.micro_batch_size=1", "optim.warmup_steps=1", "scaling.num_workers=1", "checkpoint.interval=2",
    "checkpoint.mode=sync", "eval.interval=null",
]


def credentials(s3_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Storage options carrying every kind of secret, reaching the moto server when given its options."""
    client_kwargs = {**(s3_options or {}).get("client_kwargs", {}), "aws_account_id": NESTED}
    return {"key": KEY, "secret": SECRET, "token": TOKEN, "client_kwargs": client_kwargs}


def config_with_secrets(storage: Path, options: dict[str, Any], *overrides: str) -> MeshtrainConfig:
    cfg = load_config(None, [
        f"run.storage_path={storage}", "run.name=secret", "checkpoint.path=s3://ckpts/runs",
        f"metrics.mlflow_tracking_uri=https://alice:{PASSWORD}@mlflow.example/",
        f"data.cache_dir=s3://bob:{PASSWORD}@stores/cache", *overrides,
    ])
    cfg.checkpoint.storage_options = options
    cfg.data.storage_options = options
    return cfg


def assert_no_secret(text: str, where: str) -> None:
    leaked = [secret for secret in SECRETS if secret in text]
    assert not leaked, f"{where} shows {leaked}"


def test_urls_lose_their_password_and_options_their_values() -> None:
    assert redact_url("https://alice:pw@host:8/x?y") == f"https://alice:{REDACTED}@host:8/x?y"
    assert redact_url("https://a:p@ss@host/x") == f"https://a:{REDACTED}@host/x"  # the last @ of the authority
    assert redact_url("https://ghp_token@github.com/o/r") == f"https://{REDACTED}@github.com/o/r"
    for unchanged in ("s3://bucket/user@example/x", "/data/a@b:c", "stdlib", "hf:user/set", "s3://bucket"):
        assert redact_url(unchanged) == unchanged
    assert redact_options({"key": "k", "anon": False, "n": 3, "none": None, "kw": {"list": ["a", True]}}) == {
        "key": REDACTED, "anon": False, "n": REDACTED, "none": None, "kw": {"list": [REDACTED, True]},
    }


def test_config_yaml_repr_and_trackers_redact_while_the_object_keeps_live_values(tmp_path: Path) -> None:
    cfg = config_with_secrets(
        tmp_path, credentials(), f"data.sources=[{{source: 'https://carol:{PASSWORD}@data.example/x.jsonl'}}]",
        f"data.validation.source=https://dave:{PASSWORD}@data.example/v.jsonl",
    )
    cfg, paths = resolve_run(cfg)
    write_run_config(cfg, paths)
    written = paths.config.read_text()
    assert_no_secret(written, "config.yaml")
    stored = yaml.safe_load(written)
    assert stored["checkpoint"]["storage_options"] == {
        "key": REDACTED, "secret": REDACTED, "token": REDACTED, "client_kwargs": {"aws_account_id": REDACTED},
    }
    assert stored["metrics"]["mlflow_tracking_uri"] == f"https://alice:{REDACTED}@mlflow.example/"
    settings = cfg.model_dump(mode="json")  # what the driver hands the trackers: the W&B config, the MLflow params
    for shown, where in ((repr(cfg), "repr"), (str(cfg), "str"), (repr(cfg.checkpoint), "repr(checkpoint)"),
                         (json.dumps(settings), "W&B config"), (repr(mlflow_params(settings)), "MLflow params")):
        assert_no_secret(shown, where)
    assert ("checkpoint.storage_options.key", REDACTED) in mlflow_params(settings)
    # The live object, handed to fsspec and pickled to workers, is untouched.
    assert cfg.checkpoint.storage_options == credentials() and cfg.data.storage_options == credentials()
    assert PASSWORD in cfg.metrics.mlflow_tracking_uri and PASSWORD in cfg.data.sources[0].source
    assert PASSWORD in cfg.model_copy(deep=True).data.cache_dir


def test_a_rerun_with_checkpoints_is_judged_on_redacted_values(tmp_path: Path) -> None:
    """Rotated credentials, in storage_options or in data.source's URL, leave the written config as it
    was; a run with checkpoints is not refused over them, and other storage options are resumable."""
    def launch_config(options: dict[str, Any], password: str) -> RunPaths:
        source = f"data.source=https://carol:{password}@data.example/x.jsonl"
        cfg, paths = resolve_run(config_with_secrets(tmp_path, options, source))
        write_run_config(cfg, paths)
        return paths

    paths = launch_config(credentials(), PASSWORD)
    committed = tmp_path / "secret" / "checkpoints" / "step-00000002"
    committed.mkdir(parents=True)
    (committed / COMMIT_MARKER).write_text("{}")
    launch_config({**credentials(), "secret": "rotated"}, "rotatedPassword")
    assert list(paths.run_dir.glob("config.*.yaml")) == []  # the same text: nothing to keep
    launch_config({"profile": "training"}, PASSWORD)  # a resumable change
    assert len(list(paths.run_dir.glob("config.*.yaml"))) == 1
    assert_no_secret("".join(path.read_text() for path in paths.run_dir.glob("config*.yaml")), "kept configs")


def test_dry_run_shows_no_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with moto_s3(monkeypatch, "ckpts") as s3_options:
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({
            "checkpoint": {"path": "s3://ckpts/runs", "storage_options": credentials(s3_options)},
            "data": {"storage_options": credentials(s3_options), "cache_dir": f"s3://bob:{PASSWORD}@stores/c"},
            "metrics": {"mlflow_tracking_uri": f"https://alice:{PASSWORD}@mlflow.example/"},
            "run": {"storage_path": str(tmp_path / "runs")},
        }))
        assert main(["--config", str(config), "--dry-run"]) == 0  # preflight wrote its probe with them
    out, err = capsys.readouterr()
    assert_no_secret(out + err, "--dry-run")
    assert f"key: {REDACTED}" in out


def test_a_bad_storage_options_value_is_not_echoed() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"checkpoint.storage_options={SECRET}"])
    assert str(error.value).startswith("checkpoint.storage_options:")
    assert_no_secret(str(error.value), "the error")


def test_checkpoint_marker_holds_no_credential_while_s3_gets_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    received: list[dict[str, Any]] = []
    original_init = s3fs.S3FileSystem.__init__

    def recording_init(self: s3fs.S3FileSystem, *args: Any, **kwargs: Any) -> None:
        received.append(kwargs)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "__init__", recording_init)
    corpus = stdlib_plan(tmp_path / "stores", documents=8, vocab_size=300, seq_len=16)
    with moto_s3(monkeypatch, "ckpts") as s3_options:
        cfg, _ = resolve_run(config_with_secrets(tmp_path, credentials(s3_options), *TINY))
        train(worker_plan(cfg, corpus), WorkerLayout(), torch.device("cpu"))
        storage = run_checkpoints(cfg.checkpoint, cfg.run)
        [checkpoint] = storage.committed()
        marker = storage.fs.cat_file(f"{checkpoint.path}/{COMMIT_MARKER}").decode()
    assert_no_secret(marker, "the COMMITTED marker")
    assert json.loads(marker)["config"]["checkpoint"]["storage_options"]["secret"] == REDACTED
    assert any(kw.get("key") == KEY and kw.get("secret") == SECRET and kw.get("token") == TOKEN for kw in received)
    assert {kw.get("client_kwargs", {}).get("aws_account_id") for kw in received} == {NESTED}



def test_a_source_url_password_stays_out_of_the_store_plan_and_errors() -> None:
    from meshtrain.cli.common import add_storage_option
    from meshtrain.config import SourceConfig
    from meshtrain.data.sources import SourcePlan, plan_source

    source = SourceConfig(source=f"https://alice:{PASSWORD}@corpus.example/data")
    plan = SourcePlan(source=source, loader="text", field="text", units=(), fingerprint="f")
    assert plan.describe()["source"] == f"https://alice:{REDACTED}@corpus.example/data"  # the manifest's copy
    assert plan.source.source == source.source  # the live value still reads the data
    with pytest.raises(ConfigError) as error:
        plan_source(source, 1 << 20)
    assert str(error.value).startswith("data.source:")
    assert_no_secret(str(error.value), "the error")
    with pytest.raises(ValueError) as malformed:  # a credential given without its key
        add_storage_option({}, SECRET)
    assert_no_secret(str(malformed.value), "the command lines' error")
