"""Simulate the data path at pretraining scale: 1,000/10,000/60,000-shard stores, a sparse 1T-token store,
and a slow local S3 endpoint; prints per-rank descriptors, maps, RSS, start time, data wait and the
ratios that must stay near 1 (meshtrain_bench.scale).

    python jobs/bench_scale.py                          # everything (about 10 minutes on 2 cores)
    python jobs/bench_scale.py --skip-launch --skip-s3  # per-rank figures only
    python jobs/bench_scale.py --delay-ms 100           # S3 requests held 100 ms each
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.scale import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
