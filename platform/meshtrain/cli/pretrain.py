"""Command line: ``python jobs/pretrain.py [--config FILE] [--dry-run] [dotted.key=value ...]``."""

from __future__ import annotations

import argparse
import sys

from meshtrain.cli.common import (
    CONFIG_ERROR_PREFIX,
    EXIT_CONFIG_ERROR,
    EXIT_INTERRUPTED,
    EXIT_TRAINING_FAILED,
    OneLineParser,
)
from meshtrain.config import ConfigError, ModelArgs
from meshtrain.config.loading import describe_fields, load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.observe.goodput import goodput_line


def _settings_help() -> str:
    rows = describe_fields()
    width = max(len(name) for name, _, _ in rows)
    return "settings (dotted.key=value):\n" + "\n".join(
        f"  {name:<{width}}  {description} [default {default}]" for name, default, description in rows
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        prog="pretrain.py",
        description="Pretrain a Llama model with FSDP2 (HSDP) on a Ray cluster, or on this machine.",
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file with any of the settings below")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, parameter count, mesh and per-rank memory plan, then exit",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="with --dry-run: also run one real training step of rank 0 at the configured shape and world size "
        "on fake tensors and a fake process group (no GPU, nothing allocated) and print its traced peak beside the plan",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.steps=100 parallel.shard=2")
    return parser.parse_args(argv)


def dry_run(cfg: MeshtrainConfig, args: ModelArgs, trace: bool = False) -> None:
    """Print the resolved (preflighted) config and the plan of the model ``args`` it resolved; ConfigError, and
    nothing on stdout, when the plan fails."""
    from meshtrain.cluster.resume import config_yaml
    from meshtrain.distributed.plan import describe_plan

    if trace and cfg.parallel.pipeline > 1:
        raise ConfigError("--trace steps the whole model as one rank; under parallel.pipeline > 1 it is not available "
                          "yet: drop --trace (the dry run's plan covers each pipeline rank)")
    report = describe_plan(args, cfg.parallel, cfg.scaling, cfg.train, cfg.data.longest_seq_len(), cfg.model.document_mask,
                           cfg.elastic_sizes())  # may raise ConfigError: then nothing goes to stdout
    print(config_yaml(cfg), end="")
    print("---")
    print(report, flush=True)
    if trace:
        print(traced_report(cfg, args))


def traced_report(cfg: MeshtrainConfig, args: ModelArgs) -> str:
    """The traced step's peak per rank next to the plan's total."""
    from meshtrain.distributed.plan import GIB, memory_plan, planned_mesh
    from meshtrain.train.trace import trace_step

    plan, _ = planned_mesh(cfg.scaling, cfg.parallel)
    use_gpu, seq_len = cfg.scaling.use_gpu, cfg.data.longest_seq_len()
    planned = memory_plan(args, plan, cfg.parallel, cfg.train, seq_len, use_gpu, cfg.model.document_mask).total
    peak = trace_step(args, plan, cfg.parallel, cfg.train, cfg.optim, seq_len, use_gpu)
    traced = peak.on_device(cfg.parallel.cpu_offload)
    kinds = ", ".join(f"{kind} {value / GIB:.3f}" for kind, value in peak.by_kind.items() if value)
    return "\n".join([
        f"traced step (rank 0 of {plan.world_size}, fake tensors, {peak.seconds:.1f}s): peak per rank (GiB): "
        f"{traced / GIB:.3f}; plan {planned / GIB:.3f} = {planned / traced:.3f}x the traced peak",
        f"  at the peak: {kinds}"
        + (f"; less {peak.cpu_kernel_bytes / GIB:.3f} of CPU attention mask that a GPU's flex attention does not "
           "allocate" if peak.cpu_kernel_bytes else ""),
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from meshtrain.cluster.preflight import preflighted

        if args.trace and not args.dry_run:
            raise ConfigError("--trace goes with --dry-run: add --dry-run")
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            checked = preflighted(cfg, trains=False)
            dry_run(checked.config, checked.model, args.trace)
            return 0
        from meshtrain.cluster.launcher import RayUnavailable, launch
        from meshtrain.cluster.outcome import Interrupted, TrainingFailed

        try:
            summary = launch(cfg)  # preflight first: every error the config can show, before Ray starts
        except (TrainingFailed, RayUnavailable) as exc:
            print(f"meshtrain: {exc}", file=sys.stderr)
            return EXIT_TRAINING_FAILED
        except Interrupted as exc:
            print(f"meshtrain: {exc}", file=sys.stderr)
            return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("meshtrain: interrupted before training started; nothing was trained", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError as exc:
        print(f"{CONFIG_ERROR_PREFIX}: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(done_line(summary), flush=True)
    if summary.get("goodput") and summary["final_loss"] is not None:
        print(f"[meshtrain] {goodput_line(summary['goodput'])}", flush=True)
    return 0


def done_line(summary: dict) -> str:
    if summary["final_loss"] is None:  # resumed from the final checkpoint: nothing left to train
        return f"[meshtrain] done: run {summary['run']} had already finished its {summary['steps']} steps"
    return (
        f"[meshtrain] done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
        f"{summary['mean_tokens_per_s']:,.0f} tok/s, wall {summary['wall_time_s']:.1f}s, "
        f"mesh {tuple(summary['mesh_shape'])} on {summary['world_size']} workers"
        + (f" x {summary['replica_groups']} replica groups" if summary.get("replica_groups") else "")
        + f" -> {summary['run_dir']}"
    )
