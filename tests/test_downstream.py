"""Downstream evaluation: a committed checkpoint scored by lm-evaluation-harness, offline.

The tasks are harness YAMLs over local JSONL in tests/data/downstream (a multiple-choice task and a
perplexity task). meshtrain hands the harness the checkpoint as an in-memory ``transformers`` Llama;
its numbers must be those the harness gives on the same checkpoint exported with the hf format.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from corpora import trained_tiny_run
from meshtrain.checkpoint.export import export_checkpoint
from meshtrain.checkpoint.reading import load_model_state
from meshtrain.cli.evaluate import main as evaluate_main
from meshtrain.config import ConfigError
from meshtrain.config.loading import load_config
from meshtrain.evaluate.checkpoint_eval import results_folder
from meshtrain.evaluate.harness import HarnessRun, metrics_of, run_harness, task_manager
from meshtrain.evaluate.hf_model import load_checkpoint_model
from meshtrain.model.llama import build_model

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "data" / "downstream"
HARNESS = HarnessRun(("meshtrain_mc", "meshtrain_ppl"), str(TASKS), num_fewshot=2, limit=12, batch_size=4)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained run (tied embeddings, GQA) with committed checkpoints at steps 2 and 4 and its tokenizer."""
    return trained_tiny_run(tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("stores"), "scored", 2)


def test_meshtrain_scores_equal_the_harness_on_the_hf_export(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    checkpoint = str(run_dir / "checkpoints" / "step-00000004")
    loaded = load_checkpoint_model(checkpoint)
    assert loaded.step == 4 and loaded.model.config.tie_word_embeddings
    # The in-memory Llama is meshtrain's model, logit for logit (the harness's wrapper ties the head
    # itself, so this is checked before it sees the model).
    state, args, _ = load_model_state(checkpoint)
    own = build_model(args, "cpu")
    own.load_state_dict(state)
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded.model(tokens).logits, own.eval()(tokens), rtol=1e-5, atol=1e-5)
    ours = metrics_of(run_harness(loaded, HARNESS))

    # What a user runs without meshtrain: the hf export, loaded by the harness's own HF wrapper.
    export_checkpoint(checkpoint, "hf", tmp_path / "hf")
    exported = HFLM(pretrained=str(tmp_path / "hf"), dtype="float32", batch_size=4, device="cpu")
    manager = task_manager(HARNESS)
    monkeypatch.chdir(TASKS)  # the harness reads data_files relative to the working directory
    theirs = metrics_of(simple_evaluate(model=exported, tasks=list(HARNESS.tasks), task_manager=manager,
                                        num_fewshot=2, limit=12))
    print(f"meshtrain: {ours}\nharness on the hf export: {theirs}")
    assert set(ours) == {"meshtrain_mc", "meshtrain_ppl"}
    assert set(ours["meshtrain_mc"]) == {"acc", "acc_norm"}
    assert set(ours["meshtrain_ppl"]) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    for task, values in theirs.items():
        assert ours[task] == pytest.approx(values, rel=1e-6), task


