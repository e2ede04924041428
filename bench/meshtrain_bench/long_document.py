"""Peak memory and time of preparing one very long document (a single JSON Lines record, or a text file).

A prepare task encodes at most ``PIECE_CHARS`` characters at once; this measures what a task holds
beside that while it prepares a document of ``--megabytes`` (default 50) MB: the line as read, its text,
the tokens. Each case runs ``prepare_store`` (``use_ray=False``, one tokenizer thread, as a Ray task runs)
in a fresh process and reports its peak RSS (``getrusage``), its RSS before the prepare (interpreter,
numpy, tokenizers and the tokenizer loaded), the seconds and the store's fingerprint (the same
fingerprint means the same tokens: compare it across versions).

    python jobs/bench_long_document.py                      # 50 MB, as JSON Lines and as a text file
    python jobs/bench_long_document.py --megabytes 200 --formats jsonl
    python jobs/bench_long_document.py --megabytes 200 --formats jsonl --emoji

The document is the standard library's sources, repeated (each copy numbered), written under
``--folder`` (default /tmp/meshtrain-long-document); a BPE of ``--vocab-size`` is trained on the
sources once and kept there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from meshtrain.data import stdlib_source_files

TASK_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}


def make_document(folder: Path, megabytes: int, kind: str, emoji: bool = False) -> Path:
    """One document of about ``megabytes`` MB of text: a one-line ``.jsonl`` record or a ``.txt`` file;
    ``emoji``: an emoji in every copy's heading (so Python holds the text at 4 bytes a character)."""
    path = folder / f"doc-{megabytes}mb-{kind}{'-emoji' if emoji else ''}" / f"document.{kind}"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    texts = [p.read_text() for p in stdlib_source_files()]
    partial = path.with_suffix(".partial")
    target, written, copy = megabytes * 10**6, 0, 0
    with partial.open("w", encoding="utf-8") as out:
        if kind == "jsonl":
            out.write('{"id": 1, "text": "')
        while written < target:
            for text in texts:
                chunk = f"# copy {copy}{' 😀' if emoji else ''}\n{text}"
                out.write(json.dumps(chunk)[1:-1] if kind == "jsonl" else chunk)
                written += len(chunk)
                if written >= target:
                    break
            copy += 1
        if kind == "jsonl":
            out.write('", "source": "stdlib"}\n')
    partial.rename(path)
    return path


def tokenizer_file(folder: Path, vocab_size: int) -> Path:
    path = folder / f"tokenizer-{vocab_size}.json"
    if not path.exists():
        from meshtrain.data.tokenizer import train_tokenizer

        texts = [p.read_text() for p in stdlib_source_files()]
        train_tokenizer(iter(texts), vocab_size).save(str(path))
    return path


def measure(document: Path, tokenizer: Path, store: Path) -> dict[str, object]:
    """In this process (started for it): prepare ``document`` into ``store``; seconds and RSS figures."""
    from meshtrain.config import SourceConfig
    from meshtrain.data.prepare import prepare_store
    from meshtrain.data.sources import plan_source

    tokenizer_json = tokenizer.read_text()
    from tokenizers import Tokenizer

    Tokenizer.from_str(tokenizer_json).encode("warm up")
    plan = plan_source(SourceConfig(source=str(document)), 64 * 2**20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    report = prepare_store(plan, tokenizer_json, str(store), use_ray=False, progress_interval_s=60)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "rss_before": before, "rss_peak": peak, "tokens": report.manifest.tokens, "fingerprint": report.manifest.fingerprint}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=50)
    parser.add_argument("--formats", default="jsonl,txt", help="comma-separated: jsonl, txt")
    parser.add_argument("--folder", default="/tmp/meshtrain-long-document")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--emoji", action="store_true", help="an emoji in every copy (4 bytes a character in Python)")
    parser.add_argument("--child", nargs=3, metavar=("DOCUMENT", "TOKENIZER", "STORE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(*map(Path, args.child))))
        return 0
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_file(folder, args.vocab_size)
    env = {**os.environ, **TASK_ENV}
    print(f"{'case':<16} {'seconds':>8} {'RSS before':>11} {'peak RSS':>9} {'peak-before':>11} {'tokens':>12}  fingerprint")
    for kind in args.formats.split(","):
        document = make_document(folder, args.megabytes, kind, args.emoji)
        store = folder / f"store-{document.parent.name}"
        subprocess.run(["rm", "-rf", str(store)], check=True)
        child = [sys.executable, __file__.replace(".pyc", ".py"), "--child", str(document), str(tokenizer), str(store)]
        result = subprocess.run(child, env=env, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"the prepare failed:\n{result.stdout}\n{result.stderr}")
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        mb = 1e6
        print(f"{f'{args.megabytes} MB {kind}' + (' emoji' if args.emoji else ''):<16} {figures['seconds']:>8.1f} {figures['rss_before'] / mb:>8.0f} MB "
              f"{figures['rss_peak'] / mb:>6.0f} MB {(figures['rss_peak'] - figures['rss_before']) / mb:>8.0f} MB "
              f"{figures['tokens']:>12,}  {figures['fingerprint'][:16]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
