"""The command line: one-line config errors with exit code 2, and --dry-run without Ray.

A few cases run ``python jobs/pretrain.py`` for real (exit code, stderr and the absence of a
traceback are then proven end to end); the rest call ``meshtrain.cli.pretrain.main`` in-process, with the
launcher replaced so that a config that wrongly passes validation fails the test instead of
starting Ray.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import meshtrain.cluster.launcher
from meshtrain.cli.pretrain import EXIT_CONFIG_ERROR, main
from meshtrain.config.loading import describe_fields, load_config
from meshtrain.config.schema import MeshtrainConfig

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = "jobs/pretrain.py"
ERROR_PREFIX = "meshtrain: config error: "
# Should a bad input ever get past validation, the launcher would try to join this (unreachable)
# cluster instead of starting a local Ray instance; the subprocess timeout then fails the test.
NO_CLUSTER = "127.0.0.1:9"
SUBPROCESS_TIMEOUT_S = 60


# --- helpers and fixtures ------------------------------------------------------------------------


def run_pretrain(*args: str, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_ADDRESS": NO_CLUSTER}
    return subprocess.run(
        [sys.executable, *python_flags, PRETRAIN, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )


def _refuse_ray() -> bool:
    raise AssertionError("the CLI started Ray: preflight let the config through")


def run_main(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``main(argv)`` in this process, with starting Ray forbidden."""
    monkeypatch.setattr(meshtrain.cluster.launcher, "init_ray", _refuse_ray)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse exits on its own
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_config_error(code: int, out: str, err: str, names: str) -> None:
    assert code == EXIT_CONFIG_ERROR == 2, (code, err)
    assert "Traceback" not in err and "Traceback" not in out
    assert err.endswith("\n")
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(ERROR_PREFIX), lines[0]
    assert names in lines[0], lines[0]
    assert len(lines[0]) > len(ERROR_PREFIX) + len(names) + 10  # it says more than the name
    assert out == ""


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny tokenizer.json with an end-of-text token (what --dry-run needs from a tokenizer file)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "hello": 2, "world": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_configs")
    files = {
        "invalid_yaml": ("invalid.yaml", "train:\n  steps: 5\n  seed: [1, 2\n"),
        "list_yaml": ("list.yaml", "- train.steps=5\n- model.preset=125m\n"),
        "bad_value_yaml": ("bad_value.yaml", "train:\n  steps: -1\n"),
        "unknown_key_yaml": ("unknown_key.yaml", "parallel:\n  sharding: 2\n"),
        "broken_tokenizer": ("tokenizer.json", '{"this is": "not a tokenizer"}'),
    }
    paths = {}
    for key, (name, text) in files.items():
        paths[key] = root / name
        paths[key].write_text(text)
    paths["missing"] = root / "does-not-exist.yaml"
    paths["missing_tokenizer"] = root / "no-tokenizer.json"
    return paths


# --- real subprocesses: bad inputs ---------------------------------------------------------------

SUBPROCESS_CASES = [
    (["train.stepz=5"], "train.stepz"),
    (["train.steps=abc"], "train.steps"),
    (["parallel.shard=3"], "parallel.shard"),
    (["--config", "{missing}"], "--config"),
    (["data.source=/nonexistent/x.jsonl"], "data.source"),
    (["--bogus"], "--bogus"),
    (["--dry-run", "optim.lr=inf"], "optim.lr"),
]


@pytest.mark.parametrize(("argv", "names"), SUBPROCESS_CASES, ids=[" ".join(a) for a, _ in SUBPROCESS_CASES])
def test_bad_input_subprocess(
    argv: list[str], names: str, bad_files: dict[str, Path], tmp_path: Path
) -> None:
    argv = [arg.format(missing=bad_files["missing"]) for arg in argv]
    # run.storage_path keeps any run a regression might start out of the repository's runs/.
    result = run_pretrain(*argv, f"run.storage_path={tmp_path}")
    assert_one_line_config_error(result.returncode, result.stdout, result.stderr, names)
    assert list(tmp_path.iterdir()) == []  # nothing written: the run never started


# --- in-process: every kind of bad input ---------------------------------------------------------

