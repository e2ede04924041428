"""Run a function on N gloo ranks in fresh processes and collect what each returns."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        value = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # ship the failure to the parent with its traceback
        value = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(value))
    # Skip interpreter finalization: gloo's C++ threads can still hold work objects whose teardown
    # then aborts the process (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank of a fresh gloo group; the per-rank results."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _entry, args=(world_size, _free_port(), out_dir, fn, args), nprocs=world_size, start_method="spawn"
        )
        results = [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world_size)]
    errors = [value for status, value in results if status == "error"]
    if errors:
        raise AssertionError(f"{len(errors)} rank(s) failed; first:\n{errors[0]}")
    return [value for _, value in results]
