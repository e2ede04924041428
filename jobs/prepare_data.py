"""Prepare token stores for a config's data sources on Ray (then training only maps them).

    python jobs/prepare_data.py data.source=/data/corpus/*.jsonl run.storage_path=/mnt/shared/runs
    python jobs/prepare_data.py --config jobs/configs/<name>.yaml --output s3://bucket/token_stores
"""

import sys

from meshtrain.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
