"""jobs/gpu_check.py: meshtrain's trainer in one process, no Ray, as the lent GPU machine's image can run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtrain_bench import device_pack
from meshtrain_bench.gpu_check import Check, Runner, Window, main, out_of_memory_line, parse_args, selected
from meshtrain.distributed.plan import GIB
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


def test_torch_outside_the_range_is_one_line() -> None:
    for supported in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu"):
        check_torch(supported)
    for version in ("2.10.0+cu128", "2.14.0", "1.13.1"):
        with pytest.raises(UnsupportedTorch, match=r"meshtrain needs torch>=2\.11,<2\.14"):
            check_torch(version)


def test_the_readme_gives_the_device_call_that_fits() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(device_pack.DEVICE_COMMAND) <= 2000
    assert device_pack.DEVICE_COMMAND in readme and json.dumps(device_pack.DEVICE_CARRY) in readme
