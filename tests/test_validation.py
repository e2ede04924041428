"""Validation at pretraining scale: whole documents held out (none of them ever trained on), an
evaluation set that draws from every source in turn, and training windows read ahead in background
threads that equal the windows read in the step."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from meshtrain.data import DataParallelBatches, MixtureSamples, PackedSequences
from meshtrain.data.sampling import IGNORE_INDEX
from meshtrain.data.splits import SpanSplit, held_out_count, span_windows_for
from meshtrain.data.validation import ValidationPart, ValidationSet

SEQ = 16
EOS = 0


def documents(lengths: list[int], first_id: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A stream of documents each followed by EOS; returns the tokens and each token's document
    number (the EOS belongs to the document it ends). Document ``d``'s tokens are all ``first_id + d``
    (never EOS), so any token says which document it came from."""
    tokens = np.concatenate([np.r_[np.full(n, first_id + d, dtype=np.int64), EOS] for d, n in enumerate(lengths)])
    owner = np.concatenate([np.full(n + 1, d) for d, n in enumerate(lengths)])
    return tokens, owner


@pytest.mark.parametrize(("windows", "fraction", "span"), [(1, 0.1, 4), (10, 0.1, 3), (997, 0.05, 7), (1000, 0.01, 64), (4096, 0.2, 1)])
def test_span_split_partitions_the_windows(windows: int, fraction: float, span: int) -> None:
    split = SpanSplit(windows, fraction, span)
    held = [split.held_out(k) for k in range(split.held_out_windows)]
    training = [split.training(j) for j in range(split.training_windows)]
    assert len(set(held)) == len(held) and len(set(training)) == len(training)
    assert set(held).isdisjoint(training) and set(held) | set(training) == set(range(windows))
    assert split.held_out_spans == held_out_count(split.spans, fraction)
    assert all(split.is_held_out(w) for w in held) and not any(split.is_held_out(w) for w in training)
    for w in held:  # whole spans are held out
        first, stop = split.span_of(w)
        assert stop - first == split.span_windows and all(split.is_held_out(v) for v in range(first, stop))
    # The first held-out windows come from different spans (one from each span in turn).
    firsts = {split.span_of(w)[0] for w in held[: split.held_out_spans]}
    assert len(firsts) == split.held_out_spans