IN_PROCESS_CASES = [
    # unknown keys
    (["train.stepz=5"], "train.stepz"),
    (["foo.bar=1"], "foo"),
    (["model.layers=2"], "model.layers"),
    # wrong types
    (["train.steps=abc"], "train.steps"),
    (["optim.lr=fast"], "optim.lr"),
    (["scaling.use_gpu=maybe"], "scaling.use_gpu"),
    (["parallel.shard=two"], "parallel.shard"),
    (["parallel.shard=2.5"], "parallel.shard"),
    (["parallel.strategy=zero3"], "parallel.strategy"),
    (["train.steps="], "train.steps"),
    (["model=debug"], "model"),
    # zero / negative
    (["train.steps=0"], "train.steps"),
    (["train.steps=-5"], "train.steps"),
    (["train.micro_batch_size=-4"], "train.micro_batch_size"),
    (["scaling.num_workers=0"], "scaling.num_workers"),
    (["optim.lr=0"], "optim.lr"),
    (["parallel.shard=0"], "parallel.shard"),
    # malformed overrides
    (["train"], "override 'train'"),
    (["train..steps=1"], "override 'train..steps=1'"),
    # mesh: shard sizes that do not fit the workers
    (["parallel.shard=3"], "parallel.shard"),
    (["scaling.num_workers=4", "parallel.shard=3", "train.global_batch_size=32"], "parallel.shard"),
    (["scaling.num_workers=6", "scaling.workers_per_node=4", "train.global_batch_size=48"], "parallel.shard"),
    (["parallel.strategy=full_shard", "parallel.shard=1"], "parallel.shard"),
    (["parallel.strategy=no_shard", "parallel.shard=2"], "parallel.shard"),
    # tensor and context parallel
    (["parallel.tensor=3"], "parallel.tensor"),  # does not divide the 4 heads
    (["parallel.tensor=4", "scaling.num_workers=4"], "parallel.tensor"),  # nor the 2 KV heads
    (["parallel.tensor=2", "model.vocab_size=2049"], "parallel.tensor"),
    (["parallel.tensor=2", "scaling.num_workers=3", "train.global_batch_size=24"], "parallel.tensor"),
    (["parallel.tensor=2", "scaling.num_workers=6", "scaling.workers_per_node=3", "train.global_batch_size=24"],
     "parallel.tensor"),
    (["parallel.context=2", "data.seq_len=30"], "data.seq_len"),
    (["parallel.async_tensor=true", "parallel.tensor=2"], "parallel.async_tensor"),
    (["parallel.async_tensor=true"], "parallel.async_tensor"),
    # model
    (["model.preset=llama9"], "model.preset"),
    (["model.vocab_size=100"], "model.vocab_size"),
    (["model.n_kv_heads=3"], "model.n_kv_heads"),
    (["data.seq_len=2048"], "data.seq_len"),
    (["model.preset=125m", "data.seq_len=4096"], "data.seq_len"),
    (["model.rope_scaling.factor=0"], "model.rope_scaling.factor"),
    (["model.rope_scaling.factor=8"], "model.rope_scaling.low_freq_factor"),  # debug has no scaling
    (["model.preset=llama3.2_1b", "model.rope_scaling.low_freq_factor=4"],
     "model.rope_scaling.low_freq_factor"),
    (["model.rope_scaling.rope_type=yarn"], "model.rope_scaling.rope_type"),
    # batch
    (["train.global_batch_size=12"], "train.global_batch_size"),
    (["scaling.num_workers=3"], "train.global_batch_size"),
    # paths
    (["data.source=/nonexistent/x.jsonl"], "data.source"),
    (["data.tokenizer={missing_tokenizer}"], "data.tokenizer"),
    (["run.name=a/b"], "run.name"),
    (["run.name=prometheus"], "run.name"),
    (["run.name=a20.replica0"], "run.name"),
    (["run.storage_path=s3://bucket/runs"], "run.storage_path"),
    # storage that cannot take a file: refused before Ray starts, and by --dry-run
    (["run.storage_path={invalid_yaml}/runs"], "run.storage_path"),
    (["--dry-run", "run.storage_path={invalid_yaml}"], "run.storage_path"),
    (["--dry-run", "checkpoint.path={invalid_yaml}/checkpoints"], "checkpoint.path"),
    (["checkpoint.path=gs://bucket/ckpt"], "checkpoint.path"),
    (["data.cache_dir=gs://bucket/stores"], "data.cache_dir"),
    # LR schedule
    (["optim.schedule=wsd"], "optim.decay_fraction"),
    (["optim.schedule=wsd", "optim.decay_fraction=1"], "optim.decay_fraction"),
    (["train.steps=10"], "optim.warmup_steps"),
    # profiler windows outside the run, or too close to warm up between; ranks that are not workers
    (["profile.start_step=500"], "profile.start_step=500 is beyond train.steps=200"),
    (["profile.start_step=199", "profile.active_steps=5"], "profile.active_steps"),
    (["profile.start_step=5", "profile.every=2"], "profile.every"),
    (["profile.every=10"], "profile.every"),
    (["profile.start_step=5", "profile.ranks=[0, 2]"], "profile.ranks"),
    # memory: a CUDA allocator history asked of CPU workers; allocator options that are not name:value
    (["memory.history_entries=100000"], "memory.history_entries=100000 records CUDA allocations"),
    (["--dry-run", "memory.history_entries=100000"], "memory.history_entries"),
    (["memory.cuda_alloc_conf=expandable segments"], "memory.cuda_alloc_conf"),
    # non-finite numbers
    (["optim.lr=inf"], "optim.lr"),
    (["model.norm_eps=nan"], "model.norm_eps"),
    (["metrics.peak_flops_per_s=-inf"], "metrics.peak_flops_per_s"),
    # --config files
    (["--config", "{missing}"], "--config"),
    (["--config", "{invalid_yaml}"], "--config"),
    (["--config", "{list_yaml}"], "--config"),
    (["--config", "{bad_value_yaml}"], "train.steps"),
    (["--config", "{unknown_key_yaml}"], "parallel.sharding"),
    # command-line flags
    (["--bogus"], "--bogus"),
    (["--config"], "--config"),
    # also caught under --dry-run, before anything is printed
    (["--dry-run", "train.global_batch_size=12"], "train.global_batch_size"),
    (["--dry-run", "parallel.shard=3"], "parallel.shard"),
    (["--dry-run", "data.tokenizer={broken_tokenizer}"], "data.tokenizer"),
    (["--dry-run", "data.tokenizer={missing_tokenizer}"], "data.tokenizer"),
    # long runs: a preemption budget no step fits in (8B at 100% MFU on an H100 needs 3.8 s), evictions that cannot happen
    (
        ["--dry-run", "scaling.use_gpu=true", "scaling.accelerator_type=H100", "model.preset=llama3_8b",
         "data.seq_len=8192", "scaling.num_workers=64", "train.global_batch_size=512", "train.micro_batch_size=1",
         "run.preemption_save_s=0.5"],
        "run.preemption_save_s",
    ),
    (["scaling.num_workers=4", "scaling.min_workers=2", "train.micro_batch_size=4", "scaling.evict_stragglers=true",
      "train.steps=20", "optim.warmup_steps=2"], "scaling.evict_stragglers"),
    (["scaling.num_workers=8", "scaling.min_workers=6", "scaling.workers_per_node=4", "parallel.shard=2",
      "train.global_batch_size=48", "train.micro_batch_size=1", "scaling.evict_stragglers=true"], "scaling.evict_stragglers"),
    (["scaling.evict_stragglers=true"], "scaling.evict_stragglers"),
    # a replica-mode setting the restart mode would ignore
    (["fault_tolerance.heartbeat_timeout_s=2"], "fault_tolerance.heartbeat_timeout_s"),
    # a float8 recipe the named GPU cannot run
    (["scaling.use_gpu=true", "scaling.accelerator_type=A10G", "parallel.float8=true", "parallel.float8_recipe=rowwise"],
     "parallel.float8=true with parallel.float8_recipe=rowwise needs compute capability 8.9+"),
    # GPU dry run with 12 workers: 8 per node is assumed, which does not divide 12
    (
        ["--dry-run", "scaling.use_gpu=true", "scaling.num_workers=12", "train.global_batch_size=96"],
        "parallel.shard",
    ),
]


