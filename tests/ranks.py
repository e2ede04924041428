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
    Path(out_dir, f"{rank}.tmp").write_bytes(pickle.dumps(value))
    os.replace(Path(out_dir, f"{rank}.tmp"), Path(out_dir, f"{rank}.pkl"))
    # Skip interpreter finalization: gloo's C++ threads can still hold work objects whose teardown
    # then aborts the process (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _test_name() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "(no test)").rsplit(" ", 1)[0]


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
        deadline, failed_at = time.monotonic() + ceiling_s, None
        try:
            while len(results) < world_size:
                for rank, process in enumerate(processes):
                    path = Path(out_dir, f"{rank}.pkl")
                    if rank not in results and path.exists():
                        results[rank] = pickle.loads(path.read_bytes())
                        if results[rank][0] == "error" and failed_at is None:
                            failed_at = time.monotonic()
                    elif rank not in results and process.exitcode is not None and not path.exists():
                        results[rank] = ("error", f"rank {rank} died with exit code {process.exitcode}")
                        failed_at = failed_at or time.monotonic()
                if len(results) == world_size:
                    break
                now = time.monotonic()
                if failed_at is not None and now > failed_at + GRACE_S:
                    break
                if now > deadline:
                    waiting = [rank for rank in range(world_size) if rank not in results]
                    raise AssertionError(f"{what}: ranks {waiting} still running after {ceiling_s:.0f}s; stopped")
                time.sleep(0.02)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                process.join(timeout=30)
    errors = [(rank, value) for rank, (status, value) in sorted(results.items()) if status == "error"]
    if errors:
        unfinished = sorted(set(range(world_size)) - results.keys())
        stopped = f"; ranks {unfinished} were stopped waiting" if unfinished else ""
        rank, first = errors[0]
        raise AssertionError(f"{what}: {len(errors)} rank(s) failed{stopped}; first, rank {rank}:\n{first}")
    return [results[rank][1] for rank in range(world_size)]
