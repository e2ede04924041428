"""The files of a run: ``{storage_path}/{name}/`` holds config, tokenizer, metrics and summary."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtrain.data.local_files import write_atomically


@dataclass(frozen=True)
class RunPaths:
    name: str
    storage_path: Path

    @property
    def run_dir(self) -> Path:
        return self.storage_path / self.name

    @property
    def config(self) -> Path:
        return self.run_dir / "config.yaml"

    @property
    def tokenizer(self) -> Path:
        return self.run_dir / "tokenizer.json"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def stop_request(self) -> Path:
        """Where the driver asks the workers to save and stop (Ctrl-C, ``ray job stop``)."""
        return self.run_dir / "stop_request.json"


def write_summary(paths: RunPaths, summary: dict[str, Any]) -> None:
    write_atomically(paths.summary, json.dumps(summary, indent=2) + "\n")


def read_summary(paths: RunPaths) -> dict[str, Any]:
    return json.loads(paths.summary.read_text())
