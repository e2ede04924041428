"""One real training step at a run's real shape and world size, traced on one CPU machine.

The memory plan (``meshtrain.distributed.plan``) is arithmetic. This checks it against the code
that runs: rank 0 of the configured world builds, shards and steps the model with meshtrain's own
setup, step and optimizer, under ``FakeTensorMode`` (tensors have shapes and no storage) and a fake
process group (collectives return at once), so an 8B model on 64 ranks costs a few seconds and
little memory. PyTorch's FSDP2 memory tracker counts every tensor alive per kind (sharded and
gathered parameters, gradients, activations, optimizer state, collective buffers) and keeps the
peak.

What it does not see: the caching allocator's fragmentation and the CUDA context (the plan keeps a
margin for those), and kernels that differ by device: it runs CPU kernels in the compute dtype a
GPU run would use, and attention through SDPA without the document mask (flex attention keeps the
same output and log-sum-exp per token). ``torch.compile`` is left off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtrain.config import ConfigError, ModelArgs, OptimConfig, ParallelConfig, TrainConfig
from meshtrain.distributed.layout import MeshPlan
from meshtrain.distributed.parallelize import param_dtype
from meshtrain.train.guard import StepGuard, spike_rules
from meshtrain.train.optim import build_optimizer
from meshtrain.train.setup import fill_model, sharded_meta_model
from meshtrain.train.step import train_step

# Micro-batches traced per step. One: between micro-batches accumulation keeps only the sharded
# gradients, which one step already holds (and FSDP's deferred HSDP reduction, which accumulation
# uses, does not run on the fake process group).
_TRACED_MICRO_BATCHES = 1


@dataclass(frozen=True)
class TracedPeak:
    """Per-rank bytes at the step's peak: in all, and by the tracker's kinds (names as it gives them)."""

    total: int
    by_kind: dict[str, int]
    seconds: float
    cpu_kernel_bytes: int = 0  # alive at the peak only because the trace runs CPU kernels

    def on_device(self, offloaded: bool) -> int:
        """Bytes on the accelerator: under CPU offload the sharded state stays in host memory; less
        what only the trace's CPU kernels allocate."""
        device = self.total - self.cpu_kernel_bytes
        if not offloaded:
            return device
        host = ("Sharded Param", "Sharded Grad", "OptState")
        return device - sum(self.by_kind.get(kind, 0) for kind in host)


def cpu_kernel_bytes(parallel: ParallelConfig, use_gpu: bool, seq_len: int, plan: MeshPlan, micro_batch: int) -> int:
    """What the traced step holds for a GPU run that the GPU does not: under context parallel, CPU
    attention takes this rank's rows of the window's mask as an additive (seq/CP, seq) tensor per
    sample, kept for the whole step, where flex attention on a GPU keeps a block mask of a few bytes
    per 128x128 block."""
    if not use_gpu or plan.context == 1:
        return 0
    element = 2 if param_dtype(parallel.mixed_precision, "cuda") == torch.bfloat16 else 4
    return micro_batch * (seq_len // plan.context) * seq_len * element


def traced_parallel(parallel: ParallelConfig, use_gpu: bool) -> ParallelConfig:
    """``parallel`` as the trace runs it: the compute dtype of the device the run is for, no compile."""
    device_type = "cuda" if use_gpu else "cpu"
    precision = "bf16" if param_dtype(parallel.mixed_precision, device_type) == torch.bfloat16 else "fp32"
    return parallel.model_copy(update={"mixed_precision": precision, "compile": False})


def trace_step(args: ModelArgs, plan: MeshPlan, parallel: ParallelConfig, train: TrainConfig, optim: OptimConfig,
               seq_len: int, use_gpu: bool) -> TracedPeak:
    """Peak memory of rank 0 over one training step (after a first step has made the optimizer state)
    of ``args`` on ``plan``'s mesh, for a run on GPUs (``use_gpu``: scaling.use_gpu) or CPUs."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    if dist.is_initialized():
        raise ConfigError("--trace runs in a process of its own; it cannot join a running process group")
    parallel = traced_parallel(parallel, use_gpu)
    cpu = torch.device("cpu")
    started = time.perf_counter()
    micro, accumulation = train.batch_layout(plan.data_parallel_size)
    dist.init_process_group("fake", rank=0, world_size=plan.world_size, store=dist.HashStore())
    try:
        model, layout = sharded_meta_model(args, parallel, plan, cpu)  # the mesh is built outside fake mode
        with FakeTensorMode(allow_non_fake_inputs=True):
            fill_model(model, cpu, train.seed, offload=parallel.cpu_offload)
            # torchao's float8 weights take the truth value of a precomputed scale when the tracker
            # counts their storage, which a fake tensor cannot give; the scales are a few bytes.
            optimizer = build_optimizer(model, optim, precompute_float8_scales=False)
            guard = StepGuard(optimizer, cpu, spike_rules(train))
            micro_batches = []
            for _ in range(min(accumulation, _TRACED_MICRO_BATCHES)):
                tokens = torch.randint(0, args.vocab_size, (micro, seq_len + 1))
                micro_batches.append((tokens[:, :-1], tokens[:, 1:]))
            # The first step creates the optimizer state. Traced, DTensor's sharding propagation of
            # that creation would count global-sized temporaries that a real run never allocates.
            train_step(model, guard, micro_batches, layout, optim.grad_clip)
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs(tuple(micro_batches))
            with tracker:
                train_step(model, guard, micro_batches, layout, optim.grad_clip)
            peak = tracker.get_tracker_snapshot("peak")[cpu]
    finally:
        dist.destroy_process_group()
    by_kind = {getattr(kind, "value", str(kind)): int(value) for kind, value in peak.items()}
    total = by_kind.pop("Total")
    return TracedPeak(total, by_kind, time.perf_counter() - started,
                      cpu_kernel_bytes(parallel, use_gpu, seq_len, plan, micro))


__all__ = ["TracedPeak", "cpu_kernel_bytes", "trace_step", "traced_parallel"]
