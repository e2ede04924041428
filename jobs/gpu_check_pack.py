"""Gather what jobs/gpu_check.py needs on a GPU machine with its own image (meshtrain_bench.device_pack).

    python jobs/gpu_check_pack.py        # .whl/ (wheels for Python 3.12) and .gpu_check/store (a token store)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.device_pack import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
