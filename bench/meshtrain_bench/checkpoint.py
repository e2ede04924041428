"""Checkpoint I/O on this machine: sync save, async loop stall, load, disk speed next to dd, and
what checksums and safe unpickling cost.

Run with ``python jobs/bench_checkpoint.py`` (its docstring shows examples; ``--help`` lists the options).

Single process (the same DCP writer the workers use, one rank's shards). Prints one line per
measurement, the ratio of DCP's write speed to dd's on the same disk and byte count, and sync save
and load times with meshtrain's checksummed writer and verifying reader next to DCP's plain ones
(best of ``--repeats``, taken in turns), plus the export's whole-file verification.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from meshtrain.checkpoint.checksums import ALGORITHM
from meshtrain.checkpoint.manager import CheckpointLoaded, CheckpointManager, SaveCommitted
from meshtrain.checkpoint.state import Progress, TrainState
from meshtrain.checkpoint.storage import CheckpointStorage, CommittedCheckpoint
from meshtrain.config.loading import load_config
from meshtrain.model.args import model_args
from meshtrain.model.init import init_weights
from meshtrain.model.llama import build_model, materialize
from meshtrain.model.loss import token_cross_entropy_sum
from meshtrain.train.optim import build_lr_scheduler, build_optimizer


def dd_bytes_per_s(directory: Path, size: int) -> float:
    target = directory / "dd.bin"
    block = 1 << 20
    started = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", f"bs={block}", f"count={max(1, size // block)}", "conv=fsync"],
        check=True, capture_output=True,
    )
    elapsed = time.perf_counter() - started
    target.unlink()
    return max(1, size // block) * block / elapsed


def checksum_costs(state: TrainState, directory: Path, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` seconds of a sync save and a load of ``state`` with DCP's plain writer and
    reader and with meshtrain's (checksums, verification, safe unpickling), and of verifying the
    whole checkpoint as an export does."""
    storage = CheckpointStorage(str(directory))
    best: dict[str, float] = {}

    def timed(name: str, action: Callable[[], object]) -> None:
        started = time.perf_counter()
        action()
        best[name] = min(best.get(name, float("inf")), time.perf_counter() - started)

    for attempt in range(repeats):
        plain_dir, checked_dir = directory / f"plain-{attempt}", storage.step_dir(attempt)
        sidecars: dict[str, str] = {}

        def plain() -> None:
            writer = dcp.FileSystemWriter(plain_dir, sync_files=True, overwrite=True)
            timed("plain_save", lambda: dcp.save({"train": state}, storage_writer=writer, no_dist=True))
            reader = dcp.FileSystemReader(plain_dir)
            timed("plain_load", lambda: dcp.load({"train": state}, storage_reader=reader, no_dist=True))

        def checked() -> None:
            writer = storage.writer(checked_dir)
            timed("checked_save", lambda: dcp.save({"train": state}, storage_writer=writer, no_dist=True))
            sidecars.update({name: sidecar for name, (_, sidecar) in writer.written.items()})
            reader = storage.reader(checked_dir, sidecars)
            timed("checked_load", lambda: dcp.load({"train": state}, storage_reader=reader, no_dist=True))
            checksums = {"algorithm": ALGORITHM, "sidecars": sidecars}
            manifest = {"files": storage.files(checked_dir), "checksums": checksums}
            timed("verify_files", lambda: storage.verify_files(CommittedCheckpoint(checked_dir, attempt, manifest)))

        for measure in (plain, checked) if attempt % 2 == 0 else (checked, plain):  # in turns: neither always first
            measure()
        shutil.rmtree(plain_dir)
        storage.remove(checked_dir)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/meshtrain-ckpt-bench"))
    parser.add_argument("--repeats", type=int, default=5, help="turns of the with/without-checksums measurement")
    args = parser.parse_args()

    cfg = load_config(None, [f"model.preset={args.preset}", f"model.vocab_size={args.vocab_size}", "scaling.num_workers=1"])
    model = materialize(build_model(model_args(cfg.model, args.vocab_size)), "cpu")
    init_weights(model, 0)
    optimizer = build_optimizer(model, cfg.optim)
    tokens = torch.randint(0, args.vocab_size, (1, 33))
    token_cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()  # materializes the AdamW moments, so the checkpoint has its real size
    scheduler = build_lr_scheduler(optimizer, cfg.optim, 100)
    progress = Progress(step=1)
    state = TrainState(model, optimizer, scheduler, progress, rank=0)

    shutil.rmtree(args.dir, ignore_errors=True)
    events: list[SaveCommitted | CheckpointLoaded] = []
    for mode in ("sync", "async"):
        manager = CheckpointManager(
            CheckpointStorage(str(args.dir / mode)), rank=0, world_size=1, interval=1, keep=1,
            asynchronous=mode == "async", on_event=events.append, log=lambda _: None,
        )
        manager.save(state, {"world_size": 1})
        manager.finish_pending()
        manager.restore(state)
        manager.close()
    saves = {e.mode: e for e in events if isinstance(e, SaveCommitted)}
    load = [e for e in events if isinstance(e, CheckpointLoaded)][-1]
    size = saves["sync"].bytes
    dd = dd_bytes_per_s(args.dir, size)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model {args.preset}: {parameters / 1e6:.1f}M parameters, checkpoint {size / 2**20:.1f} MiB")
    print(f"sync save:  {saves['sync'].total_s:.3f} s ({size / saves['sync'].total_s / 2**20:.0f} MiB/s)")
    print(f"async save: loop stalled {saves['async'].blocking_s:.3f} s, written in {saves['async'].total_s:.3f} s")
    print(f"load:       {load.load_s:.3f} s")
    print(f"dd (same bytes, fsync): {dd / 2**20:.0f} MiB/s; DCP sync save / dd = {size / saves['sync'].total_s / dd:.2f}")
    costs = checksum_costs(state, args.dir / "checksums", args.repeats)
    for what in ("save", "load"):
        plain, checked = costs[f"plain_{what}"], costs[f"checked_{what}"]
        print(f"{what} with checksums: {checked:.4f} s, DCP plain {plain:.4f} s, ratio {checked / plain:.2f} "
              f"(best of {args.repeats})")
    verify_s = costs["verify_files"]
    print(f"export verification (every file, whole): {verify_s:.4f} s ({size / verify_s / 2**20:.0f} MiB/s)")
    shutil.rmtree(args.dir, ignore_errors=True)


