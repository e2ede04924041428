"""Text samples from a committed checkpoint: transformers' cached generation on the in-memory Llama.

One tiny trained run serves every test. The cached continuation must equal a hand-written greedy
loop over meshtrain's own model that recomputes the whole prefix for every token.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from corpora import trained_tiny_run
from meshtrain.checkpoint.export import load_model_state
from meshtrain.cli.generate import main as generate_main
from meshtrain.config import ConfigError
from meshtrain.evaluate.generation import continue_ids, continue_prompts, prompt_ids
from meshtrain.evaluate.hf_model import CheckpointModel, load_checkpoint_model
from meshtrain.model.llama import Transformer, build_model

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["def main(", "import os\n", ""]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trained run (tied embeddings, GQA, max_seq_len 1024): a committed checkpoint at step 4, its tokenizer."""
    return trained_tiny_run(tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("stores"), "sampled", 4)


@pytest.fixture(scope="module")
def checkpoint(run_dir: Path) -> str:
    return str(run_dir / "checkpoints" / "step-00000004")


@pytest.fixture(scope="module")
def loaded(checkpoint: str) -> CheckpointModel:
    return load_checkpoint_model(checkpoint)


@pytest.fixture(scope="module")
def own_model(checkpoint: str) -> Transformer:
    """The checkpoint in meshtrain's own model, as training computes it."""
    state, args, _ = load_model_state(checkpoint)
    model = build_model(args, "cpu")
    model.load_state_dict(state)
    return model.eval()


def _greedy_without_cache(model: Transformer, ids: list[int], new: int, eos: int) -> list[int]:
    """The whole prefix through every forward, the argmax token appended."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(new):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
            if tokens[-1] == eos:
                break
    return tokens[len(ids):]


def test_greedy_continuation_equals_an_uncached_loop_over_meshtrains_model(
    loaded: CheckpointModel, own_model: Transformer
) -> None:
    """Token for token, each prompt alone and all of them in one call."""
    eos = loaded.tokenizer.eos_token_id
    expected: list[list[int]] = []
    for prompt in PROMPTS:
        ids = prompt_ids(loaded, prompt)
        assert ids[0] == eos and len(ids) == 1 + len(loaded.tokenizer.encode(prompt, add_special_tokens=False))
        expected.append(_greedy_without_cache(own_model, ids, 32, eos))
        assert len(expected[-1]) == 32 and eos not in expected[-1]  # a full-length comparison, not an early stop
        assert continue_ids(loaded, [ids], 32) == [expected[-1]], prompt
    assert continue_prompts(loaded, PROMPTS, 32) == [
        {"prompt": prompt, "continuation": loaded.tokenizer.decode(ids), "new_tokens": 32, "stopped_at_eos": False}
        for prompt, ids in zip(PROMPTS, expected, strict=True)
    ]


def test_a_sample_does_not_depend_on_the_prompts_beside_it(loaded: CheckpointModel) -> None:
    settings: dict[str, Any] = {"temperature": 1.0, "top_p": 0.9, "seed": 3}
    together = continue_prompts(loaded, PROMPTS, 12, **settings)
    assert together == [continue_prompts(loaded, [prompt], 12, **settings)[0] for prompt in PROMPTS]


def test_generation_stops_at_the_end_of_document_token(loaded: CheckpointModel) -> None:
    """Greedy with the end-of-document token's logit raised above every other: the first new token ends it."""
    head = loaded.model.get_output_embeddings()
    eos = loaded.tokenizer.eos_token_id
    hook = head.register_forward_hook(lambda _m, _i, out: out.index_fill(-1, torch.tensor([eos]), 1e4))
    try:
        [result] = continue_prompts(loaded, ["def main("], 16)
    finally:
        hook.remove()
    assert result == {"prompt": "def main(", "continuation": "", "new_tokens": 0, "stopped_at_eos": True}


