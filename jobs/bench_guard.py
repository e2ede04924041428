"""Cost of the step guard and of an evaluation, in one process on this machine's CPU (or GPU) (meshtrain.bench.guard).

    python jobs/bench_guard.py                    # the default job's model and batch
    python jobs/bench_guard.py --steps 60 --preset 125m --seq-len 256
"""

import sys

from meshtrain.bench.guard import main

if __name__ == "__main__":
    sys.exit(main())
