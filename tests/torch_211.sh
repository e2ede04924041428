#!/usr/bin/env bash
# meshtrain under torch 2.11, the oldest release it supports, in an environment of its own: the
# registry's torch 2.11.0 (a CUDA build, a few GB; it runs on the CPU here), then the tests of the model,
# sharding, gradient accumulation, context parallel, checkpoints, equivalence with one process, float8
# and the GPU check's CPU smoke. Not in CI (the download alone takes longer than CI can spare); run it
# before changing what meshtrain calls in torch.
#
#   bash tests/torch_211.sh                # builds .venv-torch211 once, then runs the tests
#   bash tests/torch_211.sh -k gpu_check   # extra pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TORCH211_VENV:-.venv-torch211}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==2.11.0" -e ".[test]"
"$venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.11.'), torch.__version__"
exec "$venv/bin/python" -m pytest -p no:cacheprovider \
  tests/test_model.py tests/test_sharding.py tests/test_grad_accumulation.py tests/test_context_parallel.py \
  tests/test_vocab_parallel_loss.py tests/test_loss_memory.py tests/test_documents.py tests/test_init_from.py \
  tests/test_checkpoint.py tests/test_equivalence.py tests/test_float8.py tests/test_attention_paths.py \
  tests/test_step_guard.py tests/test_export.py tests/test_gpu_check.py "$@"
