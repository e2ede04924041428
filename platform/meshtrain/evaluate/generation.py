"""Text continuations of prompts by a checkpoint's model: the quickest human check that training works.

Generation is ``transformers``' own ``generate`` on the in-memory ``LlamaForCausalLM`` that
:func:`meshtrain.evaluate.hf_model.load_checkpoint_model` builds: it keeps a KV cache, so each new
token costs one position's forward, not the whole prefix's. Greedy at temperature 0, otherwise
sampling at ``temperature`` from the nucleus ``top_p`` (no top-k cut), stopping at the run's
end-of-document token.

- Each prompt is opened by the end-of-document token, as every document is in training (under
  ``model.document_mask`` that token sits at position 0 and opens the document): the model
  continues the prompt as the start of a document, and an empty prompt gives an unconditional sample.
- A prompt whose tokens (that one included) plus ``max_new_tokens`` exceed the model's ``max_seq_len``
  is refused with a ConfigError saying what fits, not cut from the left: a cut prompt silently asks
  the model another question.
- Prompts run one at a time, not as a left-padded batch: greedy text is then exactly what the prompt
  gives alone (padding changes a batch's float sums, which can flip a near tie), and a sample depends
  only on its prompt, the settings and the seed, never on the prompts beside it.
- ``generate`` samples from the global torch RNG (it takes no generator), so each prompt runs in
  ``torch.random.fork_rng`` with the generator of the model's device (CPU, or its GPU) seeded with
  ``seed``: the caller's RNG state is left as it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from meshtrain.config import ConfigError
from meshtrain.evaluate.hf_model import CheckpointModel
from meshtrain.observe.run_folder import TextSample


def check_settings(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """ConfigError unless the generation settings make sense."""
    if max_new_tokens <= 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens}: ask for at least 1 new token")
    if not (math.isfinite(temperature) and temperature >= 0):  # nan would pass a plain < 0 and sample greedily
        raise ConfigError(f"temperature={temperature}: give 0 (greedy) or a positive finite temperature")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p={top_p}: give a probability mass in (0, 1]; 1 samples from every token")


def prompt_ids(loaded: CheckpointModel, prompt: str) -> list[int]:
    """The token ids the model continues: the end-of-document token, then the prompt's tokens."""
    eos = loaded.tokenizer.eos_token_id
    return [eos, *loaded.tokenizer.encode(prompt, add_special_tokens=False)]


def continue_ids(
    loaded: CheckpointModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[list[int]]:
    """Each prompt's new token ids (ending with the end-of-document token where it stopped there).

    Every prompt is checked against the model's ``max_seq_len`` before any is continued."""
    import transformers

    check_settings(max_new_tokens, temperature, top_p)
    limit = loaded.args.max_seq_len
    for number, ids in enumerate(prompts, 1):
        if len(ids) + max_new_tokens > limit:
            fixes = [f"ask for at most {limit - len(ids)} new tokens"] if len(ids) < limit else []
            if max_new_tokens < limit:
                fixes.append(f"shorten it to {limit - max_new_tokens} tokens")
            fits = " or ".join(fixes) or f"shorten it and ask for fewer than {limit} new tokens"
            raise ConfigError(
                f"prompt {number} is {len(ids)} tokens and max_new_tokens={max_new_tokens}: together more than the "
                f"model's max_seq_len={limit}; {fits}"
            )
    eos = loaded.tokenizer.eos_token_id
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} if temperature > 0
        else {"do_sample": False}
    )
    config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos, **sampling
    )
    device = loaded.model.device
    # Sampling draws from the generator of the model's device: that one is forked and seeded.
    on_gpu = device.type == "cuda"
    continuations: list[list[int]] = []
    for ids in prompts:
        tokens = torch.tensor([list(ids)], dtype=torch.long, device=device)
        with torch.random.fork_rng(devices=[device.index or 0] if on_gpu else []), torch.inference_mode():
            torch.default_generator.manual_seed(seed)
            if on_gpu:
                torch.cuda.manual_seed(seed)
            # The mask is given: with pad = eos, transformers would otherwise guess one from the tokens.
            out = loaded.model.generate(tokens, attention_mask=torch.ones_like(tokens), generation_config=config)
        continuations.append(out[0, tokens.shape[1]:].tolist())
    return continuations


def continue_prompts(
    loaded: CheckpointModel,
    prompts: Sequence[str],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[TextSample]:
    """Each prompt's continuation: ``{"prompt", "continuation", "new_tokens", "stopped_at_eos"}``.

    ``new_tokens`` counts the continuation's tokens, not the end-of-document token that ended it."""
    eos = loaded.tokenizer.eos_token_id
    new = continue_ids(loaded, [prompt_ids(loaded, prompt) for prompt in prompts], max_new_tokens,
                       temperature=temperature, top_p=top_p, seed=seed)
    results: list[TextSample] = []
    for prompt, ids in zip(prompts, new, strict=True):
        stopped = bool(ids) and ids[-1] == eos
        text_ids = ids[:-1] if stopped else ids
        results.append(TextSample(prompt=prompt, continuation=loaded.tokenizer.decode(text_ids),
                                  new_tokens=len(text_ids), stopped_at_eos=stopped))
    return results
