"""jobs/gpu_check.py: meshtrain's trainer in one process, no Ray, as the lent GPU machine's image can run it;
what travels there (jobs/gpu_check_pack.py) and the product path's figures (jobs/gpu_product.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtrain_bench import device_pack, gpu_product
from meshtrain_bench.gpu_check import Check, Runner, Window, main, out_of_memory_line, parse_args, selected
from meshtrain.distributed.plan import GIB
from meshtrain.observe.run_folder import CheckpointSaveRecord, TrainRecord
from record_samples import make
from meshtrain.distributed.torch_support import UnsupportedTorch, check_torch

REPO = Path(__file__).resolve().parents[1]
# What the GPU machine's image holds that the check may import (its torch and the packages around it),
# and what travels as wheels: anything else the check imports would fail there.
DEVICE_IMAGE = {
    "torch", "torchgen", "functorch", "triton", "numpy", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
    "filelock", "fsspec", "packaging", "yaml", "xxhash", "prometheus_client", "psutil", "tokenizers", "safetensors",
    "tqdm", "colorama", "setuptools", "pkg_resources", "jaraco", "more_itertools", "backports", "dill",
    "cython_runtime", "typing_extensions", "_distutils_hack", "google", "pyarrow", "pandas",
}
TRAVELLING = {"pydantic", "pydantic_core", "annotated_types", "typing_inspection", "torchao"}
# Run the check with these unimportable, as on the GPU machine, and list what it imported.
BLOCKED_RUN = """
import runpy, sys
class DeviceImage:
    LACKS = {"ray", "datasets", "tensorboardX", "s3fs", "transformers", "lm_eval", "wandb", "mlflow"}
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.LACKS:
            raise ImportError(f"{name} is not on the GPU machine's image")
sys.meta_path.insert(0, DeviceImage())
sys.argv = ["gpu_check", *sys.argv[1:]]
try:
    runpy.run_path("jobs/gpu_check.py", run_name="__main__")
finally:
    # Inductor's generated kernels are modules too (in its cache folder): not packages.
    modules = [n for n, m in list(sys.modules.items()) if "torchinductor" not in str(getattr(m, "__file__", ""))]
    imported = sorted({n.split(".")[0] for n in modules} - set(sys.stdlib_module_names))
    print("IMPORTED " + " ".join(m for m in imported if not m.startswith("_") or m == "_distutils_hack"))
"""


@pytest.fixture(scope="module")
def token_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The standard-library token store jobs/gpu_check_pack.py sends to the GPU machine."""
    return device_pack.prepare_store(tmp_path_factory.mktemp("pack") / "store")


