"""What the one-process step benchmarks share: the run's model, optimizer, guard and first global
batches built as a worker builds them, and timing two variants in alternating blocks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataParallelBatches, TrainingData, open_data, prepare_data
from meshtrain.distributed.layout import WorkerLayout
from meshtrain.model.args import model_args
from meshtrain.model.llama import Transformer
from meshtrain.train.guard import StepGuard, spike_rules
from meshtrain.train.setup import build_sharded_model
from meshtrain.train.optim import build_optimizer

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SingleProcessRun:
    cfg: MeshtrainConfig
    device: torch.device
    data: TrainingData
    model: Transformer
    optimizer: torch.optim.Optimizer
    guard: StepGuard
    steps: list[MicroBatches]  # the first global batches, reused in turn


def single_process_run(
    cfg: MeshtrainConfig, workdir: str, device: torch.device, steps: int, document_mask: bool | None = None
) -> SingleProcessRun:
    """``cfg`` (one worker) set up in this process, with its first ``steps`` global batches; the model
    masks attention per document as ``cfg.model.document_mask`` says unless ``document_mask`` is given."""
    plan = prepare_data(cfg.data, workdir, cfg.data.seq_len, use_ray=False, log=lambda _: None)
    data = open_data(plan, cfg.data.seq_len, cfg.train.seed)
    masked = cfg.model.document_mask if document_mask is None else document_mask
    model, _ = build_sharded_model(model_args(cfg.model, data.vocab_size), cfg.parallel, WorkerLayout(), device,
                                   cfg.train.seed, cfg.scaling.workers_per_node, cfg.model.init_from,
                                   document_eos=data.eos_id if masked else None)
    optimizer = build_optimizer(model, cfg.optim)
    guard = StepGuard(optimizer, device, spike_rules(cfg.train))
    micro, _ = cfg.train.batch_layout(1)
    batches = DataParallelBatches(data.train, cfg.train.global_batch_size, micro, 0, 1, device)
    return SingleProcessRun(cfg, device, data, model, optimizer, guard, [list(batches.next_step()) for _ in range(steps)])


def alternating_medians(
    first: Callable[[int], None], second: Callable[[int], None], steps: int, block: int, warmup: int, device: torch.device
) -> tuple[float, float, int]:
    """Median seconds per step of ``first`` and ``second`` (each runs ``count`` steps when called),
    timed in alternating blocks of ``block`` steps so drift affects both alike; and the block count."""

    def timed(run: Callable[[int], None], count: int) -> float:
        started = time.perf_counter()
        run(count)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - started) / count

    timed(first, warmup), timed(second, warmup)
    firsts, seconds = [], []
    for _ in range(max(1, steps // block)):
        firsts.append(timed(first, block))
        seconds.append(timed(second, block))
    return statistics.median(firsts), statistics.median(seconds), len(firsts)
