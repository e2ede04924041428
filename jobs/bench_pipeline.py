"""Every pipeline schedule's bubble at one layout, from torch's own schedule order (meshtrain_bench.pipeline).

    python jobs/bench_pipeline.py                                        # 4 ranks, 16 micro-batches, 2 looped
    python jobs/bench_pipeline.py --stages 8 --microbatches 32 --virtual-stages 4
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.pipeline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
