"""A committed checkpoint as a ``transformers`` Llama and tokenizer, in memory.

lm-evaluation-harness scores ``transformers`` models (its ``HFLM``), so the checkpoint becomes the
``LlamaForCausalLM`` that ``jobs/export.py --format hf`` would write, without the files: the model is
built without initialising its weights, and DCP reads the checkpoint's tensors straight into its
parameters (one copy of the model in memory; every byte checked against the checkpoint's checksums).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.checkpoint.averaging import AveragedModel
from meshtrain.checkpoint.reading import CommittedModel, run_tokenizer, tokenizer_files
from meshtrain.config import ConfigError, ModelArgs, one_line
from meshtrain.model.hf_llama import hf_config, hf_name
from meshtrain.model.llama import build_model


class NoTokenizer(ConfigError):
    """The checkpoint's run holds no tokenizer the harness can score text with."""


@dataclass
class CheckpointModel:
    """A checkpoint's model and tokenizer, ready for the harness."""

    model: Any  # transformers.LlamaForCausalLM, in eval mode
    tokenizer: Any  # transformers.PreTrainedTokenizerFast, with the run's end-of-document token
    step: int
    args: ModelArgs


def load_checkpoint_model(
    checkpoint: str, storage_options: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32,
    average: int | None = None,
) -> CheckpointModel:
    """The model of the committed ``checkpoint`` (a step directory, local or fsspec URL) as a
    ``LlamaForCausalLM`` in ``dtype`` on the CPU, with its run's tokenizer; with ``average``, the mean of
    the newest ``average`` committed checkpoints under ``checkpoint`` (a checkpoint root)."""
    import transformers
    from tokenizers import Tokenizer
    from transformers.initialization import no_init_weights

    source: CommittedModel | AveragedModel
    if average is not None:
        source = AveragedModel.open(checkpoint, average, storage_options)
        tokenizer_json = run_tokenizer(source.newest, source.manifest, storage_options)
    else:
        source = CommittedModel.open(checkpoint, storage_options)
        tokenizer_json = run_tokenizer(checkpoint, source.manifest, storage_options)
    args = source.args
    if tokenizer_json is None:
        raise NoTokenizer(
            f"checkpoint {checkpoint}: its run folder has no tokenizer.json, so text cannot be scored; evaluate a "
            "checkpoint of a meshtrain run (the launcher writes one) or copy the run's tokenizer.json next to checkpoints/"
        )
    try:
        Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # the tokenizers library raises a bare Exception for a malformed file
        raise NoTokenizer(
            f"checkpoint {checkpoint}: its run's tokenizer.json is not a tokenizer ({one_line(exc, limit=160)}); "
            "put back the tokenizer.json the run was trained with"
        ) from None
    _, eos_id = tokenizer_files(tokenizer_json, args.max_seq_len)
    if eos_id is None:
        raise NoTokenizer(
            f"checkpoint {checkpoint}: the run's tokenizer.json has no end-of-document token, which the harness "
            "pads with and starts every scored text after; train with a tokenizer that has one"
        )
    with no_init_weights():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(args, eos_id)))
    model.tie_weights()  # built without initialization, a tied head is a tensor of its own until tied
    # The parameters themselves (a tied head is the embedding's tensor under both names): DCP fills them in place.
    params = {name: param.data for name, param in model.named_parameters(remove_duplicate=False)}
    source.load(source.to_load({name: params[hf_name(name)] for name in build_model(args, "meta").state_dict()}))
    model = model.to(dtype).eval()
    text = Tokenizer.from_str(tokenizer_json)
    # The harness pads with, and starts every scored text after, the end-of-document token (the run's
    # tokenizer has no BOS): as packed training windows start after one.
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=text, model_max_length=args.max_seq_len,
        eos_token=text.id_to_token(eos_id),
    )
    return CheckpointModel(model, tokenizer, int(source.manifest.get("step", -1)), args)
