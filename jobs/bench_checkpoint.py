"""Checkpoint I/O on this machine: sync save, async loop stall, load, disk speed next to dd, and the
cost of checksums and safe unpickling on save, load and export (meshtrain.bench.checkpoint).

    python jobs/bench_checkpoint.py --preset debug --dir /tmp/ckpt-bench
    python jobs/bench_checkpoint.py --preset 125m --vocab-size 32000 --dir /tmp/ckpt-bench
"""

import sys

from meshtrain.bench.checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
