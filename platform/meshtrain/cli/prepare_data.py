"""``python jobs/prepare_data.py [--config FILE] [--output URL] [--max-parallel N] [key=value ...]``.

Prepares a token store for every source in the config's ``data`` section (and its validation
source) on the Ray cluster, prints progress and the throughput, and names the store(s) to train
from. A run whose config names the same sources finds the stores in its cache and re-uses them.
"""

from __future__ import annotations

import argparse
import sys
import time

from meshtrain.cli.common import CONFIG_ERROR_PREFIX, EXIT_CONFIG_ERROR, OneLineParser, fail, interrupted
from meshtrain.config import ConfigError, config_error_in
from meshtrain.config.loading import load_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        prog="prepare_data.py",
        description="Tokenize the config's data sources into token stores, in parallel on Ray.",
    )
    parser.add_argument("--config", help="YAML file with a data: section (and run.storage_path)")
    parser.add_argument(
        "--output",
        help="cache folder for the stores (local or s3://); default data.cache_dir, else <run.storage_path>/token_stores",
    )
    parser.add_argument("--max-parallel", type=int, default=None, help="prepare tasks in flight (default: all Ray CPUs)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.source=/data/*.jsonl")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:

        from meshtrain.cluster.launcher import init_ray
        from meshtrain.cluster.preflight import preflight
        from meshtrain.data.pipeline import prepare_data

        cfg = preflight(load_config(args.config, args.overrides), tokenizer_fits=False, trains=False)

        output = args.output or cfg.data_cache_url()
        init_ray()
        started = time.perf_counter()
        plan = prepare_data(
            cfg.data,
            output,
            cfg.data.seq_len,
            log=lambda line: print(line, flush=True),
            progress_interval_s=cfg.metrics.progress_interval_s,
            max_parallel=args.max_parallel,
        )
    except ConfigError as exc:
        print(f"{CONFIG_ERROR_PREFIX}: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        return interrupted("prepare_data")
    except Exception as exc:  # a Ray task's failure carries the ConfigError that stopped it; anything else is one line
        config_error = config_error_in(exc)
        if config_error is not None:
            print(f"{CONFIG_ERROR_PREFIX}: {config_error}", file=sys.stderr)
            return EXIT_CONFIG_ERROR
        return fail("prepare_data", exc)
    seconds = time.perf_counter() - started
    for ref in (*plan.stores, *([plan.validation] if plan.validation else [])):
        print(f"[meshtrain] token store {ref.url}: {ref.tokens:,} tokens, {ref.documents:,} documents, fingerprint {ref.fingerprint[:16]}")
    print(f"[meshtrain] data ready in {seconds:.1f}s ({plan.tokens / max(seconds, 1e-9):,.0f} tok/s over the whole command)")
    return 0