def test_each_new_token_is_one_positions_forward(loaded: CheckpointModel) -> None:
    seen: list[int] = []

    def count(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids")
        seen.append((ids if ids is not None else kwargs["inputs_embeds"]).shape[1])

    prompt = prompt_ids(loaded, "def main(argv):\n    return 0\n")
    hook = loaded.model.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        [new] = continue_ids(loaded, [prompt], 64)
    finally:
        hook.remove()
    assert len(new) == 64
    # The prompt once, then each new token alone; the 64th is never fed back. Without a cache the
    # forwards would see len(prompt) + k positions each, 64 * len(prompt) + 2016 in all.
    assert seen == [len(prompt)] + [1] * 63
    assert sum(seen) == len(prompt) + 63


def test_sampling_is_reproducible_by_seed_and_leaves_the_global_rng_alone(loaded: CheckpointModel) -> None:
    prompts, sample = PROMPTS[:2], {"temperature": 1.5, "top_p": 1.0}
    torch.manual_seed(123)
    first = continue_prompts(loaded, prompts, 24, seed=7, **sample)
    torch.manual_seed(456)  # the caller's RNG state does not matter either
    state = torch.get_rng_state()
    again = continue_prompts(loaded, prompts, 24, seed=7, **sample)
    assert torch.equal(torch.get_rng_state(), state)
    assert again == first
    other = continue_prompts(loaded, prompts, 24, seed=8, **sample)
    assert [r["continuation"] for r in other] != [r["continuation"] for r in first]
    greedy = continue_prompts(loaded, prompts, 24)
    assert greedy != first
    assert continue_prompts(loaded, prompts, 24, temperature=0.0, top_p=0.5, seed=9) == greedy
    # A nucleus of (almost) no mass holds the most likely token only: greedy again.
    assert continue_prompts(loaded, prompts, 24, temperature=1.0, top_p=1e-9, seed=7) == greedy


def test_sampling_draws_beyond_transformers_default_top_k(loaded: CheckpointModel, own_model: Transformer) -> None:
    """Only temperature and top-p shape the distribution: some drawn tokens rank past 50 (the default top-k)."""
    prompt = prompt_ids(loaded, "def main(")
    [new] = continue_ids(loaded, [prompt], 32, temperature=2.0, seed=1)
    with torch.no_grad():
        logits = own_model(torch.tensor([prompt + new]))[0, len(prompt) - 1:-1]
    drawn = logits.gather(1, torch.tensor(new)[:, None])
    ranks = (logits > drawn).sum(dim=1)
    assert int(ranks.max()) >= 50, ranks.tolist()


def test_refusals_are_one_line_config_errors(loaded: CheckpointModel) -> None:
    limit = loaded.args.max_seq_len
    size = len(prompt_ids(loaded, "def main("))
    refusal = (rf"^prompt 2 is {size} tokens and max_new_tokens={limit - 2}: together more than the model's "
               rf"max_seq_len={limit}; ask for at most {limit - size} new tokens or shorten it to 2 tokens$")
    with pytest.raises(ConfigError, match=refusal):
        continue_prompts(loaded, ["", "def main("], limit - 2)
    for settings, message in (({"max_new_tokens": 0}, "max_new_tokens=0"), ({"temperature": -0.5}, "temperature=-0.5"),
                              ({"top_p": 0.0}, "top_p=0.0"), ({"top_p": 1.5}, "top_p=1.5")):
        with pytest.raises(ConfigError, match=message):
            continue_prompts(loaded, ["x"], **{"max_new_tokens": 4, **settings})


@pytest.mark.processes
def test_jobs_generate_prints_the_prompt_and_its_continuation(run_dir: Path, loaded: CheckpointModel) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "generate.py"), str(run_dir), "def main(", "--max-new-tokens", "12"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [expected] = continue_prompts(loaded, ["def main("], 12)
    lines = result.stdout.splitlines()
    assert lines[0].startswith("[meshtrain] step 4 of ") and lines[0].endswith(": greedy, at most 12 new tokens")
    body = "\n".join(lines[1:-1])
    assert body == ("===== prompt 1 =====\ndef main(\n===== continuation 1: 12 new tokens, no end-of-document "
                    f"token =====\n{expected['continuation']}"), result.stdout
    assert lines[-1].startswith("===== 12 new tokens in "), lines[-1]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["nowhere", "x"], "does not exist"),
        (["RUN", "x", "--max-new-tokens", "0"], "--max-new-tokens=0: give a positive number"),
        (["RUN", "x", "--temperature", "-1"], "--temperature=-1.0"),
        (["RUN", "x", "--top-p", "0"], "--top-p=0.0: give a probability mass in (0, 1]"),
        (["RUN", "x", "--top-p", "1.5"], "--top-p=1.5"),
        (["RUN", "x", "--max-new-tokens", "5000"], "prompt 1 is 2 tokens and max_new_tokens=5000"),
        (["RUN", "x", "--storage-option", "secret"], "--storage-option: expected KEY=VALUE"),
    ],
)
def test_bad_generation_input_is_one_line(
    run_dir: Path, tmp_path: Path, arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    where = {"RUN": str(run_dir), "nowhere": str(tmp_path / "nowhere")}
    try:
        code = generate_main([where.get(argument, argument) for argument in arguments])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("generate: error: ") and message in error[0], error
