"""Checkpoint I/O on this machine: sync save, async loop stall, load, and disk speed next to dd.

Run with ``python jobs/bench_checkpoint.py`` (its docstring shows examples; ``--help`` lists the options).

Single process (the same DCP writer the workers use, one rank's shards). Prints one line per
measurement and the ratio of DCP's write speed to dd's on the same disk and byte count.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from pathlib import Path

import torch

from meshtrain.checkpoint.manager import CheckpointManager
from meshtrain.checkpoint.state import Progress, TrainState
from meshtrain.checkpoint.storage import CheckpointStorage
from meshtrain.config import load_config
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/meshtrain-ckpt-bench"))
    args = parser.parse_args()

    cfg = load_config(None, [f"model.preset={args.preset}", f"model.vocab_size={args.vocab_size}", "scaling.num_workers=1"])
    model = materialize(build_model(model_args(cfg, args.vocab_size)), "cpu")
    init_weights(model, 0)
    optimizer = build_optimizer(model, cfg.optim)
    tokens = torch.randint(0, args.vocab_size, (1, 33))
    token_cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()  # materializes the AdamW moments, so the checkpoint has its real size
    scheduler = build_lr_scheduler(optimizer, cfg.optim, 100)
    progress = Progress(step=1)
    state = TrainState(model, optimizer, scheduler, progress, rank=0)

    shutil.rmtree(args.dir, ignore_errors=True)
    events: list[dict] = []
    for mode in ("sync", "async"):
        manager = CheckpointManager(
            CheckpointStorage(str(args.dir / mode)), rank=0, world_size=1, interval=1, keep=1,
            asynchronous=mode == "async", on_event=events.append, log=lambda _: None,
        )
        manager.save(state, {"world_size": 1})
        manager.finish_pending()
        manager.restore(state)
        manager.close()
    saves = {e["mode"]: e for e in events if e["event"] == "checkpoint_save"}
    load = [e for e in events if e["event"] == "checkpoint_load"][-1]
    size = saves["sync"]["bytes"]
    dd = dd_bytes_per_s(args.dir, size)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model {args.preset}: {parameters / 1e6:.1f}M parameters, checkpoint {size / 2**20:.1f} MiB")
    print(f"sync save:  {saves['sync']['total_s']:.3f} s ({size / saves['sync']['total_s'] / 2**20:.0f} MiB/s)")
    print(f"async save: loop stalled {saves['async']['blocking_s']:.3f} s, written in {saves['async']['total_s']:.3f} s")
    print(f"load:       {load['load_s']:.3f} s")
    print(f"dd (same bytes, fsync): {dd / 2**20:.0f} MiB/s; DCP sync save / dd = {size / saves['sync']['total_s'] / dd:.2f}")
    shutil.rmtree(args.dir, ignore_errors=True)


