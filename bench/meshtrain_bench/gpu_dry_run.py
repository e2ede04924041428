"""``jobs/bench_gpu.py --dry-run``: each configuration's memory plan and fit verdict (optionally against
a traced step on fake tensors), without Ray."""

from __future__ import annotations

from meshtrain.config import ConfigError
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import tokenizer_vocab_size
from meshtrain.distributed.plan import GIB, MemoryPlan, describe_plan, memory_plan, planned_device, planned_mesh
from meshtrain.model.args import model_args
from meshtrain.model.flops import flops_per_token
from meshtrain_bench.gpu_configs import (
    HISTORY_ENTRIES,
    BenchConfig,
    Window,
    build_config,
    owned_settings,
    profile_settings,
    run_settings,
    to_overrides,
)
from meshtrain_bench.gpu_measure import FLOPS_FORMULA


def for_plan(cfg: MeshtrainConfig, device_type: str) -> MeshtrainConfig:
    """The config the fit verdict is judged on: ``device_type`` for GPU runs that name no device of their own
    (only for the plan: the run itself does not require that accelerator type from Ray)."""
    if not cfg.scaling.use_gpu or cfg.scaling.accelerator_type or cfg.scaling.device_memory_gib:
        return cfg
    planned = cfg.model_copy(deep=True)
    planned.scaling.accelerator_type = device_type
    return planned


def short_verdict(cfg: MeshtrainConfig, memory: MemoryPlan) -> str:
    """The gist of meshtrain.distributed.plan.fit_verdict for the summary table."""
    if not cfg.scaling.use_gpu:
        return "CPU workers: no device verdict"
    device = planned_device(cfg.scaling)
    if device is None:
        return "device memory unknown"
    fits = memory.total / GIB <= device.usable_gib
    return f"{'fits' if fits else 'does not fit'} {device.name} ({device.usable_gib:.1f} GiB usable)"


def dry_run(
    configs: list[BenchConfig], window: Window, device_type: str, trace: bool = False, profile: bool = True
) -> int:
    """Each configuration's plan (and, for GPU ones, the fit verdict); no Ray. 2 if one is invalid.
    ``trace``: also each configuration's traced step (meshtrain.train.trace), plan against traced peak."""
    summary: list[tuple[str, ...]] = []
    status = 0
    owned = owned_settings(window, "<config>-<time>", "<--storage>")
    if profile:
        owned.update(profile_settings(window, use_gpu=False))
    print("set by the benchmark over every configuration: " + " ".join(to_overrides(owned)))
    if profile:
        print(f"and memory.history_entries={HISTORY_ENTRIES} on GPU workers (--no-profile: neither the profiler "
              "nor the allocator history)")
    print("and train.global_batch_size = micro-batch x data-parallel ranks unless a configuration sets it\n")
    for config in configs:
        print(f"== {config.name} ==")
        print("settings: " + " ".join(to_overrides(config.settings)))
        try:
            cfg = for_plan(
                build_config(run_settings(config, window, "dry-run", "runs/bench_gpu", profile)), device_type
            )
            args = model_args(cfg.model, tokenizer_vocab_size(cfg.data.tokenizer, cfg.data.vocab_size))
            report = describe_plan(args, cfg.parallel, cfg.scaling, cfg.train, cfg.data.seq_len,
                                   cfg.model.document_mask, cfg.elastic_sizes())
        except ConfigError as exc:
            print(f"config error: {exc}\n")
            summary.append((config.name, "-", "-", f"config error: {exc}"))
            status = 2
            continue
        print(f"model FLOPs per token: {flops_per_token(args, cfg.data.seq_len):.4g} ({FLOPS_FORMULA})")
        print(report + "\n")
        plan, _ = planned_mesh(cfg.scaling, cfg.parallel)
        memory = memory_plan(args, plan, cfg.parallel, cfg.train, cfg.data.seq_len, cfg.scaling.use_gpu, cfg.model.document_mask)
        verdict = short_verdict(cfg, memory)
        row = (config.name, f"{memory.total / GIB:.1f}", f"{cfg.scaling.num_workers}", verdict)
        if trace:
            from meshtrain.train.trace import trace_step

            traced = trace_step(args, plan, cfg.parallel, cfg.train, cfg.optim, cfg.data.seq_len,
                                cfg.scaling.use_gpu).on_device(cfg.parallel.cpu_offload)
            print(f"traced peak per rank: {traced / GIB:.2f} GiB; plan/traced {memory.total / traced:.3f}\n", flush=True)
            row = (*row[:2], f"{traced / GIB:.1f}", f"{memory.total / traced:.3f}", *row[2:])
        summary.append(row)
    if trace:
        print("| config | plan per rank (GiB) | traced peak (GiB) | plan/traced | workers | verdict |")
        print("|---|---|---|---|---|---|")
    else:
        print("| config | plan per rank (GiB) | workers | verdict |")
        print("|---|---|---|---|")
    for row in summary:
        print("| " + " | ".join(row) + " |")
    return status
