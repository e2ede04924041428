"""Training tokens/s with downstream evaluation on and off, through the real job (meshtrain_bench.downstream).

    python jobs/bench_downstream.py                    # evaluations queue behind training (1 CPU each)
    python jobs/bench_downstream.py --eval-cpus 0.01   # evaluations share the two training cores
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.downstream import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
