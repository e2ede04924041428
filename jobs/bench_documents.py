"""Tokens/s of a training step with and without the document mask (meshtrain.bench.documents).

    python jobs/bench_documents.py                          # the default job's model, seq 128 and 2048
    python jobs/bench_documents.py --seq-lens 256 model.preset=125m
"""

import sys

from meshtrain.bench.documents import main

if __name__ == "__main__":
    sys.exit(main())
