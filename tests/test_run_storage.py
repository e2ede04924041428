"""Run storage before Ray starts: run.storage_path and checkpoint.path must take a file (local or s3://,
one line naming the setting otherwise), and a run name whose launch failed before its first
checkpoint may be launched again with another config."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import yaml

from meshtrain.checkpoint.storage import COMMIT_MARKER
from meshtrain.cluster.launcher import resolve_run
from meshtrain.cluster.resume import write_run_config
from meshtrain.cluster.preflight import preflight
from meshtrain.config import ConfigError
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from s3server import moto_s3


def config(storage: Path, *overrides: str) -> MeshtrainConfig:
    return load_config(None, [f"run.storage_path={storage}", "run.name=r", *overrides])


# --- local directories --------------------------------------------------------------------------


def test_existing_and_creatable_directories_pass_and_nothing_is_left(tmp_path: Path) -> None:
    preflight(config(tmp_path, f"checkpoint.path={tmp_path / 'not' / 'yet' / 'there'}"))
    preflight(config(tmp_path / "new" / "runs", f"checkpoint.path=file://{tmp_path}"))
    assert list(tmp_path.iterdir()) == []  # no probe left, no directory created


def test_a_file_in_the_way_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=rf"^run.storage_path: {re.escape(str(blocker))} is a file, not a directory, on "
                                          rf"the way to {re.escape(str(blocker))}/runs; move the file or choose another "
                                          r"run.storage_path$"):
        preflight(config(blocker / "runs"))
    with pytest.raises(ConfigError, match=rf"^checkpoint.path: {re.escape(str(blocker))} is a file, not a directory; move the file or "
                                          r"choose another checkpoint.path$"):
        preflight(config(tmp_path, f"checkpoint.path={blocker}"))
    preflight(config(tmp_path, f"checkpoint.path={blocker}", "checkpoint.enabled=false"))  # not used: not checked


def test_a_directory_that_refuses_writes_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests run as root, which chmod cannot stop: the write itself is made to fail.
    def refused(*args: object, **kwargs: object) -> tuple[int, str]:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    with pytest.raises(ConfigError, match=rf"^run.storage_path: cannot write in {re.escape(str(tmp_path))} \(PermissionError: "
                                          r"Permission denied\); give a writable directory \(on a cluster, one every "
                                          r"node mounts\)$"):
        preflight(config(tmp_path / "runs"))


# --- s3:// --------------------------------------------------------------------------------------


def test_s3_checkpoint_path_is_probed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    with moto_s3(monkeypatch, "ckpts") as options:
        cfg = config(tmp_path, "checkpoint.path=s3://ckpts/runs")
        cfg.checkpoint.storage_options = options
        preflight(cfg)
        listed = boto3.client("s3", **options["client_kwargs"]).list_objects_v2(Bucket="ckpts")
        assert listed["KeyCount"] == 0  # the probe object was deleted
        cfg.checkpoint.path = "s3://missing/runs"
        with pytest.raises(ConfigError) as error:
            preflight(cfg)
    assert str(error.value) == (
        "checkpoint.path: cannot write and delete a test object under s3://missing/runs (FileNotFoundError: The "
        "specified bucket does not exist); create the bucket or fix the path, and give credentials that may write "
        "there (environment, instance role, or checkpoint.storage_options)"
    )


# --- launching again ----------------------------------------------------------------------------


def launch_config(storage: Path, *overrides: str) -> MeshtrainConfig:
    """What `launch` does before Ray: resolve the run and write config.yaml."""
    cfg, paths = resolve_run(config(storage, *overrides))
    write_run_config(cfg, paths)
    return cfg


def test_a_run_without_committed_checkpoints_starts_afresh_with_another_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "corpus.txt").write_text("some text")
    launch_config(tmp_path, f"data.source={tmp_path / 'empty'}")  # a launch that then failed: nothing trained
    run_dir = tmp_path / "r"
    (run_dir / "tokenizer.json").write_text("{}")  # fitted before the failure
    launch_config(tmp_path, f"data.source={tmp_path / 'corpus.txt'}")
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["source"] == str(tmp_path / "corpus.txt")
    [kept] = run_dir.glob("config.*.yaml")
    assert yaml.safe_load(kept.read_text())["data"]["source"] == str(tmp_path / "empty")
    stamp = kept.name.removeprefix("config.").removesuffix(".yaml")
    assert not (run_dir / "tokenizer.json").exists() and (run_dir / f"tokenizer.{stamp}.json").exists()
    assert capsys.readouterr().out == (
        f"[meshtrain] run r has no committed checkpoint: it starts afresh with data.source="
        f"'{tmp_path / 'corpus.txt'}' (was '{tmp_path / 'empty'}'); the earlier config is kept as {kept.name}\n"
    )

    committed = run_dir / "checkpoints" / "step-00000010"
    committed.mkdir(parents=True)
    (committed / COMMIT_MARKER).write_text("{}")
    with pytest.raises(ConfigError, match=r"^data.source: run r was started with '.*corpus.txt', not '.*empty', and has "
                                          r"committed checkpoints; a re-run resumes the same training, so keep it or "
                                          r"choose another run.name$"):
        launch_config(tmp_path, f"data.source={tmp_path / 'empty'}")
