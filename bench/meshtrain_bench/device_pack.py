"""What travels to a GPU machine that runs its own image: for jobs/gpu_check.py and for the product path
through Ray (jobs/gpu_product.py).

Such a machine (Python 3.12, its own torch, no package registry) lacks Ray and some of meshtrain's
dependencies. This gathers them here into ``.gpu_pack/``, which git ignores:

- ``site.tar.xz``: every distribution the jobs need that the image lacks, one folder to put on
  ``PYTHONPATH``. What the jobs need (``NEEDS``, at the versions installed here, plus the image's torch)
  is resolved by pip for Python 3.12 manylinux x86_64; what ``IMAGE_HOLDS`` names is left out; the rest
  is installed into one folder, Ray is stripped of what a local head and Ray Train never load
  (``STRIPPED``), and the folder is compressed;
- ``stand-ins.txt``: the resolved pins of what the jobs need that the image holds, so
  ``tests/torch_211.sh pack`` can build a Python 3.12 environment standing in for the image, put only the
  pack beside it, and run the default job through Ray;
- ``store/``: the standard-library corpus as a prepared token store (its tokenizer inside), so the jobs
  read tokens without ``datasets``.

Run ``python jobs/gpu_check_pack.py``; it prints the sizes (the pack with the store must stay under
``--limit-mib``, 45 by default, of the 64 MiB a device call may carry) and both device commands.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACK = REPO / ".gpu_pack"
SITE_ARCHIVE = PACK / "site.tar.xz"
STAND_INS = PACK / "stand-ins.txt"
STORE = PACK / "store"
MIB = 2**20
DEVICE_LIMIT_MIB = 64  # what one device call carries: the working tree and the carried folders

IMAGE_PYTHON = "3.12"
IMAGE_TORCH = "2.11.0"
# What the jobs import beyond the image's torch: Ray Train and a local head as the project installs them
# (with the dashboard: Ray Train's placement-group cleaner asks its state API), meshtrain's own
# dependencies, torchft for replica mode, torchao for float8.
# ``datasets`` and ``s3fs`` stay behind: the jobs read a prepared token store from local disk.
NEEDS = ("ray[default,train]", "pydantic", "tensorboardX", "torchft-nightly", "torchao", "tokenizers", "prometheus-client",
         "psutil", "pyyaml", "safetensors", "fsspec", "xxhash")
# The GPU image's Python distributions, as the device tool's page listed them (read 2026-11-17).
IMAGE_HOLDS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())
# Left behind although Ray's default extra asks for them: the dashboard's on-demand profiler (py-spy) and
# the runtime environments' virtualenv (with what only it needs); the jobs run from the checkout as they are.
LEFT_BEHIND = frozenset({"py-spy", "virtualenv", "distlib", "python-discovery", "platformdirs"})
# Carried although the image holds it: pydantic needs a newer typing-extensions than the image's.
ALWAYS_CARRY = frozenset({"typing-extensions"})
# Parts of Ray that a local head and Ray Train never load: Java, RLlib, Serve, LLM, the dashboard's
# JavaScript source maps, console scripts.
STRIPPED = ("ray/jars", "ray/rllib", "ray/serve", "ray/llm", "bin")
STRIPPED_SUFFIXES = (".map",)
# The image's glibc is 2.28 or newer: every manylinux tag up to it.
PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)), "manylinux2014_x86_64",
             "manylinux2010_x86_64", "manylinux1_x86_64")

# Lists the image's packages, unpacks the pack on the GPU machine, and puts it and meshtrain on PYTHONPATH.
DEVICE_SETUP = (
    "python3 -m pip list --format=freeze > $OUT/pip-list.txt 2>&1; python3 -m tarfile --filter data -e "
    ".gpu_pack/site.tar.xz /tmp/site && export PYTHONPATH=/tmp/site:$PWD/platform || exit; nvidia-smi -L; "
)
DEVICE_COMMAND = (
    DEVICE_SETUP + "PYTHONUNBUFFERED=1 python3 jobs/gpu_check.py --data .gpu_pack/store --work /tmp/gpu_check "
    "--out $OUT 2>&1 | tee $OUT/log.txt"
)
PRODUCT_COMMAND = (
    DEVICE_SETUP + "PYTHONUNBUFFERED=1 python3 jobs/gpu_product.py --data .gpu_pack/store --work /tmp/gpu_product "
    "--out $OUT 2>&1 | tee $OUT/log.txt"
)
DEVICE_CARRY = [".gpu_pack"]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(requirement: str) -> str:
    """``name[extras]==version`` of a distribution installed here."""
    name = requirement.split("[")[0]
    return f"{requirement}=={importlib.metadata.version(name)}"


def pip_for_image(*arguments: str) -> list[str]:
    """A pip command that picks Python 3.12 manylinux x86_64 wheels, whatever Python runs it."""
    command = [sys.executable, "-m", "pip", *arguments, "--quiet", "--only-binary=:all:", "--python-version",
               IMAGE_PYTHON, "--implementation", "cp"]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    return command


def resolve(scratch: Path) -> list[tuple[str, str]]:
    """(name, version) of every distribution the jobs need on the image, torch's stack included."""
    report = scratch / "report.json"
    requirements = [pinned(name) for name in NEEDS] + [f"torch=={IMAGE_TORCH}"]
    subprocess.run(pip_for_image("install", "--dry-run", "--ignore-installed", "--report", str(report),
                                 "--target", str(scratch / "nothing"), *requirements), check=True)
    installs = json.loads(report.read_text())["install"]
    return sorted((item["metadata"]["name"], item["metadata"]["version"]) for item in installs)


