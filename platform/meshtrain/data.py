"""Corpus → tokenizer → one packed token stream → fixed windows → per-rank micro-batches.

Documents are read through Hugging Face ``datasets`` (the Python standard library's own sources by
default, so nothing is downloaded), tokenized, joined with an end-of-document token, and cut into
windows of ``seq_len + 1`` tokens (inputs and shifted targets): no padding anywhere.

The order of windows is a seeded permutation per epoch over the *global* sample index. Optimizer
step ``t`` consumes global samples ``[t*G, (t+1)*G)``; each data-parallel rank takes its own
disjoint part of every micro-batch. The only state is that global position, so a run resumes
exactly, and on any number of ranks, from one integer.
"""

from __future__ import annotations

import glob
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshtrain.config import ConfigError, DataConfig

EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizers, tried in order for a user's tokenizer.json.
_KNOWN_EOS_TOKENS = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eot_id|>")
_LOADERS_BY_SUFFIX = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def stdlib_source_files() -> list[Path]:
    """The top-level ``*.py`` files of this interpreter's standard library (present on every machine)."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def expand_local_source(source: str) -> list[Path]:
    """Data files named by a file, a directory (searched recursively) or a glob."""
    path = Path(source).expanduser()
    if path.is_file():
        candidates = [path]
    elif path.is_dir():
        candidates = sorted(p for p in path.rglob("*") if p.is_file())
    else:
        candidates = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    return [p for p in candidates if p.suffix.lower() in _LOADERS_BY_SUFFIX]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def load_documents(cfg: DataConfig) -> "datasets.Dataset":  # noqa: F821
    """The corpus as a ``datasets.Dataset`` with a single ``text`` column."""
    try:
        return _load_documents(cfg)
    except ConfigError:
        raise
    except Exception as exc:  # datasets raises many types; the user needs the source named
        hint = "check network access and the dataset name" if cfg.source.startswith("hf:") else "check the files"
        raise ConfigError(f"data.source: cannot read {cfg.source!r} ({_first_line(exc)}); {hint}") from None


def load_tokenizer_file(path: str) -> "tokenizers.Tokenizer":  # noqa: F821
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(Path(path).expanduser()))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ConfigError(
            f"data.tokenizer: {path!r} is not a readable tokenizer.json ({_first_line(exc)}); "
            "give a file saved by the tokenizers library or 'train'"
        ) from None


def _load_documents(cfg: DataConfig) -> "datasets.Dataset":  # noqa: F821
    import datasets

    datasets.disable_progress_bars()
    if cfg.source == "stdlib":
        files = [str(p) for p in stdlib_source_files()]
        docs = datasets.load_dataset("text", data_files=files, sample_by="document", split="train")
    elif cfg.source.startswith("hf:"):
        docs = datasets.load_dataset(cfg.source[3:], cfg.hf_config, split=cfg.split)
    else:
        files = expand_local_source(cfg.source)
        loaders = {_LOADERS_BY_SUFFIX[p.suffix.lower()] for p in files}
        if len(loaders) != 1:
            raise ConfigError(
                f"data.source: {cfg.source!r} mixes formats ({', '.join(sorted(loaders))}); point it at one kind of file"
            )
        loader = loaders.pop()
        kwargs = {"sample_by": "document"} if loader == "text" else {}
        docs = datasets.load_dataset(loader, data_files=[str(p) for p in files], split="train", **kwargs)
    field = "text" if cfg.source == "stdlib" else cfg.text_field
    if field not in docs.column_names:
        raise ConfigError(
            f"data.text_field: column {field!r} not in {cfg.source!r} (columns: {', '.join(docs.column_names)})"
        )
    docs = docs.select_columns([field])
    if field != "text":
        docs = docs.rename_column(field, "text")
    if cfg.max_documents is not None:
        docs = docs.select(range(min(cfg.max_documents, len(docs))))
    return docs


def train_tokenizer(docs: "datasets.Dataset", vocab_size: int) -> "tokenizers.Tokenizer":  # noqa: F821
    """A byte-level BPE fitted on ``docs``, with ``EOS_TOKEN`` as its only special token."""
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
    tokenizer.train_from_iterator((batch["text"] for batch in docs.iter(batch_size=256)), trainer=trainer)
    return tokenizer


def eos_token_id(tokenizer: "tokenizers.Tokenizer") -> int:  # noqa: F821
    for token in _KNOWN_EOS_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise ConfigError(
        f"data.tokenizer: no end-of-document token found (looked for {', '.join(_KNOWN_EOS_TOKENS)}); "
        "use a tokenizer that defines one"
    )


@dataclass
class Corpus:
    """The whole training stream: token ids with an end-of-document token after every document."""

    tokens: np.ndarray
    tokenizer_json: str
    vocab_size: int
    eos_id: int
    documents: int


def tokenize_documents(docs: "datasets.Dataset", tokenizer: "tokenizers.Tokenizer") -> np.ndarray:  # noqa: F821
    eos = eos_token_id(tokenizer)
    dtype = np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.uint32
    pieces: list[np.ndarray] = []
    for batch in docs.iter(batch_size=256):
        for encoding in tokenizer.encode_batch(batch["text"]):
            pieces.append(np.asarray(encoding.ids + [eos], dtype=dtype))
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=dtype)


def prepare_corpus(cfg: DataConfig, tokenizer_json: str | None = None) -> Corpus:
    """Read, (train a tokenizer if asked and none is given,) and tokenize the corpus."""
    from tokenizers import Tokenizer

    docs = load_documents(cfg)
    if tokenizer_json is not None:
        tokenizer = Tokenizer.from_str(tokenizer_json)
    elif cfg.tokenizer == "train":
        tokenizer = train_tokenizer(docs, cfg.vocab_size)
    else:
        tokenizer = load_tokenizer_file(cfg.tokenizer)
    tokens = tokenize_documents(docs, tokenizer)
    if len(tokens) < cfg.seq_len + 1:
        raise ConfigError(
            f"data.source: {cfg.source!r} holds {len(tokens)} tokens, fewer than data.seq_len+1="
            f"{cfg.seq_len + 1}; add documents or lower data.seq_len"
        )
    return Corpus(
        tokens=tokens,
        tokenizer_json=tokenizer.to_str(),
        vocab_size=tokenizer.get_vocab_size(),
        eos_id=eos_token_id(tokenizer),
        documents=len(docs),
    )


class PackedSequences:
    """Windows of ``seq_len + 1`` tokens over the token stream, in a seeded order per epoch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of {seq_len + 1}")
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def _order_for(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
        return self._order

    def sample(self, global_index: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of global sample ``global_index`` (epochs wrap around)."""
        epoch, position = divmod(global_index, self.windows)
        start = int(self._order_for(epoch)[position]) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


class DataParallelBatches:
    """This rank's micro-batches for each optimizer step, from a global sample position.

    Step layout: the global batch of ``G`` samples is split into ``accumulation`` micro-steps;
    micro-step ``a`` gives rank ``r`` samples ``a*dp*m + r*m + [0, m)`` of the batch.
    """

    def __init__(
        self,
        samples: PackedSequences,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        position: int = 0,
    ) -> None:
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError("global batch must be a multiple of micro batch x data-parallel size")
        self.samples, self.global_batch_size, self.micro_batch_size = samples, global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size, self.device = dp_rank, dp_size, device
        self.accumulation = global_batch_size // (micro_batch_size * dp_size)
        self.position = position

    def next_step(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) per micro-step of the next optimizer step; advances the position."""
        base, self.position = self.position, self.position + self.global_batch_size
        per_micro_step = self.micro_batch_size * self.dp_size
        for micro_step in range(self.accumulation):
            first = base + micro_step * per_micro_step + self.dp_rank * self.micro_batch_size
            rows = np.stack([self.samples.sample(first + i) for i in range(self.micro_batch_size)])
            batch = torch.from_numpy(rows.astype(np.int64))
            if self.device.type == "cuda":
                batch = batch.pin_memory().to(self.device, non_blocking=True)
            yield batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def tokenizer_vocab_size(cfg: DataConfig) -> int:
    """Vocabulary size the tokenizer will have, without reading the corpus."""
    if cfg.tokenizer == "train":
        return cfg.vocab_size
    tokenizer = load_tokenizer_file(cfg.tokenizer)
    eos_token_id(tokenizer)  # the same check training does, before any worker starts
    return tokenizer.get_vocab_size()
