"""What travels to a GPU machine that runs its own image, for jobs/gpu_check.py.

Such a machine (Python 3.12 and its own torch, no package registry) lacks a few of meshtrain's
dependencies and ``datasets``; this gathers them here, into two folders that git ignores:

- ``.whl/``: Python 3.12 manylinux x86_64 wheels of what the check imports and the image lacks
  (``TRAVELLING``: pydantic with its compiled core and small dependencies, and torchao for the float8
  rows), at the versions installed here, so the check runs what the tests ran;
- ``.gpu_check/store``: the standard-library corpus as a prepared token store (its tokenizer inside),
  so the check reads tokens and never needs ``datasets``.

Run ``python jobs/gpu_check_pack.py``; it prints the sizes (the working tree plus both folders must stay
under ``--limit-mib``, 40 by default, of the 64 MiB a device call may carry) and the device call.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".whl"
STAGE = REPO / ".gpu_check"
STORE = STAGE / "store"
# Distributions the check imports that the device image lacks (typing-extensions: pydantic needs a recent one).
TRAVELLING = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "torchao")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
MIB = 2**20

DEVICE_COMMAND = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
    ".whl/*.whl && export PYTHONPATH=/tmp/site || exit; nvidia-smi -L; PYTHONUNBUFFERED=1 python3 jobs/gpu_check.py "
    "--data .gpu_check/store --work /tmp/gpu_check --out $OUT 2>&1 | tee $OUT/log.txt"
)
DEVICE_CARRY = [".whl", ".gpu_check"]


def pinned(distribution: str) -> str:
    """``name==version`` of a distribution installed here."""
    return f"{distribution}=={importlib.metadata.version(distribution)}"


def download_wheels(target: Path, python_version: str) -> list[Path]:
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               python_version, "--implementation", "cp", "-d", str(target), "-q"]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + [pinned(name) for name in TRAVELLING], check=True)
    return sorted(target.glob("*.whl"))


def prepare_store(target: Path) -> Path:
    """The standard-library corpus tokenized as the debug preset's runs do, without Ray."""
    from meshtrain.config.loading import load_config
    from meshtrain.data import prepare_data

    cfg = load_config(None, ["data.source=stdlib"])
    cache = target.parent / f".{target.name}-cache"
    plan = prepare_data(cfg.data, str(cache), cfg.data.seq_len, use_ray=False)
    if target.exists():
        shutil.rmtree(target)
    shutil.move(plan.stores[0].url, target)
    shutil.rmtree(cache)
    return target


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def tree_bytes() -> int:
    """What a device call sends besides the carried folders: tracked and untracked, not ignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.split(b"\0")
    return sum((REPO / name.decode()).stat().st_size for name in listed if name and (REPO / name.decode()).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-version", default="3.12", help="the device image's Python (default %(default)s)")
    parser.add_argument("--limit-mib", type=float, default=40.0, help="largest total to send (default %(default)s)")
    parser.add_argument("--no-wheels", action="store_true", help="prepare the token store only")
    args = parser.parse_args(argv)
    STAGE.mkdir(exist_ok=True)
    store = prepare_store(STORE)
    wheels = [] if args.no_wheels else download_wheels(WHEELS, args.python_version)
    sizes = {"working tree": tree_bytes(), ".gpu_check (token store)": folder_bytes(STAGE),
             ".whl (wheels)": folder_bytes(WHEELS) if WHEELS.exists() else 0}
    for wheel in wheels:
        print(f"  {wheel.name}: {wheel.stat().st_size / MIB:.2f} MiB")
    for name, size in sizes.items():
        print(f"{name}: {size / MIB:.2f} MiB")
    total = sum(sizes.values()) / MIB
    print(f"total sent: {total:.2f} MiB (limit {args.limit_mib:g} MiB); token store {store}")
    print(f"device call: carry={DEVICE_CARRY} command:\n{DEVICE_COMMAND}")
    if total > args.limit_mib:
        print(f"gpu_check_pack: {total:.1f} MiB is over --limit-mib {args.limit_mib:g}; send less", file=sys.stderr)
        return 1
    return 0
