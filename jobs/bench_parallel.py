"""Throughput of tensor and context parallel against FSDP at the same shape, on CPU workers
(meshtrain.bench.parallel).

    python jobs/bench_parallel.py                 # 2 workers: FSDP 2, TP 2, CP 2
    python jobs/bench_parallel.py --workers 4     # FSDP 4, FSDP 2 x TP 2, FSDP 2 x CP 2, CP 2 x TP 2
"""

import sys

from meshtrain.bench.parallel import main

if __name__ == "__main__":
    sys.exit(main())
