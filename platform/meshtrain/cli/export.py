"""Export a meshtrain checkpoint as consolidated weights.

Run with ``python jobs/export.py`` (its docstring shows examples; ``--help`` lists the options).

Formats: torch (one torch.save file), safetensors (one file), hf (a LlamaForCausalLM directory with
config.json, the weights and the run's tokenizer; weights beyond --max-shard-size are split into
model-0000x-of-0000N.safetensors files with a model.safetensors.index.json, and hf streams them tensor
by tensor instead of holding the whole model). Only model weights are read, in this process.
Every file of the checkpoint is checked against its checksums before anything is exported.
Exit code 2 with one line on stderr for a missing, uncommitted, damaged or tampered-with checkpoint
(naming the file), an existing output or one whose folder cannot be written (checked before the checkpoint
is read); any other failure (storage that does not answer, say) is one line too, with exit code 1.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from meshtrain.cli.common import (
    OneLineParser,
    add_storage_options_argument,
    check_writable_folder,
    fail,
    interrupted,
    refuse,
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_size(text: str) -> int:
    """Bytes in a size such as 5GB (10^9, as Hugging Face counts), 500MiB (2^20) or 1000000."""
    match = _SIZE.match(text)
    size = int(float(match[1]) * _UNITS[(match[2] or "b").lower()]) if match else 0
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size such as 5GB, 500MiB or 1000000")
    return size


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from meshtrain.checkpoint.export import FORMATS, HF_DTYPES

    parser = OneLineParser(
        error_prefix="export: error",
        prog="export.py",
        description="Export a committed meshtrain checkpoint as consolidated weights.",
    )
    parser.add_argument(
        "checkpoint",
        help="a committed step-XXXXXXXX directory, a checkpoint root or a run folder (then its newest committed step)",
    )
    parser.add_argument("--format", required=True, choices=FORMATS, help="output format")
    parser.add_argument(
        "out", help="output file (torch, safetensors) or directory (hf); must not exist, or be empty"
    )
    add_storage_options_argument(parser, ", e.g. client_kwargs.endpoint_url=http://minio:9000")
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        metavar="SIZE",
        help="hf: most bytes per weight file, e.g. 2GB or 500MiB; the rest go to further files (default 5GB)",
    )
    parser.add_argument(
        "--dtype", choices=HF_DTYPES, help="hf: dtype of the written weights (default float32)"
    )
    parser.add_argument(
        "--average", type=int, metavar="N",
        help="export the mean of the newest N committed checkpoints of the checkpoint root or run folder (N >= 2)",
    )
    args = parser.parse_args(argv)
    if args.format != "hf" and (args.max_shard_size is not None or args.dtype is not None):
        parser.error(f"--max-shard-size and --dtype shape --format hf only, not --format {args.format}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = args.storage_option
    from meshtrain.checkpoint.export import DEFAULT_MAX_SHARD_BYTES, ExportError, export_checkpoint
    from meshtrain.checkpoint.storage import CheckpointError
    from meshtrain.config import ConfigError

    try:
        # Before the checkpoint is read (every byte of it, checked): the output must have somewhere to go.
        check_writable_folder(Path(args.out).expanduser().absolute().parent, "output", "give an output path in a "
                              "writable folder")
        from meshtrain.checkpoint.reading import checkpoint_in  # torch: after the arguments are checked

        checkpoint = checkpoint_in(args.checkpoint, options, args.average)
        result = export_checkpoint(
            checkpoint,
            args.format,
            args.out,
            options,
            max_shard_bytes=args.max_shard_size or DEFAULT_MAX_SHARD_BYTES,
            dtype=args.dtype or "float32",
            average=args.average,
        )
    except (CheckpointError, ExportError, ConfigError) as exc:
        return refuse("export", exc)
    except KeyboardInterrupt:
        return interrupted("export")
    except Exception as exc:  # storage that refuses or does not answer, a damaged run file, ...: one line
        return fail("export", exc)
    written = ", ".join(result.files) if result.path.is_dir() else f"{result.path.stat().st_size:,} bytes"
    what = (f"the mean of steps {', '.join(map(str, result.averaged_steps))}" if result.averaged_steps
            else f"step {result.step}")
    print(
        f"[meshtrain] exported {what} of {checkpoint}: {result.parameters:,} parameters, "
        f"format {result.format} -> {result.path} ({written})",
        flush=True,
    )
    return 0


