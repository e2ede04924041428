"""What a lost worker costs in restart mode and in replica mode: real runs on a local Ray (one worker
SIGKILLed at the same step in each mode) and the same at 16,384 GPUs by arithmetic, with goodput
(meshtrain_bench.recovery).

    python jobs/bench_recovery.py                 # both parts (about 4 minutes on 2 CPU cores)
    python jobs/bench_recovery.py --only scale    # the arithmetic alone
    python jobs/bench_recovery.py --quick --out /tmp/recovery
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.recovery import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
