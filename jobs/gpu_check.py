"""The in-process GPU check: meshtrain's worker code on one GPU, one process, no Ray (meshtrain.bench.gpu_check).

    python jobs/gpu_check.py --data .gpu_check/store --out /tmp/check   # every configuration (about 8 minutes)
    python jobs/gpu_check.py --quick                                    # correctness, 1B, 8B-8-layer (about 3)
    python jobs/gpu_check.py --cpu-smoke --quick                        # the same path on the CPU (CI)
    python jobs/gpu_check.py --list                                     # the configurations
"""

import sys
from pathlib import Path

# On a machine where meshtrain is not installed (the lent GPU machine), run from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from meshtrain.bench.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
