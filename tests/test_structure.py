"""The package's shape: layered subpackages with no cycles, a config schema that imports nothing of
the rest, typed packages that pass the type checker, and job scripts that only call the library."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "platform" / "meshtrain"


def lint_imports(config: Path) -> subprocess.CompletedProcess[str]:
    command = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert command is not None, "import-linter is a test dependency (pip install -e '.[test]')"
    return subprocess.run(
        [command, "--config", str(config), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_layers_hold_and_no_subpackage_imports_a_higher_one() -> None:
    result = lint_imports(REPO / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout, result.stdout


def test_the_contracts_catch_an_upward_import_and_the_whole_config_below_the_driver(tmp_path: Path) -> None:
    """The checks can fail: a copy of the package whose config imports the trainer, and whose loop imports
    the whole config's schema, breaks both."""
    copy = tmp_path / "platform" / "meshtrain"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    schema = copy / "config" / "schema.py"
    schema.write_text(schema.read_text() + "\n\ndef _upward() -> None:\n    import meshtrain.train.trainer  # noqa: F401\n")
    loop = copy / "train" / "loop.py"
    loop.write_text(loop.read_text() + "\n\ndef _whole() -> None:\n    import meshtrain.config.schema  # noqa: F401\n")
    config = tmp_path / "pyproject.toml"
    config.write_text((REPO / "pyproject.toml").read_text())
    command = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert command is not None
    result = subprocess.run(
        [command, "--config", str(config), "--no-cache"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env={"PYTHONPATH": str(tmp_path / "platform"), "PATH": str(Path(sys.executable).parent)},
    )
    assert result.returncode != 0, result.stdout
    assert "meshtrain.config.schema -> meshtrain.train.trainer" in result.stdout, result.stdout
    assert "meshtrain.train.loop -> meshtrain.config.schema" in result.stdout, result.stdout


def test_the_typed_packages_check_clean_and_a_misspelled_record_key_is_caught(tmp_path: Path) -> None:
    """observe/, train/, cluster/, distributed/ and ray_compat pass mypy as pyproject.toml configures it, and that
    configuration fails a record read under a misspelled field, and one written with a misspelled one."""
    from mypy import api

    settings = ["--config-file", str(REPO / "pyproject.toml"), "--cache-dir", str(REPO / ".mypy_cache")]
    report, errors, status = api.run(settings)
    assert status == 0, report + errors
    probe = tmp_path / "probe.py"
    probe.write_text("from meshtrain.observe.run_folder import StoppedRecord, TrainRecord\n\n\n"
                     "def loss(record: TrainRecord) -> float:\n    return record.los\n\n\n"
                     "def stop() -> StoppedRecord:\n    return StoppedRecord(step=1, reasn='why')\n")
    report, errors, status = api.run([*settings, str(probe)])
    assert status == 1 and '"TrainRecord" has no attribute "los"' in report, report + errors
    assert 'Unexpected keyword argument "reasn" for "StoppedRecord"' in report, report + errors


def test_every_ray_internal_is_read_through_the_adapter_and_is_where_it_says() -> None:
    """meshtrain.ray_compat was read from the Ray that pyproject.toml pins, every internal name it lists
    resolves in the installed Ray, and no other module imports a private or internal Ray module."""
    import importlib.metadata
    import re

    from meshtrain import ray_compat

    pinned = re.search(r'"ray\[[a-z,]+\]==([0-9.]+)"', (REPO / "pyproject.toml").read_text())
    assert pinned is not None
    assert ray_compat.RAY_VERSION_READ == pinned.group(1) == importlib.metadata.version("ray"), (
        "Ray moved: read every name of meshtrain/ray_compat.py against it, then update RAY_VERSION_READ"
    )
    moved = []
    for module, name in ray_compat.INTERNAL_NAMES:
        try:
            ray_compat.resolve(module, name)
        except (ImportError, AttributeError) as exc:
            moved.append(f"{module}:{name} ({exc})")
    assert moved == []
    private = re.compile(r"^ray\.(_private|.*\._internal)|^ray\.experimental\.internal_kv|^ray\.core\.generated")
    elsewhere = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "ray_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            elsewhere += [f"{path.relative_to(PACKAGE)}: {name}" for name in names if private.match(name)]
    assert elsewhere == []


def test_config_imports_nothing_of_meshtrain_torch_or_ray() -> None:
    """Building, validating, dumping and describing a config loads only the config package."""
    code = (
        "import json, sys\n"
        "from meshtrain.config.loading import describe_fields, load_config\n"
        "from meshtrain.config.schema import MeshtrainConfig\n"
        "cfg = load_config(None, ['train.steps=50', 'data.source=/nowhere/*.jsonl', 'model.init_from=/nowhere'])\n"
        "MeshtrainConfig.model_validate(cfg.model_dump(mode='json'))\n"
        "describe_fields()\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    modules = json.loads(result.stdout)
    ours = [m for m in modules if m.split(".")[0] == "meshtrain"]
    assert ours and all(m == "meshtrain" or m.startswith("meshtrain.config") for m in ours), ours
    for name in ("torch", "ray", "numpy", "datasets", "tokenizers"):
        assert name not in modules, f"importing the config loaded {name}"


def _modules_imported(path: Path) -> set[str]:
    """The meshtrain modules a file imports, anywhere in it; ``from package import name`` also counts the
    module ``name`` comes from when the package's ``__init__`` re-exports it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
            init = REPO / "platform" / Path(*node.module.split(".")) / "__init__.py"
            if init.exists():
                names = {alias.name for alias in node.names}
                found.update(
                    inner.module for inner in ast.walk(ast.parse(init.read_text()))
                    if isinstance(inner, ast.ImportFrom) and inner.module and names & {a.name for a in inner.names}
                )
    return found


def test_the_path_of_one_job_is_listed_in_order_and_short() -> None:
    """architecture.md lists the files of the default job's path; each is imported by a file above it, so a
    renamed file or a new hop in the path fails here until the list says so."""
    page = (REPO / "docs" / "architecture.md").read_text()
    listed = page.split("<!-- path-of-one-job -->")[1].split("<!-- /path-of-one-job -->")[0]
    files = [line.split("`")[1] for line in listed.strip().splitlines()]
    assert len(files) <= 25, f"the path of one job is {len(files)} files, more than 25"
    for index, file in enumerate(files):
        assert (REPO / file).is_file(), f"{file} is listed in architecture.md but does not exist"
        if index == 0:
            continue
        module = ".".join(Path(file).with_suffix("").parts[1:])
        importers = [earlier for earlier in files[:index] if module in _modules_imported(REPO / earlier)]
        assert importers, f"{file} (listed {index + 1}.) is imported by none of the files above it"


@pytest.mark.parametrize("job", sorted(path.name for path in (REPO / "jobs").glob("*.py")))
def test_jobs_only_call_the_library(job: str) -> None:
    """A job script is a docstring, imports and ``sys.exit(main())``: its logic lives in meshtrain, or for a
    benchmark in bench/meshtrain_bench."""
    tree = ast.parse((REPO / "jobs" / job).read_text())
    definitions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    assert definitions == [], f"jobs/{job} defines {[node.name for node in definitions]}"
    imported = [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert any(module and module.startswith(("meshtrain.", "meshtrain_bench.")) for module in imported), imported


def test_tiers_are_read_from_what_a_test_does_and_what_the_scan_misses_fails_the_test(tmp_path: Path) -> None:
    """A test calling a helper that starts a process is in the processes tier, one that starts nothing in the
    fast tier; a process started where the scan cannot see it fails its test, naming it; a hand-set tier
    marker fails collection."""
    import shutil
    import subprocess
    import sys

    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", suite / "conftest.py")
    (suite / "helpers.py").write_text("import subprocess\n\ndef spawn():\n    subprocess.run(['true'])\n")
    (suite / "test_tiers.py").write_text(
        "import subprocess\nfrom helpers import spawn\n\n"
        "def test_spawns(request):\n    spawn()\n    assert request.node.get_closest_marker('processes')\n\n"
        "def test_hides_it():\n    getattr(subprocess, 'run')(['true'])\n\n"
        "def test_pure(request):\n    assert request.node.get_closest_marker('fast')\n"
    )
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                            cwd=suite, capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert "3 passed, 1 error" in out, out  # the check runs after the test, in its teardown
    assert "ERROR test_tiers.py::test_hides_it - Failed" in out, out
    assert "Failed: this test is in the fast tier but started a subprocess (true)" in out, out

    (suite / "test_hand_set.py").write_text("import pytest\n\n@pytest.mark.ray\ndef test_labelled():\n    pass\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", str(suite)],
                            cwd=suite, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "test_hand_set.py::test_labelled: @pytest.mark.ray" in result.stdout + result.stderr
