"""Training tokens/s with downstream evaluation on and off, through the real job (meshtrain.bench.downstream).

    python jobs/bench_downstream.py                    # evaluations queue behind training (1 CPU each)
    python jobs/bench_downstream.py --eval-cpus 0.01   # evaluations share the two training cores
"""

import sys

from meshtrain.bench.downstream import main

if __name__ == "__main__":
    sys.exit(main())
