"""platform/ is the source root, never a module: the standard library's ``platform`` must win."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]


def test_platform_is_the_standard_library_module() -> None:
    assert Path(platform.__file__).parent == Path(sysconfig.get_paths()["stdlib"])
    assert platform.system() == os.uname().sysname
    assert not (REPO / "platform" / "__init__.py").exists()


def test_platform_from_the_repo_root_in_a_fresh_interpreter() -> None:
    code = "import platform, os; assert platform.system() == os.uname().sysname; print(platform.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert "platform/__init__" not in out.stdout and out.stdout.strip().endswith("platform.py")
