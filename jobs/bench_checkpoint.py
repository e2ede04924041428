"""Checkpoint I/O on this machine: sync save, async loop stall, load, disk speed next to dd, and the
cost of checksums and safe unpickling on save, load and export (meshtrain_bench.checkpoint).

    python jobs/bench_checkpoint.py --preset debug --dir /tmp/ckpt-bench
    python jobs/bench_checkpoint.py --preset 125m --vocab-size 32000 --dir /tmp/ckpt-bench
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.checkpoint import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
