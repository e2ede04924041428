"""The fault matrix: every fault a careless or hostile user can cause, injected into a real job through
a local Ray, one row each (meshtrain_bench.faults).

    python jobs/bench_faults.py                      # all rows, scratch under /tmp/meshtrain-bench-faults
    python jobs/bench_faults.py --only ctrl_c secrets
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.faults import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
