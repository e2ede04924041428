"""meshtrain on this machine's CPUs against a plain single-process PyTorch loop (meshtrain.bench.cpu_gap).

    python jobs/bench_cpu_gap.py                       # hidden 256, 4 layers, seq 256, batch 16, vocab 8192
    python jobs/bench_cpu_gap.py model.document_mask=false
"""

import sys

from meshtrain.bench.cpu_gap import main

if __name__ == "__main__":
    sys.exit(main())
