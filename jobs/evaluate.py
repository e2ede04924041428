"""Score a committed meshtrain checkpoint with lm-evaluation-harness tasks (meshtrain.cli.evaluate).

    python jobs/evaluate.py runs/NAME --tasks hellaswag,arc_easy --num-fewshot 0      # newest committed step
    python jobs/evaluate.py runs/NAME/checkpoints/step-00000200 --tasks my_task --include-path tasks/
    python jobs/evaluate.py runs/NAME --tasks hellaswag --average 4 --out results/NAME-avg  # the mean of the newest 4
    python jobs/evaluate.py s3://bucket/ckpt/NAME --tasks lambada_openai --limit 500 --out results/NAME \\
        --storage-option client_kwargs.endpoint_url=http://minio:9000

Harness tasks fetch their data through Hugging Face datasets: have it cached, or give local task YAMLs.
"""

import sys

from meshtrain.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
