"""What the Prometheus metrics cost the default job: tokens/s with and without the exporter (meshtrain_bench.metrics).

    python jobs/bench_metrics.py                      # 2 pairs of default jobs, scraped every second
    python jobs/bench_metrics.py --pairs 3 train.steps=400
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.metrics import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
