"""The fault matrix: every fault a careless or hostile user can cause, injected into a real job through
a local Ray, one row each (meshtrain.bench.faults).

    python jobs/bench_faults.py                      # all rows, scratch under /tmp/meshtrain-bench-faults
    python jobs/bench_faults.py --only ctrl_c secrets
"""

import sys

from meshtrain.bench.faults import main

if __name__ == "__main__":
    sys.exit(main())
