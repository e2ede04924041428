#!/usr/bin/env bash
# meshtrain under torch 2.11, the oldest release it supports, in an environment of its own: the
# registry's torch 2.11.0 (a CUDA build, a few GB; it runs on the CPU here). Not in CI (the download alone
# takes longer than CI can spare); run it before changing what meshtrain calls in torch, or what travels
# to a GPU machine.
#
#   bash tests/torch_211.sh                # builds .venv-torch211 once, then runs the tests of the model,
#                                          # sharding, gradient accumulation, context parallel, checkpoints,
#                                          # equivalence with one process, float8 and the GPU check's CPU smoke
#   bash tests/torch_211.sh -k gpu_check   # extra pytest arguments
#   bash tests/torch_211.sh pack           # the GPU pack (python jobs/gpu_check_pack.py first): a Python 3.12
#                                          # environment standing in for the GPU image (torch 2.11 and what the
#                                          # image holds of what the jobs need, .gpu_pack/stand-ins.txt), with
#                                          # only the unpacked .gpu_pack/site.tar.xz beside it, runs the default
#                                          # job through Ray to its done line; extra arguments go to the job
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = pack ]; then
  shift
  [ -f .gpu_pack/site.tar.xz ] && [ -f .gpu_pack/stand-ins.txt ] || { echo "torch_211.sh: no .gpu_pack; run python jobs/gpu_check_pack.py first" >&2; exit 2; }
  py=${PYTHON312:-}
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    [ -n "$py" ] && break
    "$candidate" -c "" 2>/dev/null && py=$candidate
  done
  [ -n "$py" ] || { echo "torch_211.sh: no Python 3.12 here; set PYTHON312" >&2; exit 2; }
  venv=${GPU_IMAGE_VENV:-.venv-gpu-image}
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/pip" install -q -r .gpu_pack/stand-ins.txt
  scratch=$(mktemp -d /tmp/gpu-image-XXXX)
  "$venv/bin/python" -m tarfile --filter data -e .gpu_pack/site.tar.xz "$scratch/site"
  export PYTHONPATH="$scratch/site:$PWD/platform"
  # Ray, pydantic and meshtrain must come from the pack and the checkout, not from the environment.
  "$venv/bin/python" - "$scratch/site" <<'PY'
import sys, meshtrain, pydantic, ray, torch
assert torch.__version__.startswith("2.11."), torch.__version__
assert ray.__file__.startswith(sys.argv[1]) and pydantic.__file__.startswith(sys.argv[1]), (ray.__file__, pydantic.__file__)
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, ray {ray.__version__} and pydantic {pydantic.__version__} from the pack, meshtrain from {meshtrain.__file__}")
PY
  "$venv/bin/python" jobs/pretrain.py run.storage_path="$scratch/runs" "$@" 2>&1 | tee "$scratch/job.log"
  grep -q "^\[meshtrain\] done: " "$scratch/job.log" || { echo "torch_211.sh: the default job did not finish" >&2; exit 1; }
  rm -rf "$scratch"
  exit 0
fi

venv=${TORCH211_VENV:-.venv-torch211}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==2.11.0" -e ".[test]"
"$venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.11.'), torch.__version__"
exec "$venv/bin/python" -m pytest -p no:cacheprovider \
  tests/test_model.py tests/test_sharding.py tests/test_grad_accumulation.py tests/test_context_parallel.py \
  tests/test_vocab_parallel_loss.py tests/test_loss_memory.py tests/test_documents.py tests/test_init_from.py \
  tests/test_checkpoint.py tests/test_equivalence.py tests/test_float8.py tests/test_attention_paths.py \
  tests/test_step_guard.py tests/test_export.py tests/test_gpu_check.py "$@"
