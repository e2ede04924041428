"""Continue prompts with a committed meshtrain checkpoint's model and print the text.

Run with ``python jobs/generate.py`` (its docstring shows examples; ``--help`` lists the options).
The checkpoint becomes a ``transformers`` Llama in this process (only model tensors are read, each
checked against the checkpoint's checksums) and ``transformers``' ``generate`` continues each prompt
with a KV cache: greedy by default, sampling with ``--temperature``/``--top-p`` (reproducible with
``--seed``), stopping at the run's end-of-document token (see meshtrain.evaluate.generation). Exit
code 2 with one line on stderr for bad settings, a missing, uncommitted or damaged checkpoint, a run
without its tokenizer, or a prompt that does not fit the model's context with the new tokens (or is not
UTF-8); any other failure (storage that does not answer, say) is one line too, with exit code 1.
"""

from __future__ import annotations

import argparse
import math
import time

from meshtrain.cli.common import (
    OneLineParser,
    add_storage_options_argument,
    fail,
    interrupted,
    refuse,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        error_prefix="generate: error",
        prog="generate.py",
        description="Print continuations of prompts by a committed meshtrain checkpoint's model.",
    )
    parser.add_argument(
        "checkpoint",
        help="a committed step-XXXXXXXX directory, a checkpoint root or a run folder (then its newest committed step)",
    )
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to continue (each on its own)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (the default); above 0 samples at this temperature")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="when sampling, draw from the smallest set of tokens holding this probability (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling, per prompt (default 0)")
    add_storage_options_argument(parser)
    args = parser.parse_args(argv)
    if args.max_new_tokens <= 0:
        parser.error(f"--max-new-tokens={args.max_new_tokens}: give a positive number")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"--temperature={args.temperature}: give 0 (greedy) or a positive finite temperature")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p={args.top_p}: give a probability mass in (0, 1]")
    if not -(2**63) <= args.seed < 2**64:
        parser.error(f"--seed={args.seed}: give a seed from -2**63 to 2**64 - 1")
    for number, prompt in enumerate(args.prompts, 1):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes the locale could not decode reach Python as lone surrogates
            parser.error(f"prompt {number} is not UTF-8 text (character {exc.start + 1} is an undecodable byte); "
                         "give prompts in UTF-8")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = args.storage_option
    from meshtrain.checkpoint.storage import CheckpointError
    from meshtrain.config import ConfigError
    from meshtrain.evaluate.generation import continue_prompts
    from meshtrain.evaluate.hf_model import load_checkpoint_model

    try:
        from meshtrain.checkpoint.reading import checkpoint_in  # torch: after the arguments are checked

        checkpoint = checkpoint_in(args.checkpoint, options)
        loaded = load_checkpoint_model(checkpoint, options)
        started = time.perf_counter()
        results = continue_prompts(loaded, args.prompts, args.max_new_tokens, temperature=args.temperature,
                                   top_p=args.top_p, seed=args.seed)
        seconds = time.perf_counter() - started
    except (CheckpointError, ConfigError) as exc:
        return refuse("generate", exc)
    except KeyboardInterrupt:
        return interrupted("generate")
    except Exception as exc:  # storage that refuses or does not answer, a damaged run file, ...: one line
        return fail("generate", exc)
    mode = ("greedy" if args.temperature == 0
            else f"sampling at temperature {args.temperature}, top-p {args.top_p}, seed {args.seed}")
    print(f"[meshtrain] step {loaded.step} of {checkpoint}: {mode}, at most {args.max_new_tokens} new tokens")
    for number, result in enumerate(results, 1):
        end = "stopped at the end-of-document token" if result["stopped_at_eos"] else "no end-of-document token"
        print(f"===== prompt {number} =====")
        print(result["prompt"])
        print(f"===== continuation {number}: {result['new_tokens']} new tokens, {end} =====")
        print(result["continuation"])
    tokens = sum(result["new_tokens"] for result in results)
    print(f"===== {tokens} new tokens in {seconds:.2f}s ({tokens / seconds:.1f} tokens/s) =====", flush=True)
    return 0
