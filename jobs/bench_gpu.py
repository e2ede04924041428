"""Training throughput, MFU and peak memory of Llama shapes on GPUs, one real training job per configuration (meshtrain_bench.gpu).

    python jobs/bench_gpu.py --dry-run                          # each GPU configuration's memory plan + H100 verdict
    python jobs/bench_gpu.py                                    # every GPU configuration, 1 GPU worker each
    python jobs/bench_gpu.py --only '1b-*' --steps 30 --warmup 10 --out results.json
    python jobs/bench_gpu.py --only 8b-8l-mb1-sel scaling.num_workers=8   # key=value overrides for every configuration
    python jobs/bench_gpu.py --no-profile                       # no profiler step, no CUDA allocator history
    python jobs/bench_gpu.py --cpu-smoke --out /tmp/tiny.json   # the `tiny` set on CPU workers (CI)
    python jobs/bench_gpu.py --list                             # the sets and configuration names
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.gpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
