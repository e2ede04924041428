"""Generate the record reference, docs/records.md, from metrics.jsonl's record types (meshtrain.cli.record_reference).

    python jobs/record_reference.py            # print it
    python jobs/record_reference.py --write    # write docs/records.md
    python jobs/record_reference.py --check    # exit 1 when docs/records.md is stale
"""

import sys

from meshtrain.cli.record_reference import main

if __name__ == "__main__":
    sys.exit(main())
