"""Pretrain a Llama model on Ray.

    python jobs/pretrain.py                                   # debug model, local Ray, CPU workers
    python jobs/pretrain.py --config jobs/configs/125m.yaml train.steps=1000
    ray job submit --working-dir . -- python jobs/pretrain.py --config jobs/configs/<name>.yaml
"""

import sys

from meshtrain.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
