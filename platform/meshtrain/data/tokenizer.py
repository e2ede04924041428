"""The tokenizer: a user's tokenizer.json, or a byte-level BPE fitted on a bounded sample of the data."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from meshtrain.config import ConfigError
from meshtrain.data.sources import SourcePlan, first_line, unit_documents

EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizers, tried in order for a user's tokenizer.json.
_KNOWN_EOS_TOKENS = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eot_id|>")


def load_tokenizer_file(path: str) -> "tokenizers.Tokenizer":  # noqa: F821
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(Path(path).expanduser()))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ConfigError(
            f"data.tokenizer: {path!r} is not a readable tokenizer.json ({first_line(exc)}); "
            "give a file saved by the tokenizers library or 'train'"
        ) from None


def eos_token_id(tokenizer: "tokenizers.Tokenizer") -> int:  # noqa: F821
    for token in _KNOWN_EOS_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise ConfigError(
        f"data.tokenizer: no end-of-document token found (looked for {', '.join(_KNOWN_EOS_TOKENS)}); "
        "use a tokenizer that defines one"
    )


def tokenizer_sha256(tokenizer_json: str) -> str:
    return hashlib.sha256(tokenizer_json.encode()).hexdigest()


def sample_documents(plans: list[SourcePlan], weights: list[float], budget_bytes: int) -> Iterator[str]:
    """At most ``budget_bytes`` of text, split over the sources by weight and spread evenly over each
    source's units (the start of every unit), so a sample of a sorted corpus is not all from its head."""
    total_weight = sum(weights)
    for plan, weight in zip(plans, weights):
        per_unit = max(1, int(budget_bytes * weight / total_weight) // max(1, len(plan.units)))
        for unit in plan.units:
            taken = 0
            for parts in unit_documents(plan, unit):
                text = ""
                for part in parts:  # only as much of a long document as the sample takes
                    text += part
                    if len(text) >= per_unit - taken:
                        break
                yield text[: per_unit - taken]
                taken += min(len(text), per_unit - taken)
                if taken >= per_unit:
                    break


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> "tokenizers.Tokenizer":  # noqa: F821
    """A byte-level BPE fitted on ``texts``, with ``EOS_TOKEN`` as its only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def tokenizer_vocab_size(tokenizer: str, trained_vocab_size: int) -> int:
    """Vocabulary size the tokenizer will have, without reading the corpus."""
    if tokenizer == "train":
        return trained_vocab_size
    loaded = load_tokenizer_file(tokenizer)
    eos_token_id(loaded)  # the same check training does, before any worker starts
    return loaded.get_vocab_size()