def test_jobs_evaluate_writes_the_harness_results_into_the_run(run_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "evaluate.py"), str(run_dir), "--tasks", "meshtrain_mc,meshtrain_ppl",
         "--include-path", str(TASKS), "--num-fewshot", "2", "--limit", "12", "--batch-size", "4"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[meshtrain] downstream step 4 meshtrain_mc (12 examples, " in result.stdout, result.stdout
    folder = results_folder(run_dir, 4)  # the newest committed step of the run
    saved = json.loads((folder / "results.json").read_text())
    assert set(saved["results"]) == {"meshtrain_mc", "meshtrain_ppl"} and saved["n-shot"]["meshtrain_mc"] == 2
    samples = (folder / "samples_meshtrain_mc.jsonl").read_text().splitlines()
    assert len(samples) == 12 and "filtered_resps" in json.loads(samples[0])


def test_the_mean_of_the_newest_checkpoints_is_scored_as_one_model(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = load_checkpoint_model(str(run_dir / "checkpoints"), average=2)
    two, _, _ = load_model_state(str(run_dir / "checkpoints" / "step-00000002"))
    four, _, _ = load_model_state(str(run_dir / "checkpoints" / "step-00000004"))
    mean = (two["tok_embeddings.weight"] + four["tok_embeddings.weight"]) / 2
    assert loaded.step == 4 and torch.equal(loaded.model.model.embed_tokens.weight, mean)
    capsys.readouterr()  # what loading printed (torchao's first import in this process) is not the command's
    assert evaluate_main([str(run_dir), "--tasks", "meshtrain_mc", "--include-path", str(TASKS), "--average", "2"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == ["evaluate: error: --average: the mean of several steps has no step's results folder; give --out"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--tasks", "meshtrain_nosuch", "--include-path", str(TASKS)], "--tasks: meshtrain_nosuch not found"),
        (["--tasks", "meshtrain_mc", "--include-path", str(REPO / "jobs" / "configs" / "nowhere")],
         "--include-path="),
        (["--tasks", " , "], "--tasks is empty"),
        (["--tasks", "meshtrain_mc", "--limit", "0"], "--limit=0"),
    ],
)
def test_bad_evaluation_input_is_one_line(
    run_dir: Path, arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) if "--limit" in arguments else _returns_two():
        code = evaluate_main([str(run_dir), *arguments])
        assert code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("evaluate: error: ") and message in error[0], error


class _returns_two:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> bool:
        return False


def test_a_checkpoint_without_its_run_tokenizer_is_refused(run_dir: Path, tmp_path: Path) -> None:
    tokenizer = run_dir / "tokenizer.json"
    tokenizer.rename(tmp_path / "tokenizer.json")
    try:
        with pytest.raises(ConfigError, match=r"its run folder has no tokenizer.json"):
            load_checkpoint_model(str(run_dir / "checkpoints" / "step-00000002"))
    finally:
        (tmp_path / "tokenizer.json").rename(tokenizer)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval.downstream.include_path=/nonexistent/tasks"], "eval.downstream.include_path='/nonexistent/tasks' is not a folder of task YAMLs"),
        (["eval.downstream.memory_gb=0.0001"], "eval.downstream.memory_gb=0.0001 cannot hold the model's weights"),
        (["checkpoint.enabled=false"], "eval.downstream.tasks and eval.samples.prompts work on committed checkpoints"),
        (["eval.downstream.every=0"], "eval.downstream.every"),
    ],
)
def test_bad_downstream_settings_are_refused_before_ray(tmp_path: Path, overrides: list[str], message: str) -> None:
    from meshtrain.cluster.preflight import preflight

    base = ["eval.downstream.tasks=[meshtrain_mc]", f"eval.downstream.include_path={TASKS}",
            f"run.storage_path={tmp_path}", "run.name=refused"]
    with pytest.raises((ConfigError, ValueError), match=re.escape(message)):
        preflight(load_config(None, [*base, *overrides]))


@pytest.mark.parametrize("every, steps, chosen", [(1, 50, [10, 20, 30, 40, 50]), (2, 55, [20, 40, 55]), (3, 60, [30, 60])])
def test_every_nth_committed_checkpoint_and_the_last_step_are_scored(every: int, steps: int, chosen: list[int]) -> None:
    from meshtrain.cluster.downstream import chosen_step

    cfg = load_config(None, ["eval.downstream.tasks=[meshtrain_mc]", f"eval.downstream.every={every}",
                             "checkpoint.interval=10", f"train.steps={steps}"])
    committed = [*range(10, steps + 1, 10), steps]
    every = cfg.checkpoint.interval * cfg.eval.downstream.every
    assert sorted({step for step in committed if chosen_step(step, every, cfg.train.steps)}) == chosen


@pytest.mark.parametrize(
    "overrides, resources",
    [
        ([], {"num_cpus": 1.0, "num_gpus": 0.0}),
        (["scaling.use_gpu=true"], {"num_cpus": 1.0, "num_gpus": 1.0}),  # a GPU cluster's evaluation gets a GPU
        (["scaling.use_gpu=true", "eval.downstream.num_gpus=0.5", "eval.downstream.memory_gb=2"],
         {"num_cpus": 1.0, "num_gpus": 0.5, "memory": 2 * 2**30}),
    ],
)
def test_each_evaluation_task_reserves_its_own_resources(overrides: list[str], resources: dict[str, float]) -> None:
    from meshtrain.cluster.downstream import task_resources

    cfg = load_config(None, ["eval.downstream.tasks=[meshtrain_mc]", *overrides])
    assert task_resources(cfg.eval.downstream, cfg.scaling.use_gpu) == resources


def test_without_the_harness_installed_downstream_evaluation_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from meshtrain.cluster.preflight import preflight

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^eval.downstream.tasks needs lm-evaluation-harness: pip install -e '.\[eval\]'"):
        preflight(load_config(None, ["eval.downstream.tasks=[meshtrain_mc]", f"run.storage_path={tmp_path}", "run.name=x"]))


def test_a_leased_checkpoint_outlives_pruning_until_released_or_expired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A downstream evaluation that queues behind training leases its checkpoint: checkpoint.keep
    prunes around it, and the checksummed file list never includes the lease."""
    import time

    from meshtrain.checkpoint import storage as storage_module
    from meshtrain.checkpoint.manager import CheckpointManager
    from meshtrain.checkpoint.storage import COMMIT_MARKER, CheckpointStorage

    storage = CheckpointStorage(str(tmp_path))
    for step in (10, 20, 30, 40):
        path = Path(storage.step_dir(step))
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"x")
        (path / COMMIT_MARKER).write_text("{}")
    manager = CheckpointManager(storage, rank=0, world_size=1, interval=10, keep=2, asynchronous=False)
    storage.lease(storage.step_dir(10), holder="test")
    assert storage.files(storage.step_dir(10)) == {"__0_0.distcp": 1}
    manager._prune(40)
    assert [c.step for c in storage.committed()] == [40, 30, 10]  # 20 pruned, 10 leased
    storage.release(storage.step_dir(10))
    manager._prune(40)
    assert [c.step for c in storage.committed()] == [40, 30]
    storage.lease(storage.step_dir(30), holder="a driver that died")
    (Path(storage.step_dir(50))).mkdir()
    (Path(storage.step_dir(50)) / COMMIT_MARKER).write_text("{}")
    later = time.time() + storage_module.LEASE_TTL_S + 1
    monkeypatch.setattr(storage_module.time, "time", lambda: later)
    manager._prune(50)
    assert [c.step for c in storage.committed()] == [50, 40]


def test_a_checkpoint_on_s3_is_scored_as_the_local_one(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import s3fs

    from s3server import moto_s3

    local = metrics_of(run_harness(load_checkpoint_model(str(run_dir / "checkpoints" / "step-00000004")), HARNESS))
    with moto_s3(monkeypatch, "evals") as options:
        fs = s3fs.S3FileSystem(**options)
        fs.put(str(run_dir / "checkpoints"), "evals/scored/checkpoints", recursive=True)
        fs.put(str(run_dir / "tokenizer.json"), "evals/scored/tokenizer.json")
        fs.invalidate_cache()
        endpoint = f"client_kwargs.endpoint_url={options['client_kwargs']['endpoint_url']}"
        # The run folder: its newest committed step.
        code = evaluate_main(["s3://evals/scored", "--tasks", ",".join(HARNESS.tasks), "--include-path",
                              str(TASKS), "--num-fewshot", "2", "--limit", "12", "--batch-size", "4",
                              f"--storage-option={endpoint}", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    assert "evaluated s3://evals/scored/checkpoints/step-00000004" in capsys.readouterr().out
    remote = metrics_of(json.loads((tmp_path / "out" / "results.json").read_text()))
    assert remote == local


# --- every failure is one line, and a results folder is checked before scoring ----------------------


def _evaluate(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of evaluate's main in this process; no traceback on stderr."""
    try:
        code = evaluate_main(arguments)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err.strip().splitlines()


def _no_scoring(monkeypatch: pytest.MonkeyPatch) -> None:
    import meshtrain.evaluate.checkpoint_eval as checkpoint_eval

    monkeypatch.setattr(checkpoint_eval, "evaluate_checkpoint", lambda *_, **__: pytest.fail("it scored"))


TASK_ARGUMENTS = ["--tasks", "meshtrain_mc", "--include-path", str(TASKS), "--limit", "2"]


def test_an_out_under_a_file_is_refused_before_scoring(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_scoring(monkeypatch)
    (tmp_path / "file").write_text("")
    code, lines = _evaluate([str(run_dir), *TASK_ARGUMENTS, "--out", str(tmp_path / "file" / "out")], capsys)
    assert code == 2 and lines == [
        f"evaluate: error: --out {tmp_path / 'file' / 'out'}: {tmp_path / 'file'} is a file, not a folder; give a "
        "writable folder"
    ]


def test_an_out_that_refuses_writes_is_refused_before_scoring(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe creates and removes a file there (a read-only mount or another user's folder refuses it)."""
    import errno
    import os
    import tempfile

    _no_scoring(monkeypatch)

    def refused(*_args: object, dir: str, **_kwargs: object) -> tuple[int, str]:  # noqa: A002 - mkstemp's name
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.path.join(dir, ".meshtrain-probe-x"))

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    code, lines = _evaluate([str(run_dir), *TASK_ARGUMENTS, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"evaluate: error: --out {tmp_path / 'out'}: cannot write in {tmp_path} "
                               "(PermissionError: Permission denied: "), lines
    assert lines[0].endswith("; give a writable folder")
    assert not (tmp_path / "out").exists()


def test_a_run_folder_whose_results_cannot_be_written_is_refused_before_scoring(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    _no_scoring(monkeypatch)
    copy = Path(shutil.copytree(run_dir, tmp_path / "run"))
    shutil.rmtree(copy / "downstream", ignore_errors=True)  # results an earlier test left
    (copy / "downstream").write_text("")  # a file where the results folder goes
    code, lines = _evaluate([str(copy), *TASK_ARGUMENTS], capsys)
    assert code == 2 and lines == [
        f"evaluate: error: results folder {copy / 'downstream'}: {copy / 'downstream'} is a file, not a folder; "
        "give --out a writable folder"
    ]


def test_a_task_whose_data_file_is_missing_is_one_line(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    tasks = Path(shutil.copytree(TASKS, tmp_path / "tasks"))
    (tasks / "mc_test.jsonl").unlink()
    code, lines = _evaluate([str(run_dir), "--tasks", "meshtrain_mc", "--include-path", str(tasks), "--limit", "2",
                             "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and lines[-1] == f"evaluate: error: FileNotFoundError: Unable to find '{tasks / 'mc_test.jsonl'}'"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (PermissionError("Forbidden"), 2, "evaluate: error: PermissionError: Forbidden; check the path's "
                                          "permissions, or the storage credentials (environment, instance role or "
                                          "storage options)"),
        (ConnectionRefusedError(111, "Connection refused"), 1,
         "evaluate: error: ConnectionRefusedError: Connection refused; the storage did not answer: check its "
         "endpoint and the network, then run the command again"),
        (KeyError("results"), 1, "evaluate: error: KeyError: 'results'"),
    ],
    ids=["forbidden", "refused", "unexpected"],
)
def test_any_other_evaluation_failure_is_one_line(
    run_dir: Path, tmp_path: Path, error: Exception, code: int, message: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import meshtrain.evaluate.checkpoint_eval as checkpoint_eval

    def failing(*_args: object, **_kwargs: object) -> None:
        raise error

    monkeypatch.setattr(checkpoint_eval, "evaluate_checkpoint", failing)
    assert _evaluate([str(run_dir), *TASK_ARGUMENTS, "--out", str(tmp_path / "out")], capsys) == (code, [message])
