"""Export a meshtrain checkpoint as consolidated weights (meshtrain.cli.export).

    python jobs/export.py runs/NAME --format hf exported/NAME-hf                    # newest committed step
    python jobs/export.py runs/NAME/checkpoints --format hf out/NAME-hf --max-shard-size 2GB --dtype bfloat16
    python jobs/export.py runs/NAME/checkpoints/step-00000200 --format safetensors model.safetensors
    python jobs/export.py runs/NAME/checkpoints --format hf out/NAME-avg --average 4   # the mean of the newest 4 steps
    python jobs/export.py s3://bucket/ckpt/NAME --format torch model.pt \\
        --storage-option client_kwargs.endpoint_url=http://minio:9000
"""

import sys

from meshtrain.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
