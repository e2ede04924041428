"""The product path on one GPU: jobs/pretrain.py through a local Ray against the in-process trainer,
async checkpoints, a SIGKILL and the resume, Prometheus against the trainer (meshtrain_bench.gpu_product).

    python jobs/gpu_product.py --data .gpu_pack/store --work /tmp/gpu_product --out /tmp/out   # about 6 minutes
    python jobs/gpu_product.py --cpu-smoke --steps 30 --interval 10 --kill-at 28                # the same path on the CPU
"""

import sys
from pathlib import Path

# Benchmark code lives beside jobs/; meshtrain itself comes from the checkout where it is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "platform"))

from meshtrain_bench.gpu_product import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
