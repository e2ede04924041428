"""Benchmark the token store: the cost of checking every read, prepare throughput on 1 and 2 CPUs, and
launch-to-first-step time (meshtrain_bench.data).

    python jobs/bench_data.py                       # 10 MB and 200 MB corpora under /tmp
    python jobs/bench_data.py --verification-only   # checked vs unchecked reads only (seconds)
    python jobs/bench_data.py --sizes-mb 10 400     # another pair of sizes
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
