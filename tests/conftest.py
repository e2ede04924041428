"""Shared test setup: tests import helpers (``ranks``) from this folder, and fixtures from here."""

import ast
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch.distributed as dist

if TYPE_CHECKING:
    from meshtrain.data import DataPlan

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> "DataPlan":
    """The standard-library token store most tests train on (24 documents, 512 tokens, validation held out),
    prepared once per session; a module needing another store defines its own ``corpus``."""
    from corpora import stdlib_plan

    return stdlib_plan(tmp_path_factory.mktemp("stdlib_store"))


@pytest.fixture(scope="session")
def unsplit_corpus(tmp_path_factory: pytest.TempPathFactory) -> "DataPlan":
    """The same documents with nothing held out for validation."""
    from corpora import stdlib_plan

    return stdlib_plan(tmp_path_factory.mktemp("stdlib_store_unsplit"), validation={"fraction": 0.0})


@pytest.fixture
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group in this process, for FSDP2 on a mesh of one."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# --- test tiers --------------------------------------------------------------------------------
# `python -m pytest -m "not ray and not processes"` is the fast tier. A test that starts Ray (or runs a job
# that does) must carry @pytest.mark.ray, one that starts other processes (gloo ranks, a CLI in a
# subprocess) @pytest.mark.processes: collection fails otherwise. What a test does is read from its
# source and its fixtures', following the functions of tests/ they call.

_RAY_CALLS = {"init_ray", "launch", "job_command", "run_job", "Cluster"}
_RAY_ATTRIBUTE_CALLS = {("ray", "init")}
_RAY_STRINGS = ("jobs/pretrain.py", "ray start", "ray job")
_PROCESS_CALLS = {"run_on_ranks", "start_processes", "Popen"}
_PROCESS_ATTRIBUTE_CALLS = {("subprocess", "run"), ("subprocess", "check_call"), ("subprocess", "check_output"),
                            ("mp", "spawn"), ("multiprocessing", "Process"), ("os", "fork")}


def _call_facts(function: ast.AST) -> tuple[bool, bool, set[str]]:
    """(starts Ray, starts processes, names it calls) of one function's own body."""
    ray, processes, called = False, False, set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            target = node.func
            if isinstance(target, ast.Name):
                called.add(target.id)
                ray |= target.id in _RAY_CALLS
                processes |= target.id in _PROCESS_CALLS
            elif isinstance(target, ast.Attribute):
                called.add(target.attr)
                owner = target.value.id if isinstance(target.value, ast.Name) else None
                ray |= (owner, target.attr) in _RAY_ATTRIBUTE_CALLS or target.attr in _RAY_CALLS
                processes |= (owner, target.attr) in _PROCESS_ATTRIBUTE_CALLS or target.attr in _PROCESS_CALLS
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            ray |= any(text in node.value for text in _RAY_STRINGS)
    return ray, processes, called


def _spawning_functions() -> dict[tuple[str, str], tuple[bool, bool]]:
    """Every function of tests/ by (module, name): (starts Ray, starts processes), through the functions of
    tests/ it calls (its module's own, or those it imports from another module of tests/)."""
    folder = Path(__file__).parent
    modules = {path.stem for path in folder.glob("*.py")}
    facts: dict[tuple[str, str], tuple[bool, bool, set[tuple[str, str]]]] = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        own = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        imported = {alias.asname or alias.name: (node.module, alias.name) for node in tree.body
                    if isinstance(node, ast.ImportFrom) and node.module in modules for alias in node.names}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                ray, processes, called = _call_facts(node)
                callees = {(path.stem, name) for name in called & own} | {imported[name] for name in called
                                                                            if name in imported and name not in own}
                known = facts.get((path.stem, node.name), (False, False, set()))
                facts[(path.stem, node.name)] = (known[0] or ray, known[1] or processes, known[2] | callees)
    result = {key: (ray, processes) for key, (ray, processes, _) in facts.items()}
    changed = True
    while changed:
        changed = False
        for key, (_, _, callees) in facts.items():
            ray, processes = result[key]
            for callee in callees & result.keys():
                ray, processes = ray or result[callee][0], processes or result[callee][1]
            if (ray, processes) != result[key]:
                result[key], changed = (ray, processes), True
    return result


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    spawning = _spawning_functions()
    missing = []
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        keys = [(module, item.originalname)] + [key for name in item.fixturenames
                                                for key in ((module, name), ("conftest", name))]
        ray = any(spawning.get(key, (False, False))[0] for key in keys)
        processes = any(spawning.get(key, (False, False))[1] for key in keys)
        marks = {mark.name for mark in item.iter_markers()}
        if ray and "ray" not in marks:
            missing.append(f"{item.nodeid}: starts Ray; mark it @pytest.mark.ray")
        elif processes and not marks & {"ray", "processes"}:
            missing.append(f"{item.nodeid}: starts processes; mark it @pytest.mark.processes")
    if missing:
        raise pytest.UsageError("tests without their tier's marker:\n" + "\n".join(missing))


@pytest.fixture(autouse=True)
def _no_ray_left_unmarked(request: pytest.FixtureRequest) -> Iterator[None]:
    """What the source scan cannot see: a test without the ray marker that started Ray in this process."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and "ray" not in {m.name for m in request.node.iter_markers()} and ray.is_initialized():
        ray.shutdown()
        pytest.fail("this test started Ray in the test process; mark it @pytest.mark.ray")
