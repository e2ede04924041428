"""meshtrain on this machine's CPUs against a plain single-process PyTorch loop (meshtrain_bench.cpu_gap).

    python jobs/bench_cpu_gap.py                       # hidden 256, 4 layers, seq 256, batch 16, vocab 8192
    python jobs/bench_cpu_gap.py model.document_mask=false
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.cpu_gap import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