@pytest.mark.parametrize(("argv", "names"), IN_PROCESS_CASES, ids=[" ".join(a) for a, _ in IN_PROCESS_CASES])
def test_bad_input(
    argv: list[str],
    names: str,
    bad_files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = [arg.format(**bad_files) for arg in argv]
    code, out, err = run_main(argv, capsys, monkeypatch)
    assert_one_line_config_error(code, out, err, names)


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_an_allocator_setting_that_conflicts_with_the_environments_is_one_line(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, "max_split_size_mb:512")
    code, out, err = run_main(["scaling.use_gpu=true", "memory.cuda_alloc_conf=expandable_segments:True"], capsys,
                              monkeypatch)
    assert_one_line_config_error(
        code, out, err, f"memory.cuda_alloc_conf='expandable_segments:True' conflicts with {name}='max_split_size_mb:512'"
    )


def test_workers_get_the_flight_recorder_and_the_allocator_setting_through_rays_runtime_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from meshtrain.cluster.ray_trainer import build_trainer
    from meshtrain.cluster.worker_plan import worker_plan

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)

    def env_vars(*overrides: str) -> dict[str, str]:
        cfg = load_config(None, [f"run.storage_path={tmp_path}", "run.name=env", *overrides])
        plan = worker_plan(cfg, SimpleNamespace(vocab_size=512), "x")  # the tokenizer's size alone: no data read
        return build_trainer(plan).run_config.worker_runtime_env["env_vars"]

    assert env_vars() == {"TORCH_FR_BUFFER_SIZE": "2000"}  # CPU workers: no allocator setting
    assert env_vars("scaling.use_gpu=true") == {"TORCH_FR_BUFFER_SIZE": "2000",
                                                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert env_vars("scaling.use_gpu=true", "memory.cuda_alloc_conf=''", "run.hang_timeout_s=null") == {
        "PYTORCH_CUDA_ALLOC_CONF": ""}  # torch's default allocator; no watchdog, no recorder
    assert env_vars("run.flight_recorder_entries=0") == {}
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert env_vars("scaling.use_gpu=true") == {"TORCH_FR_BUFFER_SIZE": "2000"}  # the environment's is kept
    assert env_vars("scaling.use_gpu=true", "memory.cuda_alloc_conf=max_split_size_mb:512")[
        "PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_unwritable_run_storage_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    def refused(*args: object, **kwargs: object) -> tuple[int, str]:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refused)  # as root, chmod would not stop the write
    code, out, err = run_main(["--dry-run", f"run.storage_path={tmp_path}"], capsys, monkeypatch)
    assert_one_line_config_error(code, out, err, f"run.storage_path: cannot write in {tmp_path}")


def test_a_torch_outside_the_supported_range_is_one_line_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    code, out, err = run_main([f"run.storage_path={tmp_path}"], capsys, monkeypatch)
    assert_one_line_config_error(code, out, err, "torch 2.10.0+cu128 is not supported: meshtrain needs torch>=2.11,<2.14")


def test_a_metrics_address_this_machine_lacks_is_one_line_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, out, err = run_main([f"run.storage_path={tmp_path}", "metrics.bind_address=192.0.2.77"], capsys, monkeypatch)
    assert_one_line_config_error(code, out, err, "metrics.bind_address=192.0.2.77 is not an address of this machine")


def test_missing_config_message_says_what_to_do(
    bad_files: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = run_main(["--config", str(bad_files["missing"])], capsys, monkeypatch)
    assert code == 2
    missing = str(bad_files["missing"])
    assert err == f"{ERROR_PREFIX}--config: {missing!r} is not a file; give a YAML config path\n"


def test_invalid_yaml_message_names_the_line(
    bad_files: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _, err = run_main(["--config", str(bad_files["invalid_yaml"])], capsys, monkeypatch)
    assert code == 2
    assert re.fullmatch(
        re.escape(f"{ERROR_PREFIX}--config: {bad_files['invalid_yaml']} is not valid YAML at line ")
        + r"\d+; fix the syntax\n",
        err,
    ), err


def test_unknown_flag_message(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = run_main(["--bogus"], capsys, monkeypatch)
    assert code == 2
    assert err == f"{ERROR_PREFIX}unrecognized arguments: --bogus; see --help\n"


def test_prepare_data_takes_overrides_on_both_sides_of_its_options() -> None:
    from meshtrain.cli.prepare_data import parse_args

    args = parse_args(["data.seq_len=64", "--config", "job.yaml", "--max-parallel", "2", "run.name=a"])
    assert (args.config, args.max_parallel, args.overrides) == ("job.yaml", 2, ["data.seq_len=64", "run.name=a"])


def test_help_lists_every_setting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run_main(["--help"], capsys, monkeypatch)
    assert code == 0 and err == ""
    assert "--config" in out and "--dry-run" in out
    for name, _, description in describe_fields():
        row = rf"^  {re.escape(name)} +{re.escape(description)} \[default "
        assert re.search(row, out, re.MULTILINE), name


# --- --dry-run -----------------------------------------------------------------------------------

MEMORY_LABELS = (
    "parameters (fp32, sharded)",
    "gradients (fp32, sharded)",
    "optimizer state (AdamW, sharded)",
    "gathered units + their grads",
    "activations (estimate, recompute=",
    "logits + loss (estimate)",
    "head gradient, fp32 for its reduce-scatter",
    "at the loss's backward",
    "just after the head's backward",
    "at the end of backward",
    "total (peak: the largest of the three)",
)
MOMENTS = MEMORY_LABELS[-4:-1]
TOTAL = MEMORY_LABELS[-1]


def parse_dry_run(out: str) -> tuple[dict, dict[str, str], dict[str, float]]:
    """(printed config, report lines by their leading word, memory GiB by label)."""
    config_text, _, report = out.partition("\n---\n")
    config = yaml.safe_load(config_text)
    lines = report.splitlines()
    by_key = {line.split(":", 1)[0]: line for line in lines if not line.startswith(" ")}
    memory: dict[str, float] = {}
    header = next(i for i, line in enumerate(lines) if line.startswith("memory per rank (GiB):"))
    for line in lines[header + 1 :]:
        label, value = line.strip().rsplit(None, 1)
        memory[label] = float(value)
    return config, by_key, memory


def check_memory(memory: dict[str, float]) -> None:
    labels = [label for label in memory if not label.startswith("block recomputed in backward")]
    assert len(labels) == len(MEMORY_LABELS)
    for label, expected in zip(labels, MEMORY_LABELS, strict=True):
        assert label.startswith(expected), (label, expected)
    parts = [value for label, value in memory.items() if label not in (*MOMENTS, TOTAL)]
    assert all(value >= 0 for value in parts)
    # Each moment holds some of the terms; the peak is the largest moment.
    assert all(0 < memory[moment] <= sum(parts) + 0.01 for moment in MOMENTS)
    assert memory[TOTAL] == pytest.approx(max(memory[moment] for moment in MOMENTS), abs=0.002)


def test_dry_run_default_subprocess() -> None:
    # -X importtime lists every imported module on stderr: proof that Ray is not even imported.
    result = run_pretrain("--dry-run", python_flags=("-X", "importtime"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    imported = {
        line.split("|")[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "meshtrain.cli" in imported  # the listing is real
    assert not {module for module in imported if module == "ray" or module.startswith("ray.")}
    assert "Started a local Ray instance" not in result.stdout + result.stderr

    config, lines, memory = parse_dry_run(result.stdout)
    assert config == MeshtrainConfig().model_dump(mode="json")
    assert lines["parameters"] == "parameters: 1,311,872 (1.3M)"
    assert lines["mesh"].startswith("mesh: (replicate=1, shard=2) on 2 workers, strategy=hybrid_shard, ")
    assert "batch" in lines and "micro-batch 8 x 2 workers x 1 accumulation steps" in lines["batch"]
    check_memory(memory)


def test_dry_run_llama3_8b_subprocess(tokenizer_json: Path) -> None:
    result = run_pretrain(
        "--dry-run",
        "model.preset=llama3_8b",
        "scaling.use_gpu=true",
        "scaling.num_workers=16",
        "scaling.workers_per_node=8",
        "train.global_batch_size=64",
        "train.micro_batch_size=1",
        "data.seq_len=4096",
        f"data.tokenizer={tokenizer_json}",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "Started a local Ray instance" not in result.stdout + result.stderr

    config, lines, memory = parse_dry_run(result.stdout)
    assert config["model"]["preset"] == "llama3_8b" and config["data"]["tokenizer"] == str(tokenizer_json)
    match = re.fullmatch(r"parameters: ([\d,]+) \(([\d.]+)M\)", lines["parameters"])
    assert match, lines["parameters"]
    assert 7_900_000_000 <= int(match.group(1).replace(",", "")) <= 8_100_000_000
    assert "vocab=128256" in lines["model"] and "tied=False" in lines["model"]
    assert lines["mesh"] == (
        "mesh: (replicate=2, shard=8) on 16 workers, strategy=hybrid_shard, reshard_after_forward=True"
    )
    assert "micro-batch 1 x 16 workers x 4 accumulation steps" in lines["batch"]
    check_memory(memory)
    # bf16 compute on GPU; 8-way sharded fp32 state of ~8B parameters is ~3.7 GiB each for params/grads.
    assert memory["parameters (fp32, sharded)"] == pytest.approx(8.03e9 * 4 / 8 / 2**30, rel=0.01)
    sharded_params = memory["parameters (fp32, sharded)"]
    assert memory["optimizer state (AdamW, sharded)"] == pytest.approx(2 * sharded_params, abs=0.002)


@pytest.mark.parametrize(
    ("overrides", "mesh"),
    [
        ([], "mesh: (replicate=1, shard=2) on 2 workers, strategy=hybrid_shard, reshard_after_forward=True"),
        (
            ["scaling.num_workers=4", "scaling.workers_per_node=2", "train.global_batch_size=32"],
            "mesh: (replicate=2, shard=2) on 4 workers, strategy=hybrid_shard, reshard_after_forward=True",
        ),
        (
            ["scaling.num_workers=4", "parallel.strategy=full_shard", "train.global_batch_size=32"],
            "mesh: (replicate=1, shard=4) on 4 workers, strategy=full_shard, reshard_after_forward=True",
        ),
        (
            ["scaling.num_workers=4", "parallel.strategy=no_shard", "train.global_batch_size=32"],
            "mesh: (replicate=4, shard=1) on 4 workers, strategy=no_shard, reshard_after_forward=True",
        ),
        (
            ["scaling.num_workers=8", "parallel.strategy=hybrid_shard_zero2", "parallel.shard=4",
             "train.global_batch_size=64"],
            "mesh: (replicate=2, shard=4) on 8 workers, strategy=hybrid_shard_zero2, "
            "reshard_after_forward=False",
        ),
        (
            ["scaling.num_workers=16", "scaling.use_gpu=true", "train.global_batch_size=128"],
            "mesh: (replicate=2, shard=8) on 16 workers, strategy=hybrid_shard, reshard_after_forward=True "
            "(assuming 8 workers per node; set scaling.workers_per_node to be sure)",
        ),
    ],
)
def test_dry_run_mesh(
    overrides: list[str], mesh: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run_main(["--dry-run", *overrides], capsys, monkeypatch)
    assert code == 0, err
    assert err == ""
    _, lines, memory = parse_dry_run(out)
    assert lines["mesh"].split(" (assuming all workers")[0] == mesh
    check_memory(memory)


def test_dry_run_config_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = ["model.preset=125m", "train.steps=100", "optim.lr=1e-4", "parallel.shard=1", "run.name=2024"]
    code, out, err = run_main(["--dry-run", *overrides], capsys, monkeypatch)
    assert code == 0, err
    printed = tmp_path / "printed.yaml"
    printed.write_text(out.partition("\n---\n")[0])
    assert load_config(printed) == load_config(None, overrides)


def test_dry_run_with_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("scaling:\n  num_workers: 4\n  workers_per_node: 2\ntrain:\n  global_batch_size: 32\n")
    # Overrides on both sides of --config all count.
    argv = ["train.steps=70", "--config", str(path), "--dry-run", "parallel.strategy=hybrid_shard_zero2"]
    code, out, err = run_main(argv, capsys, monkeypatch)
    assert code == 0, err
    config, lines, _ = parse_dry_run(out)
    assert config["scaling"]["num_workers"] == 4 and config["parallel"]["strategy"] == "hybrid_shard_zero2"
    assert config["train"]["steps"] == 70
    assert lines["mesh"].startswith(
        "mesh: (replicate=2, shard=2) on 4 workers, strategy=hybrid_shard_zero2, "
    )


JOB_CONFIGS = sorted((REPO / "jobs" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=[path.name for path in JOB_CONFIGS])
def test_dry_run_shipped_job_config(
    path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = run_main(["--config", str(path), "--dry-run"], capsys, monkeypatch)
    assert code == 0, err
    config, lines, memory = parse_dry_run(out)
    assert config == load_config(path).model_dump(mode="json")
    assert lines["parameters"].startswith("parameters: ")
    check_memory(memory)


def test_an_unexpected_failure_in_a_dry_run_surfaces_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only config errors become the one-line exit 2; anything else keeps its own traceback (the
    handler of launch failures once masked it as an UnboundLocalError)."""
    import meshtrain.cli.pretrain as cli

    def broken(cfg: MeshtrainConfig, args: object, trace: bool) -> None:
        raise RuntimeError("the traced step broke")

    monkeypatch.setattr(cli, "dry_run", broken)
    with pytest.raises(RuntimeError, match="the traced step broke"):
        main(["--dry-run"])


# --- prepare_data: every failure is one line ----------------------------------------------------


def _prepare(
    failure: BaseException, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of prepare_data's main in this process, Ray replaced by nothing and the
    preparation by ``failure``."""
    import meshtrain.data.pipeline
    from meshtrain.cli.prepare_data import main as prepare_main

    def failing(*_args: object, **_kwargs: object) -> None:
        raise failure

    monkeypatch.setattr(meshtrain.cluster.launcher, "init_ray", lambda *_, **__: None)
    monkeypatch.setattr(meshtrain.data.pipeline, "prepare_data", failing)
    code = prepare_main([f"run.storage_path={tmp_path}"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err.strip().splitlines()


def test_prepare_data_ends_an_unexpected_failure_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Ray task's error: the remote traceback in its message, whose last error line is the one shown.
    failure = RuntimeError('Traceback (most recent call last):\n  File "x", line 1\nOSError: the object store is full')
    assert _prepare(failure, tmp_path, capsys, monkeypatch) == (
        1, ["prepare_data: error: OSError: the object store is full"]
    )


def test_prepare_data_finds_the_config_error_inside_a_tasks_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshtrain.config import ConfigError

    try:
        raise ConfigError("data.source: /data/a.jsonl line 3 is not JSON; fix or remove it")
    except ConfigError as cause:
        failure = RuntimeError("a prepare task failed")
        failure.__cause__ = cause
    assert _prepare(failure, tmp_path, capsys, monkeypatch) == (
        2, ["meshtrain: config error: data.source: /data/a.jsonl line 3 is not JSON; fix or remove it"]
    )


@pytest.mark.parametrize("address", [None, "ray://head.example:10001"])
def test_a_ray_that_does_not_start_is_one_line(
    address: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    def timed_out(*args: object, **kwargs: object) -> None:
        raise Exception("The current node timed out during startup. This could happen because some of the Ray "
                        "processes failed to startup.\nmore detail")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", timed_out)
    if address:
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = main([f"run.storage_path={tmp_path}"])
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in err + out and err.count("\n") == 1, err
    cause = "Exception: The current node timed out during startup."
    expected = (f"meshtrain: could not join the Ray cluster at RAY_ADDRESS={address} ({cause}" if address
                else f"meshtrain: could not start a local Ray ({cause}")
    assert err.startswith(expected), err
