"""Cost of the step guard and of an evaluation, in one process on this machine's CPU (or GPU) (meshtrain_bench.guard).

    python jobs/bench_guard.py                    # the default job's model and batch
    python jobs/bench_guard.py --steps 60 --preset 125m --seq-len 256
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.guard import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
