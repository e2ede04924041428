"""The in-process GPU check: meshtrain's worker code on one GPU, one process, no Ray (meshtrain_bench.gpu_check).

    python jobs/gpu_check.py --data .gpu_check/store --out /tmp/check   # every configuration (about 8 minutes)
    python jobs/gpu_check.py --quick                                    # correctness, 1B, 8B-8-layer (about 3)
    python jobs/gpu_check.py --cpu-smoke --quick                        # the same path on the CPU (CI)
    python jobs/gpu_check.py --list                                     # the configurations
"""

import sys
from pathlib import Path

# Benchmark code lives beside jobs/; meshtrain itself comes from the checkout where it is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "platform"))

from meshtrain_bench.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
