"""Shared test setup: tests import helpers (``ranks``) from this folder, and fixtures from here."""

import ast
import os
import platform
import sys
import tempfile
import time
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
# Every test gets its tier's marker at collection, read from what it does: its source and its fixtures',
# following the functions of tests/ they call. From cheapest to dearest:
#   fast       no other process, no Ray                          python -m pytest -m fast
#   processes  starts other processes: gloo ranks, a command     python -m pytest -m processes
#   ray        starts Ray, or runs a job or script that does      python -m pytest -m ray
#   cluster    Ray nodes in network namespaces of their own       python -m pytest -m cluster
# What the scan cannot see is caught while the test runs (_tier_holds): a fast test that starts a process
# or any test below the ray tier that starts a Ray instance fails, naming what it started.

TIERS = ("fast", "processes", "ray", "cluster")
_RAY_CALLS = {"init_ray", "launch", "job_command", "run_job", "Cluster", "RayNode"}
_RAY_ATTRIBUTE_CALLS = {("ray", "init")}
# Commands that start Ray: the jobs that run through it, the ray CLI, the GPU benchmark's CPU smoke run.
_RAY_STRINGS = ("jobs/pretrain.py", "jobs/prepare_data.py", "ray start", "ray job", "--cpu-smoke")
_CLUSTER_STRINGS = ("netns",)
# lm-evaluation-harness's evaluations (simple_evaluate, meshtrain's run_harness) collect the environment
# with a dozen commands (pip list, gcc --version, nvidia-smi...).
_PROCESS_CALLS = {"run_on_ranks", "start_processes", "Popen", "Process", "lint_imports", "simple_evaluate", "run_harness"}
_PROCESS_ATTRIBUTE_CALLS = {("subprocess", "run"), ("subprocess", "check_call"), ("subprocess", "check_output"),
                            ("mp", "spawn"), ("os", "fork")}


def _call_facts(function: ast.AST) -> tuple[int, set[str]]:
    """(the tier of what one function's own body does, as an index into TIERS; the names it calls). A
    command's text counts where it could be a command: not in a comparison, a path joined with ``/``, a
    formatted message or an expected error's pattern."""
    tier, called = 0, set()
    inert = {id(inner) for node in ast.walk(function) if isinstance(node, (ast.Compare, ast.BinOp, ast.JoinedStr))
             for inner in ast.walk(node)}
    inert |= {id(inner) for node in ast.walk(function) if isinstance(node, ast.keyword) and node.arg == "match"
              for inner in ast.walk(node.value)}
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            target = node.func
            if isinstance(target, ast.Name):
                name, owner = target.id, None
            elif isinstance(target, ast.Attribute):
                name = target.attr
                owner = target.value.id if isinstance(target.value, ast.Name) else None
            else:
                continue
            called.add(name)
            if name in _RAY_CALLS or (owner, name) in _RAY_ATTRIBUTE_CALLS:
                tier = max(tier, 2)
            elif name in _PROCESS_CALLS or (owner, name) in _PROCESS_ATTRIBUTE_CALLS:
                tier = max(tier, 1)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inert:
            if any(text in node.value for text in _CLUSTER_STRINGS):
                tier = max(tier, 3)
            elif any(text in node.value for text in _RAY_STRINGS):
                tier = max(tier, 2)
    return tier, called


def _function_tiers() -> dict[tuple[str, str], int]:
    """Every function of tests/ by (module, name): the tier of what it does, through the functions of tests/
    it calls (its module's own, or those it imports from another module of tests/)."""
    folder = Path(__file__).parent
    modules = {path.stem for path in folder.glob("*.py")}
    facts: dict[tuple[str, str], tuple[int, set[tuple[str, str]]]] = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        own = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        imported = {alias.asname or alias.name: (node.module, alias.name) for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module in modules for alias in node.names}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                tier, called = _call_facts(node)
                callees = {(path.stem, name) for name in called & own} | {imported[name] for name in called
                                                                            if name in imported and name not in own}
                known = facts.get((path.stem, node.name), (0, set()))
                facts[(path.stem, node.name)] = (max(known[0], tier), known[1] | callees)
    result = {key: tier for key, (tier, _) in facts.items()}
    changed = True
    while changed:
        changed = False
        for key, (_, callees) in facts.items():
            tier = max([result[key], *(result[callee] for callee in callees & result.keys())])
            if tier != result[key]:
                result[key], changed = tier, True
    return result


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session's shared Ray head, if a job started it, goes with the session (tests/raynodes.py)."""
    raynodes = sys.modules.get("raynodes")
    if raynodes is not None:
        raynodes.SharedHead.stop(keep_log=exitstatus != 0)


