"""Print continuations of prompts by a committed meshtrain checkpoint's model (meshtrain.cli.generate).

    python jobs/generate.py runs/NAME "def parse_args(" "import os"          # newest committed step, greedy
    python jobs/generate.py runs/NAME/checkpoints/step-00000200 "The" --max-new-tokens 256 \\
        --temperature 0.8 --top-p 0.95 --seed 1
    python jobs/generate.py s3://bucket/ckpt/NAME "Once upon a time" \\
        --storage-option client_kwargs.endpoint_url=http://minio:9000
"""

import sys

from meshtrain.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
