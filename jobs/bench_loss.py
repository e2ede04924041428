"""The chunked cross entropy's forward + backward, eager against compiled (meshtrain_bench.loss).

    python jobs/bench_loss.py                                   # 4096 tokens x 32k vocab from dim 512
    python jobs/bench_loss.py --tokens 8192 --vocab 128256 --dim 2048
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.loss import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
