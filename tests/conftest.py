"""Shared test setup: tests import helpers (``ranks``) from this folder, and fixtures from here."""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group in this process, for FSDP2 on a mesh of one."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