@pytest.mark.parametrize(("tokens", "seq_len", "span", "times"), [(100_003, 16, 8, 2), (54_321, 8, 12, 4), (4_097, 32, 4, 2)])
def test_windows_of_another_length_hold_out_the_same_token_spans(tokens: int, seq_len: int, span: int, times: int) -> None:
    """A long-context stage's windows (``times`` the length) train on no token the base split holds out, and
    train on every token of the base's training windows' spans."""
    base = SpanSplit((tokens - 1) // seq_len, 0.05, span)
    longer = SpanSplit.at_length(base, (tokens - 1) // (seq_len * times), span // times)

    def covered(split: SpanSplit, length: int, windows: list[int]) -> set[int]:
        return {t for w in windows for t in range(w * length, (w + 1) * length)}  # the inputs' tokens

    held = covered(base, seq_len, [base.held_out(k) for k in range(base.held_out_windows)])
    trained = covered(longer, seq_len * times, [longer.training(j) for j in range(longer.training_windows)])
    assert held and trained and held.isdisjoint(trained)
    trained_base = covered(base, seq_len, [base.training(j) for j in range(base.spans * base.span_windows
                                                                           - base.held_out_windows)])
    assert trained_base <= trained


def test_span_length_follows_the_setting_and_shrinks_only_for_a_small_corpus() -> None:
    assert span_windows_for(128, 65536, windows=10**9, fraction=0.01) == 512
    assert span_windows_for(8192, 65536, windows=10**9, fraction=0.001) == 8
    assert span_windows_for(128, 65536, windows=1000, fraction=0.01) == 80  # at most 8x the fraction
    assert span_windows_for(128, 65536, windows=10, fraction=0.01) == 1


def test_held_out_documents_are_never_trained_on_and_every_scored_token_is_one() -> None:
    rng = np.random.default_rng(0)
    tokens, owner = documents([int(n) for n in rng.integers(1, 60, size=3000)])
    windows = (len(tokens) - 1) // SEQ
    split = SpanSplit(windows, 0.05, 12)
    sequences = PackedSequences(tokens, SEQ, seed=1, split=split)
    validation = ValidationSet([ValidationPart("s", sequences, split, EOS)])
    chosen = validation.select(10**9)
    assert 0 < len(chosen) <= split.held_out_windows
    trained_docs: set[int] = set()
    for i in range(sequences.windows):  # one epoch visits every training window
        start = sequences.window_of(i) * SEQ
        trained_docs.update(owner[start : start + SEQ + 1].tolist())
    scored_docs: set[int] = set()
    for item in chosen:
        positions = item.window * SEQ + 1 + np.arange(item.lo, item.hi)  # the scored targets
        scored_docs.update(owner[positions].tolist())
    assert scored_docs and not scored_docs & trained_docs
    # Scored documents are scored whole: every one of their tokens is a scored target exactly once.
    scored_positions = [p for item in chosen for p in range(item.window * SEQ + 1 + item.lo, item.window * SEQ + 1 + item.hi)]
    assert len(scored_positions) == len(set(scored_positions))
    assert sorted(scored_positions) == sorted(np.flatnonzero(np.isin(owner, sorted(scored_docs))).tolist())


def test_documents_longer_than_a_span_are_never_held_out_whole() -> None:
    tokens, _ = documents([200] * 40)  # every document longer than a span of 3 windows (48 tokens)
    windows = (len(tokens) - 1) // SEQ
    split = SpanSplit(windows, 0.1, 3)
    validation = ValidationSet([ValidationPart("s", PackedSequences(tokens, SEQ, 0, split=split), split, EOS)])
    assert validation.select(100) == []


def test_the_evaluation_order_takes_every_source_in_turn_and_scores_each_alone() -> None:
    parts = []
    for k, (count, length) in enumerate([(400, 9), (150, 20), (900, 5)]):
        tokens, _ = documents([length] * count, first_id=1 + 10000 * k)
        split = SpanSplit((len(tokens) - 1) // SEQ, 0.1, 8)
        parts.append(ValidationPart(f"s{k}", PackedSequences(tokens, SEQ, k, split=split), split, EOS))
    validation = ValidationSet(parts)
    chosen = validation.select(30)
    assert [item.part for item in chosen[:9]] == [0, 1, 2] * 3
    assert {item.part for item in chosen} == {0, 1, 2}
    batches = list(validation.batches(chosen, 4, 0, 1, torch.device("cpu")))
    for batch in batches:
        for row in range(len(batch.sources)):
            part = int(batch.sources[row])
            scored = batch.targets[row][batch.targets[row] != IGNORE_INDEX]
            assert len(scored) and set(scored.tolist()) <= {EOS, *range(1 + 10000 * part, 10001 + 10000 * part)}
    # The union of ranks' batches is the selection, whatever the number of ranks.
    def rows(ranks: int) -> list[tuple[int, ...]]:
        return sorted(tuple(r.tolist()) for k in range(ranks) for b in validation.batches(chosen, 2, k, ranks, torch.device("cpu")) for r in b.targets)
    assert rows(1) == rows(3) == rows(5)


class SlowStream:
    """A stream whose every read takes ``delay`` seconds, as a remote store's requests do."""

    def __init__(self, tokens: np.ndarray, delay: float) -> None:
        self.tokens, self.delay, self.reads = tokens, delay, 0

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        time.sleep(self.delay)
        self.reads += 1
        return self.tokens[start:stop]


def _mixture(delay: float) -> MixtureSamples:
    streams = [SlowStream(np.arange(k * 10**6, k * 10**6 + 4000 * SEQ + 1), delay) for k in range(2)]
    return MixtureSamples([PackedSequences(s, SEQ, (3, k), split=SpanSplit(4000, 0.01, 8)) for k, s in enumerate(streams)], [0.7, 0.3], 3)


def test_read_ahead_gives_the_same_batches_and_resumes_exactly() -> None:
    def run(read_ahead: int, start: int, steps: int) -> list[list[np.ndarray]]:
        batches = DataParallelBatches(_mixture(0.0), 24, 3, dp_rank=1, dp_size=2, device=torch.device("cpu"),
                                      position=start, read_ahead_steps=read_ahead, read_threads=3)
        try:
            return [[inputs.numpy().copy() for inputs, _ in batches.next_step()] for _ in range(steps)]
        finally:
            batches.close()

    plain = run(0, 0, 8)
    ahead = run(3, 0, 8)
    resumed = run(2, 24 * 5, 3)
    assert all(np.array_equal(a, b) for x, y in zip(plain, ahead) for a, b in zip(x, y))
    assert all(np.array_equal(a, b) for x, y in zip(plain[5:], resumed) for a, b in zip(x, y))


def test_the_next_steps_are_read_in_the_background() -> None:
    """After a step's batch is taken, the reads of the next ``read_ahead_steps`` steps happen without
    the trainer asking: with storage that takes tens of milliseconds per request, the step finds its
    batch read (``jobs/bench_scale.py`` measures the wait)."""
    mixture = _mixture(0.005)
    streams = [component.stream for component in mixture.components]
    batches = DataParallelBatches(mixture, 24, 3, dp_rank=0, dp_size=2, device=torch.device("cpu"),
                                  read_ahead_steps=2, read_threads=4)
    per_step = 12  # this rank's samples per step: 24 / 2 ranks
    try:
        list(batches.next_step())
        deadline = time.monotonic() + 30
        while sum(s.reads for s in streams) < 3 * per_step and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sum(s.reads for s in streams) == 3 * per_step  # this step and the two after it, no more
        list(batches.next_step())
        while sum(s.reads for s in streams) < 4 * per_step and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sum(s.reads for s in streams) == 4 * per_step
    finally:
        batches.close()
