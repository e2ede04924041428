"""Peak RSS and time of preparing one very long document (meshtrain_bench.long_document).

    python jobs/bench_long_document.py                                  # 50 MB, as JSON Lines and as a text file
    python jobs/bench_long_document.py --megabytes 200 --formats jsonl
    python jobs/bench_long_document.py --megabytes 200 --formats jsonl --emoji
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # beside jobs/, not installed

from meshtrain_bench.long_document import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
