"""Gather what travels to a GPU machine with its own image (meshtrain_bench.device_pack): Ray and the
rest of what the image lacks, and a token store.

    python jobs/gpu_check_pack.py        # .gpu_pack/: site.tar.xz (Python 3.12), stand-ins.txt, store/
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.device_pack import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
