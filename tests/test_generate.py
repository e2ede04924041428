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
from meshtrain.checkpoint.reading import load_model_state
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


# --- every failure is one line ------------------------------------------------------------------


def _generate(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of generate's main in this process; no traceback on stderr."""
    try:
        code = generate_main(arguments)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err.strip().splitlines()


def _copy_of_run(run_dir: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run_dir, tmp_path / run_dir.name))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--temperature", "nan"], "--temperature=nan: give 0 (greedy) or a positive finite temperature"),
        (["--temperature", "inf"], "--temperature=inf"),
        (["--top-p", "nan"], "--top-p=nan"),
        (["--seed", str(2**64)], "--seed=18446744073709551616"),
    ],
)
def test_settings_are_checked_before_the_checkpoint_is_read(
    run_dir: Path, arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, lines = _generate([str(run_dir), "x", *arguments], capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("generate: error: ") and message in lines[0], lines


def test_nan_temperature_is_refused_by_the_library_too(loaded: CheckpointModel) -> None:
    with pytest.raises(ConfigError, match=r"^temperature=nan: give 0 \(greedy\) or a positive finite temperature$"):
        continue_prompts(loaded, ["x"], 4, temperature=float("nan"))


def test_a_prompt_that_is_not_utf8_is_one_line(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes the locale cannot decode reach argv as lone surrogates (``b"\\xff".decode(errors="surrogateescape")``)."""
    code, lines = _generate([str(run_dir), "ok", "bad \udcff"], capsys)
    assert code == 2 and lines == [
        "generate: error: prompt 2 is not UTF-8 text (character 5 is an undecodable byte); give prompts in UTF-8; "
        "see --help"
    ]


def test_a_malformed_run_tokenizer_is_one_line(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = _copy_of_run(run_dir, tmp_path)
    (copy / "tokenizer.json").write_text('{"model": 1')
    code, lines = _generate([str(copy), "x"], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"generate: error: checkpoint {copy / 'checkpoints' / 'step-00000004'}: its run's "
                               "tokenizer.json is not a tokenizer (Exception: "), lines
    assert lines[0].endswith("put back the tokenizer.json the run was trained with")


@pytest.mark.parametrize(
    ("vocab_size", "message"),
    [(1e9, "model.vocab_size=1000000000.0 is not an integer"),
     (10**9, "model.vocab_size=1000000000 is above 16,777,216, more than any Llama-family model has")],
    ids=["float", "huge"],
)
def test_a_crafted_model_shape_in_committed_is_refused_before_any_allocation(
    run_dir: Path, tmp_path: Path, vocab_size: float, message: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A COMMITTED whose model_args ask for a 10^9-row embedding (resealed, as a writer who knows the scheme
    would): bounded as a config.json's shape is, one line, and nothing built."""
    import json

    import meshtrain.evaluate.hf_model as hf_model
    from meshtrain.checkpoint.checksums import MARKER_CHECKSUM, seal_marker

    copy = _copy_of_run(run_dir, tmp_path)
    marker = copy / "checkpoints" / "step-00000004" / "COMMITTED"
    manifest = json.loads(marker.read_text())
    del manifest[MARKER_CHECKSUM]
    manifest["model_args"]["vocab_size"] = vocab_size
    marker.write_text(json.dumps(seal_marker(manifest)))
    monkeypatch.setattr(hf_model, "build_model", lambda *_: pytest.fail("a model was built"))
    code, lines = _generate([str(marker.parent), "x"], capsys)
    assert code == 2 and lines == [f"generate: error: checkpoint {marker.parent}: bad model_args ({message})"]


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (PermissionError("Forbidden"), 2, "generate: error: PermissionError: Forbidden; check the path's permissions, "
                                          "or the storage credentials (environment, instance role or storage options)"),
        (FileNotFoundError(2, "No such file or directory", "/runs/x/tokenizer.json"), 2,
         "generate: error: FileNotFoundError: No such file or directory: /runs/x/tokenizer.json"),
        (RuntimeError("DefaultCPUAllocator: not enough memory"), 1,
         "generate: error: RuntimeError: DefaultCPUAllocator: not enough memory"),
        (ValueError("s3://key:hunter2@bucket/run is odd"), 1,
         "generate: error: ValueError: s3://key:<redacted>@bucket/run is odd"),
    ],
    ids=["forbidden", "missing-file", "allocation", "password-in-message"],
)
def test_any_other_failure_is_one_line(
    run_dir: Path, error: Exception, code: int, message: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exit 2 where the input is what failed (a file, credentials), 1 otherwise; never a traceback."""
    import meshtrain.evaluate.hf_model as hf_model

    def failing(*_args: Any, **_kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(hf_model, "load_checkpoint_model", failing)
    assert _generate([str(run_dir), "x"], capsys) == (code, [message])


def test_a_storage_endpoint_that_refuses_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as probe:  # a loopback port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, lines = _generate(
        ["s3://bucket/run", "x", f"--storage-option=client_kwargs.endpoint_url=http://127.0.0.1:{port}",
         "--storage-option=key=k", "--storage-option=secret=s",
         "--storage-option=config_kwargs.retries.max_attempts=1"],
        capsys,
    )
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("generate: error: EndpointConnectionError: Could not connect to the endpoint URL: "
                               f'"http://127.0.0.1:{port}/bucket/run'), lines
    assert lines[0].endswith("; the storage did not answer: check its endpoint and the network, then run the command "
                             "again")
