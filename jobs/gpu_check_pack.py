"""Gather what jobs/gpu_check.py needs on a GPU machine with its own image (meshtrain.bench.device_pack).

    python jobs/gpu_check_pack.py        # .whl/ (wheels for Python 3.12) and .gpu_check/store (a token store)
"""

import sys

from meshtrain.bench.device_pack import main

if __name__ == "__main__":
    sys.exit(main())
