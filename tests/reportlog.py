"""A Ray Train callback for tests: appends rank 0's metrics of every ray.train.report to a file,
with the folder of the checkpoint a report hands Ray (``checkpoint_path``), if any.

Ray builds it on its controller (a separate process), so it writes to the path in
MESHTRAIN_TEST_REPORT_LOG rather than keeping state the test could not reach.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ray.train import UserCallback


class ReportLog(UserCallback):
    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        with open(os.environ["MESHTRAIN_TEST_REPORT_LOG"], "a", encoding="utf-8") as file:
            path = None if checkpoint is None else checkpoint.path
            file.write(json.dumps({**metrics[0], "checkpoint_path": path}) + "\n")
