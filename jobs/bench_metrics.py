"""What the Prometheus metrics cost the default job: tokens/s with and without the exporter (meshtrain.bench.metrics).

    python jobs/bench_metrics.py                      # 2 pairs of default jobs, scraped every second
    python jobs/bench_metrics.py --pairs 3 train.steps=400
"""

import sys

from meshtrain.bench.metrics import main

if __name__ == "__main__":
    sys.exit(main())