def split_by_image(needed: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(carried, stand-ins): pins of what the image lacks (or must get newer), and of what it holds."""
    carried, stand_ins = [], []
    for name, version in needed:
        key = normalized(name)
        if key in LEFT_BEHIND:
            continue
        (carried if key not in IMAGE_HOLDS or key in ALWAYS_CARRY else stand_ins).append(f"{name}=={version}")
    return carried, stand_ins


def install_site(carried: list[str], scratch: Path) -> Path:
    """The carried distributions installed into one folder, Ray stripped."""
    wheels, site = scratch / "wheels", scratch / "site"
    subprocess.run(pip_for_image("download", "--no-deps", "-d", str(wheels), *carried), check=True)
    subprocess.run(pip_for_image("install", "--no-deps", "--no-compile", "--target", str(site),
                                 *map(str, sorted(wheels.glob("*.whl")))), check=True)
    for part in STRIPPED:
        shutil.rmtree(site / part, ignore_errors=True)
    for path in list(site.rglob("*")):
        if path.is_file() and path.suffix in STRIPPED_SUFFIXES or path.name == "__pycache__":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return site


def compress(site: Path, archive: Path) -> None:
    archive.unlink(missing_ok=True)
    with tarfile.open(archive, "w:xz", preset=6) as tar:
        for path in sorted(site.iterdir()):
            tar.add(path, arcname=path.name)


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
    parser.add_argument("--limit-mib", type=float, default=45.0,
                        help="largest pack with its token store (default %(default)s)")
    parser.add_argument("--store-only", action="store_true", help="prepare the token store only")
    args = parser.parse_args(argv)
    PACK.mkdir(exist_ok=True)
    prepare_store(STORE)
    if not args.store_only:
        with tempfile.TemporaryDirectory(prefix="gpu-pack-") as scratch:
            carried, stand_ins = split_by_image(resolve(Path(scratch)))
            site = install_site(carried, Path(scratch))
            print(f"carried ({len(carried)}): {' '.join(carried)}")
            print(f"site folder: {folder_bytes(site) / MIB:.1f} MiB unpacked; compressing ...", flush=True)
            compress(site, SITE_ARCHIVE)
        STAND_INS.write_text("".join(f"{pin}\n" for pin in stand_ins))
    pack, tree = folder_bytes(PACK), tree_bytes()
    print(f"{SITE_ARCHIVE.relative_to(REPO)}: {SITE_ARCHIVE.stat().st_size / MIB if SITE_ARCHIVE.exists() else 0:.2f} MiB; "
          f"{STORE.relative_to(REPO)}: {folder_bytes(STORE) / MIB:.2f} MiB; pack {pack / MIB:.2f} MiB "
          f"(limit {args.limit_mib:g}); working tree {tree / MIB:.2f} MiB; sent {(pack + tree) / MIB:.2f} MiB")
    print(f"device call: carry={json.dumps(DEVICE_CARRY)}\n  the GPU check:\n{DEVICE_COMMAND}\n"
          f"  the product path:\n{PRODUCT_COMMAND}")
    if pack > args.limit_mib * MIB or pack + tree > DEVICE_LIMIT_MIB * MIB:
        print(f"gpu_check_pack: the pack is {pack / MIB:.1f} MiB (limit {args.limit_mib:g}), "
              f"{(pack + tree) / MIB:.1f} MiB with the tree (limit {DEVICE_LIMIT_MIB}); send less", file=sys.stderr)
        return 1
    return 0
