"""Evaluate a committed meshtrain checkpoint on lm-evaluation-harness tasks.

Run with ``python jobs/evaluate.py`` (its docstring shows examples; ``--help`` lists the options).
The checkpoint becomes a ``transformers`` Llama in this process (only model tensors are read, each
checked against the checkpoint's checksums) and the harness scores it through its ``HFLM``: the
numbers are those ``lm_eval --model hf`` gives on the same checkpoint exported with
``jobs/export.py --format hf``. The harness's results JSON and per-example samples go to
``{run}/downstream/step-XXXXXXXX/`` (or ``--out``, checked writable before anything is scored). Exit code
2 with one line on stderr for unknown tasks, a folder without task YAMLs, a task's missing data file, a
results folder that cannot be written, or a missing, uncommitted or damaged checkpoint; any other failure
(storage that does not answer, say) is one line too, with exit code 1.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from meshtrain.cli.common import (
    OneLineParser,
    add_storage_options_argument,
    check_writable_folder,
    fail,
    interrupted,
    refuse,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        error_prefix="evaluate: error",
        prog="evaluate.py",
        description="Score a committed meshtrain checkpoint with lm-evaluation-harness tasks.",
    )
    parser.add_argument(
        "checkpoint",
        help="a committed step-XXXXXXXX directory, a checkpoint root or a run folder (then its newest committed step)",
    )
    parser.add_argument(
        "--average", type=int, metavar="N",
        help="score the mean of the newest N committed checkpoints (N >= 2; needs --out)",
    )
    parser.add_argument("--tasks", required=True, help="comma-separated harness task names (or task YAML names in --include-path)")
    parser.add_argument("--include-path", help="a folder of lm-eval task YAMLs for local data (data_files relative to it)")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: each task's own)")
    parser.add_argument("--limit", type=int, help="at most this many examples per task (default: all)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8)")
    parser.add_argument(
        "--out",
        help="folder for the results JSON and samples (default: {run}/downstream/step-N for a local run, "
        "./downstream/step-N for a remote one)",
    )
    add_storage_options_argument(parser)
    args = parser.parse_args(argv)
    for name in ("num_fewshot", "limit", "batch_size"):
        value = getattr(args, name)
        if value is not None and (value < 0 or (value == 0 and name != "num_fewshot")):
            parser.error(f"--{name.replace('_', '-')}={value}: give a {'non-negative' if name == 'num_fewshot' else 'positive'} number")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = args.storage_option
    from meshtrain.checkpoint.storage import CheckpointError
    from meshtrain.config import ConfigError
    from meshtrain.evaluate.checkpoint_eval import (
        DOWNSTREAM_DIR,
        RESULTS_FILE,
        default_run_dir,
        evaluate_checkpoint,
        results_folder,
    )
    from meshtrain.evaluate.harness import HarnessRun
    from meshtrain.observe.progress import progress_line

    run = HarnessRun(tuple(task.strip() for task in args.tasks.split(",") if task.strip()), args.include_path,
                     args.num_fewshot, args.limit, args.batch_size, settings=("--tasks", "--include-path"))
    try:
        if args.out:  # before anything is read or scored: the results must have somewhere to go
            check_writable_folder(Path(args.out), "--out")
        if args.average is not None and not args.out:
            raise ConfigError("--average: the mean of several steps has no step's results folder; give --out")
        from meshtrain.checkpoint.reading import checkpoint_in  # torch: after the arguments are checked

        checkpoint = checkpoint_in(args.checkpoint, options, args.average)
        run_dir = default_run_dir(checkpoint) or Path.cwd()
        if not args.out:
            check_writable_folder(run_dir / DOWNSTREAM_DIR, "results folder", "give --out a writable folder")
        evaluation = evaluate_checkpoint(
            checkpoint, run, (lambda _: Path(args.out)) if args.out else (lambda step: results_folder(run_dir, step)),
            options,
            average=args.average,
        )
    except (CheckpointError, ConfigError) as exc:
        return refuse("evaluate", exc)
    except KeyboardInterrupt:
        return interrupted("evaluate")
    except Exception as exc:  # storage that refuses or does not answer, a task's missing data file, ...: one line
        return fail("evaluate", exc)
    for record in evaluation.records:
        print(progress_line(record, 0))
    print(f"[meshtrain] evaluated {checkpoint} in {evaluation.seconds:.1f}s -> {evaluation.folder / RESULTS_FILE}",
          flush=True)
    return 0
