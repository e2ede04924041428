"""Run a function on N gloo ranks and collect what each returns.

Ranks are forked from one forkserver per test session that has already imported torch and the training
loop (about 4 s per interpreter on two cores, once instead of once per rank per call). Every call gets
fresh processes, so nothing a test leaves in a rank (RNG, compile caches, process groups) reaches the
next; they run in the caller's environment and working directory and write where it writes, as spawned
ranks would.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from ports import free_port

# Imported once, in the forkserver; every rank is a fork of it. Nothing here may start a thread.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "meshtrain.train.trainer"]
# Generous: the slowest rank function takes about 60 s on a slow day (4 ranks on 2 cores).
CEILING_S = 600.0
# A rank that failed may leave the others waiting in a collective with it: they are stopped this long after.
GRACE_S = 5.0

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def _write_where_the_caller_writes(caller: int) -> None:
    """Point this rank's stdout and stderr where the caller's point now (a terminal, a pipe, or the file
    pytest captures a test's output in): the forkserver's own were the caller's when it started."""
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{caller}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:  # no /proc, or a socket: keep the forkserver's
            continue
        os.dup2(target, fd)
        os.close(target)


def _entry(rank: int, world_size: int, port: int, out_dir: str, environ: dict[str, str], cwd: str, caller: int,
           fn: Callable[..., Any], args: tuple) -> None:
    _write_where_the_caller_writes(caller)
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    os.chdir(cwd)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    value: tuple[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            value = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # ship the failure to the parent with its traceback
        value = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(value))  # complete before the process ends
    # Skip interpreter finalization: gloo's C++ threads can still hold work objects whose teardown
    # then aborts the process (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _result(out_dir: str, rank: int, exitcode: int | None) -> tuple[str, Any]:
    """What an ended rank shipped, or how it died without shipping anything."""
    path = Path(out_dir, f"{rank}.pkl")
    if not path.exists():
        return "error", f"rank {rank} died with exit code {exitcode}"
    return pickle.loads(path.read_bytes())


def _test_name() -> str:
    current = os.environ.get("PYTEST_CURRENT_TEST")  # "<node id> (<phase>)"
    return current.rsplit(" ", 1)[0] if current else "(outside a test)"


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, ceiling_s: float = CEILING_S) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank of a fresh gloo group; the per-rank results.

    A rank that raises fails the call with its traceback; a rank that dies, or a call still running after
    ``ceiling_s``, fails it naming the test, the function and the ranks that had not finished."""
    what = f"{_test_name()}: {getattr(fn, '__qualname__', fn)} on {world_size} ranks"
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        environ, cwd = dict(os.environ), os.getcwd()
        processes = [
            _context.Process(target=_entry, args=(rank, world_size, port, out_dir, environ, cwd, os.getpid(), fn, args),
                             name=f"rank{rank}", daemon=True)
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        results: dict[int, tuple[str, Any]] = {}
        pending = dict(enumerate(processes))
        stop_at = time.monotonic() + ceiling_s
        try:
            while pending:
                ended = wait([process.sentinel for process in pending.values()], max(0.0, stop_at - time.monotonic()))
                if not ended:
                    break
                for rank, process in list(pending.items()):
                    if process.sentinel in ended:
                        process.join()
                        del pending[rank]
                        results[rank] = _result(out_dir, rank, process.exitcode)
                        if results[rank][0] == "error":
                            stop_at = min(stop_at, time.monotonic() + GRACE_S)
        finally:
            for process in pending.values():
                process.kill()
                process.join(timeout=30)
    errors = [(rank, value) for rank, (status, value) in results.items() if status == "error"]  # in the order they ended
    if errors:
        stopped = f"; ranks {sorted(pending)} were stopped waiting" if pending else ""
        rank, first = errors[0]
        raise AssertionError(f"{what}: {len(errors)} rank(s) failed{stopped}; the first to end, rank {rank}:\n{first}")
    if pending:
        raise AssertionError(f"{what}: ranks {sorted(pending)} still running after {ceiling_s:.0f}s; stopped")
    return [results[rank][1] for rank in range(world_size)]
