"""Throughput of tensor and context parallel against FSDP at the same shape, on CPU workers
(meshtrain_bench.parallel).

    python jobs/bench_parallel.py                 # 2 workers: FSDP 2, TP 2, CP 2
    python jobs/bench_parallel.py --workers 4     # FSDP 4, FSDP 2 x TP 2, FSDP 2 x CP 2, CP 2 x TP 2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.parallel import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
