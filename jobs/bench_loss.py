"""The chunked cross entropy's forward + backward, eager against compiled (meshtrain.bench.loss).

    python jobs/bench_loss.py                                   # 4096 tokens x 32k vocab from dim 512
    python jobs/bench_loss.py --tokens 8192 --vocab 128256 --dim 2048
"""

import sys

from meshtrain.bench.loss import main

if __name__ == "__main__":
    sys.exit(main())