def test_the_quick_check_runs_the_trainer_without_ray_or_datasets(token_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, "--cpu-smoke", "--quick", "--data", str(token_store),
         "--work", str(tmp_path / "work"), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    document = json.loads((out / "gpu_check.json").read_text())
    rows = {row["name"]: row for row in document["rows"]}
    assert [row["status"] for row in rows.values()] == ["ok"] * len(rows), rows
    assert set(rows) == {c.name for c in selected(parse_args(["--quick"]))}
    assert document["environment"]["ray_imported"] is False
    # The comparisons ran (CPU against CPU here: identical in fp32; bf16 within its bound).
    assert rows["debug-fp32"]["max_rel_diff"] == 0.0 and rows["debug-fp32-resume"]["max_rel_diff"] == 0.0
    assert 0 < rows["debug-bf16"]["max_rel_diff"] <= 2e-2
    assert sorted(map(int, rows["debug-fp32-resume"]["losses"])) == list(range(6, 11))
    assert rows["1b-compile"]["tokens_per_s"] > 0 and rows["1b-compile"]["mfu_full_attention"] > 0
    assert (out / "gpu_check.md").read_text().count("| ok |") == len(rows)
    assert (out / "trace.json.gz").stat().st_size > 0
    imported = set(run.stdout.split("IMPORTED ", 1)[1].split())
    assert imported - {"meshtrain", "meshtrain_bench"} <= DEVICE_IMAGE | TRAVELLING, imported - DEVICE_IMAGE - TRAVELLING
    assert {"pydantic", "torch"} <= imported


def test_a_failed_configuration_is_a_row_and_the_next_one_runs(
    single_rank_group: None, token_store: Path, tmp_path: Path
) -> None:
    runner = Runner(torch.device("cpu"), tmp_path, str(token_store), Window.for_request(2, 2), profile=False)
    debug = {"model.preset": "debug", "data.seq_len": 64, "train.global_batch_size": 2, "train.micro_batch_size": 2}
    bad = runner.run(Check("uneven", {**debug, "train.micro_batch_size": 3}, "throughput"), cpu=True)
    good = runner.run(Check("fine", debug, "throughput"), cpu=True)
    assert bad.status == "failed" and "\n" not in bad.reason and "micro_batch_size" in bad.reason
    assert good.status == "ok" and good.tokens_per_s > 0


def test_out_of_memory_names_the_plan_against_the_card() -> None:
    line = out_of_memory_line(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                              int(90.5 * GIB), int(79.2 * GIB))
    assert line.startswith("out of memory: plan 90.5 GiB against the card's 79.2 GiB (OutOfMemoryError: CUDA out")


def test_without_a_gpu_it_says_so_and_points_at_cpu_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU here" in err and "--cpu-smoke" in err


def test_a_bad_only_name_is_refused_before_the_gpu_is_looked_for(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--only", "nonexistent"]) == 2
    assert capsys.readouterr().err == "gpu_check: --only: 'nonexistent' matches no configuration; see --list\n"


def test_torch_outside_the_range_is_one_line() -> None:
    for supported in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu"):
        check_torch(supported)
    for version in ("2.10.0+cu128", "2.14.0", "1.13.1"):
        with pytest.raises(UnsupportedTorch, match=r"meshtrain needs torch>=2\.11,<2\.14"):
            check_torch(version)


def test_the_readme_gives_the_device_calls_that_fit() -> None:
    readme = (REPO / "README.md").read_text()
    for command in (device_pack.DEVICE_COMMAND, device_pack.PRODUCT_COMMAND):
        assert len(command) <= 2000 and command in readme
    assert json.dumps(device_pack.DEVICE_CARRY) in readme


def test_the_pack_carries_what_the_image_lacks_and_leaves_what_it_holds() -> None:
    needed = [("ray", "2.60.0"), ("pydantic_core", "2.50.5"), ("torch", "2.11.0"), ("nvidia-nccl-cu13", "2.28.9"),
              ("PyYAML", "6.0.4"), ("typing_extensions", "4.16.0"), ("py-spy", "0.4.3"), ("virtualenv", "21.15.11")]
    carried, stand_ins = device_pack.split_by_image(needed)
    assert carried == ["ray==2.60.0", "pydantic_core==2.50.5", "typing_extensions==4.16.0"]
    assert stand_ins == ["torch==2.11.0", "nvidia-nccl-cu13==2.28.9", "PyYAML==6.0.4"]


def _step(step: int, end: float, seconds: float, tokens_per_s: float = 1000.0) -> TrainRecord:
    return make(TrainRecord, step=step, time=end, step_time_s=seconds, tokens_per_s=tokens_per_s, flops_per_token=6e9)


def test_the_product_path_figures_come_from_the_records_and_the_scrapes() -> None:
    # Steps of 1 s; a save of step 5 (ending at t = 5) runs 2.3 s and blocks 0.1 s, and steps 6 and 7, which
    # start inside it, take 1.2 s (step 8 starts at 7.4, after it). The worker dies before step 9; the
    # resume from step 5 redoes steps 6-8, its first step ending 28 s after step 8's (t = 8.4).
    durations = {n: 1.2 if n in (6, 7) else 1.0 for n in range(1, 9)}
    first = [_step(n, sum(durations[m] for m in range(1, n + 1)), durations[n]) for n in durations]
    records = [*first, make(CheckpointSaveRecord, step=5, blocking_s=0.1, total_s=2.3),
               *[_step(n, 30.4 + n, 1.0) for n in range(6, 11)]]
    scrapes = gpu_product.Scrapes(mfu_by_step={4: 1000 * 6e9 / 1e15, 7: 1000 * 6e9 / 1e15 * 1.01},
                                  peak_device_bytes=3.0 * 2**30, peak_flops_per_s=1e15, ok=12)
    report = gpu_product.ProductReport(device="test", settings={})
    gpu_product.fill_from_run(report, records, {"peak_device_memory_bytes": 3 * 2**30}, scrapes, interval=5, kill_at=9)
    assert report.ray_tokens_per_s == pytest.approx(1000.0)
    assert (report.step_s_saving, report.step_s_not_saving) == (pytest.approx(1.2), pytest.approx(1.0))
    assert report.save_cost_over_interval == pytest.approx((0.1 + 0.4) / 5)
    assert (report.kill_to_first_step_s, report.steps_redone) == (pytest.approx(28.0), 3)
    assert report.kill_to_new_step_s == pytest.approx(31.0)
    assert report.prometheus_peak_bytes == report.trainer_peak_bytes
    assert report.mfu_max_rel_diff == pytest.approx(0.01)


def test_the_scraper_reads_a_workers_metrics_text() -> None:
    text = ('# HELP meshtrain_step Last completed optimizer step.\n# TYPE meshtrain_step gauge\n'
            'meshtrain_step{run="r",rank="0"} 12.0\nmeshtrain_mfu_ratio{run="r",rank="0"} 0.48\n'
            'meshtrain_loss{run="r",rank="0"} NaN\nprocess_cpu_seconds_total 3.0\n')
    assert gpu_product.parse_metrics(text) == {"meshtrain_step": 12.0, "meshtrain_mfu_ratio": 0.48}


def test_the_product_path_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu_product.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU here" in err and "--cpu-smoke" in err
