"""Export a meshtrain checkpoint as consolidated weights.

    python jobs/export.py runs/NAME/checkpoints --format hf exported/NAME-hf        # newest committed step
    python jobs/export.py runs/NAME/checkpoints/step-00000200 --format safetensors model.safetensors
    python jobs/export.py s3://bucket/ckpt/NAME --format torch model.pt \\
        --storage-option client_kwargs.endpoint_url=http://minio:9000

Formats: torch (one torch.save file), safetensors (one file), hf (a LlamaForCausalLM directory with
config.json, model.safetensors and the run's tokenizer). Only model weights are read, in this process.
Exit code 2 with one line on stderr for a missing or uncommitted checkpoint or an existing output.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

import yaml

EXIT_BAD_INPUT = 2


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"export: error: {message}; see --help\n")


def parse_storage_options(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs (dotted keys nest, values parsed as YAML) → fsspec storage options."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option {item!r}: expected KEY=VALUE, e.g. anon=true")
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        node = options
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--storage-option {item!r}: {part!r} is already a value, not a section")
        node[leaf] = value
    return options


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from meshtrain.export import FORMATS

    parser = _OneLineParser(
        prog="export.py",
        description="Export a committed meshtrain checkpoint as consolidated weights.",
    )
    parser.add_argument(
        "checkpoint", help="a committed step-XXXXXXXX directory, or a checkpoint root (then its newest committed step)"
    )
    parser.add_argument("--format", required=True, choices=FORMATS, help="output format")
    parser.add_argument(
        "out", help="output file (torch, safetensors) or directory (hf); must not exist, or be empty"
    )
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option for a remote checkpoint (repeatable; dotted keys nest), "
        "e.g. client_kwargs.endpoint_url=http://minio:9000",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        options = parse_storage_options(args.storage_option)
    except ValueError as exc:
        print(f"export: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from meshtrain.checkpoint import CheckpointError
    from meshtrain.export import ExportError, export_checkpoint, resolve_checkpoint

    try:
        checkpoint = resolve_checkpoint(args.checkpoint, options)
        result = export_checkpoint(checkpoint, args.format, args.out, options)
    except (CheckpointError, ExportError) as exc:
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"export: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    written = ", ".join(result.files) if result.path.is_dir() else f"{result.path.stat().st_size:,} bytes"
    print(
        f"[meshtrain] exported step {result.step} of {checkpoint}: {result.parameters:,} parameters, "
        f"format {result.format} -> {result.path} ({written})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