# A session that runs long (a hang somewhere, a very slow day) ends with a report rather than being cut off
# by CI's outer limit (90 minutes, the install included): past this budget every test not yet started
# fails at once, saying so; with pytest's per-test ceiling (timeout in pyproject.toml, 10 minutes) the
# session ends by 80 minutes.
SESSION_BUDGET_S = float(os.environ.get("MESHTRAIN_TEST_BUDGET_S", 70 * 60))
_SESSION_STARTED = time.monotonic()


def pytest_runtest_setup(item: pytest.Item) -> None:
    spent = time.monotonic() - _SESSION_STARTED
    if spent > SESSION_BUDGET_S:
        pytest.fail(f"not run: the session has run {spent / 60:.0f} minutes, past its budget of "
                    f"{SESSION_BUDGET_S / 60:.0f} (MESHTRAIN_TEST_BUDGET_S); the slowest tests are listed at the end",
                    pytrace=False)


def pytest_configure(config: pytest.Config) -> None:
    # The standard library asks `uname -p` for the processor once per process, when first asked (mlflow,
    # wandb and Ray ask): here, before any test, so no test in the fast tier starts that process.
    platform.uname().processor  # noqa: B018
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: the {tier} tier (tests/conftest.py assigns it from what the test does)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers = _function_tiers()
    hand_set = []
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        keys = [(module, item.originalname)] + [key for name in item.fixturenames
                                                for key in ((module, name), ("conftest", name))]
        tier = max(tiers.get(key, 0) for key in keys)
        hand_set += [f"{item.nodeid}: @pytest.mark.{mark.name}" for mark in item.iter_markers() if mark.name in TIERS]
        item.add_marker(TIERS[tier])
    if hand_set:
        raise pytest.UsageError("a test's tier is read from what it does, not set by hand (tests/conftest.py):\n"
                                + "\n".join(hand_set))


def _tier_of(item: pytest.Item) -> int:
    return max(TIERS.index(mark.name) for mark in item.iter_markers() if mark.name in TIERS)


def _compiling() -> bool:
    """Whether torch.compile's own machinery is starting the process (the C++ compiler, its ISA probes and
    hashes): part of compiling, which a fast test may do, not a process the test starts."""
    frame = sys._getframe(2)
    while frame is not None:
        if f"{os.sep}torch{os.sep}_inductor{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _ray_sessions() -> set[str]:
    """Every Ray instance started on this machine leaves a session folder here (its nodes' logs and sockets)."""
    root = Path(os.environ.get("RAY_TMPDIR", tempfile.gettempdir())) / "ray"
    return {path.name for path in root.glob("session_2*")} if root.exists() else set()


@pytest.fixture(autouse=True)
def _tier_holds(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What the scan cannot see, caught as it happens: a fast test that starts a process, or a test below the
    ray tier that starts a Ray instance (in this process, or in any process it started)."""
    tier = _tier_of(request.node)
    sessions = _ray_sessions() if tier < 2 else set()
    started: list[str] = []
    if tier == 0:
        import multiprocessing.process
        import subprocess

        execute_child, start, fork = subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start, os.fork

        def command(popen: subprocess.Popen, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
            words = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
            if not _compiling():
                started.append(f"a subprocess ({' '.join(map(str, words))[:120]})")
            return execute_child(popen, args, *rest, **kwargs)

        def process(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            started.append(f"a multiprocessing process ({self.name})")
            return start(self, *args, **kwargs)

        def forked():  # type: ignore[no-untyped-def]
            started.append("os.fork()")
            return fork()

        monkeypatch.setattr(subprocess.Popen, "_execute_child", command)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", process)
        monkeypatch.setattr(os, "fork", forked)
    yield
    ray = sys.modules.get("ray")  # a test may still hold a stand-in there: its monkeypatch is undone after this
    if tier < 2 and ray is not None and getattr(ray, "is_initialized", lambda: False)():
        ray.shutdown()
        started.append("Ray in the test process")
    elif tier < 2 and _ray_sessions() - sessions:
        started.append("a Ray instance")
    if started:
        pytest.fail(f"this test is in the {TIERS[tier]} tier but started {', '.join(sorted(set(started)))}: "
                    "teach the tier scan in tests/conftest.py what it calls")
