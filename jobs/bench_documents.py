"""Tokens/s of a training step with and without the document mask (meshtrain_bench.documents).

    python jobs/bench_documents.py                          # the default job's model, seq 128 and 2048
    python jobs/bench_documents.py --seq-lens 256 model.preset=125m
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.documents import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
