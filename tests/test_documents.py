"""Document-masked attention: a document's logits do not depend on what was packed before it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtrain.model.documents import document_ids, document_positions, find_documents
from test_model import initialized_model, tiny_args

EOS = 0


def test_positions_restart_at_each_end_of_document_token_which_opens_the_next_document() -> None:
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 0, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert document_positions(tokens, EOS).tolist() == [[0, 1, 0, 1, 2, 3, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8]]
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 1, 1, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1, 1]]
    mask = find_documents(tokens, EOS, "sdpa").mask[0, 0] == 0
    # Token 4 (second document) sees tokens 2..4 only; the window's start is a document of its own.
    assert mask[4].tolist() == [False, False, True, True, True, False, False, False, False]
    assert mask[1].tolist() == [True, True] + [False] * 7


def documents(generator: torch.Generator, lengths: list[int], vocab: int) -> list[torch.Tensor]:
    """Documents as the stream holds them between two separators: [EOS, body...]."""
    return [torch.cat([torch.tensor([EOS]), torch.randint(1, vocab, (n - 1,), generator=generator)]) for n in lengths]


def packed_and_alone(model: torch.nn.Module, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one document inside a packed window, and of that document alone at a window's start."""
    generator = torch.Generator().manual_seed(seed)
    before, doc, after = documents(generator, [13, 21, 11], model.args.vocab_size)
    filler = torch.randint(1, model.args.vocab_size, (seq,), generator=generator)
    packed = torch.cat([before, doc, after, filler])[:seq]
    alone = torch.cat([doc, after, filler])[:seq]
    with torch.no_grad():
        inside = model(torch.stack([packed, alone]))[0, len(before) : len(before) + len(doc)]
        first = model(alone[None])[0, : len(doc)]
    return inside, first


def test_a_packed_document_has_the_logits_it_has_alone() -> None:
    model = initialized_model(tiny_args(), document_eos=EOS)
    inside, alone = packed_and_alone(model, seq=48)
    torch.testing.assert_close(inside, alone, rtol=0, atol=1e-5)
    # Without the mask the same document reads its predecessor: the property is the mask's doing.
    inside, alone = packed_and_alone(initialized_model(tiny_args()), seq=48)
    assert (inside - alone).abs().max() > 1e-3


def test_the_mask_changes_nothing_in_a_window_of_one_document() -> None:
    model = initialized_model(tiny_args())
    tokens = torch.randint(1, 97, (2, 32), generator=torch.Generator().manual_seed(3))
    tokens[1, 0] = EOS  # a window may open with the end-of-document token: still one document
    with torch.no_grad():
        plain = model(tokens)
        explicit = model(tokens, find_documents(tokens, EOS, "sdpa"))  # the mask itself, not the causal shortcut
        masked = initialized_model(tiny_args(), document_eos=EOS)(tokens)
    torch.testing.assert_close(explicit, plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(masked, plain, rtol=0, atol=1e-5)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_masked_gradients_are_those_of_each_document_trained_alone(recompute: str) -> None:
    """The loss of a packed window is the sum of its documents' losses, each as if trained alone."""
    generator = torch.Generator().manual_seed(1)
    docs = documents(generator, [9, 15, 8], 97)
    packed = torch.cat(docs)
    model = initialized_model(tiny_args(), document_eos=EOS, recompute=recompute)
    logits = model(packed[None, :-1])[0]
    F.cross_entropy(logits, packed[1:], reduction="sum").backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    start = 0
    for doc in docs:
        # Each document predicts its body and the token after it (the next separator or, last, nothing).
        end = min(start + len(doc), len(packed) - 1)
        inputs, targets = packed[start:end], packed[start + 1 : end + 1]
        F.cross_entropy(model(inputs[None])[0], targets, reduction="sum").backward()
        start += len(doc)
    for alone, together in zip([p.grad for p in model.parameters()], packed_grads):
        torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-6)


def _packed_and_alone_on_a_mesh(rank: int, world: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    from meshtrain.config.loading import load_config
    from meshtrain.distributed.layout import WorkerLayout
    from trainers import sharded_model

    cfg = load_config(None, ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                             "model.ffn_dim=160", "model.max_seq_len=64", "data.seq_len=48", f"scaling.num_workers={world}",
                             f"parallel.shard={shard}", "train.global_batch_size=8", "train.micro_batch_size=2"])
    model, layout = sharded_model(cfg, 97, WorkerLayout(rank, world, rank % shard, shard, rank // shard),
                                        torch.device("cpu"), document_eos=EOS)
    assert layout.plan.shape == (world // shard, shard)
    return packed_and_alone(model, seq=48)


def test_a_packed_document_has_the_logits_it_has_alone_on_a_2x2_mesh() -> None:
    from ranks import run_on_ranks

    for inside, alone in run_on_ranks(_packed_and_alone_on_a_mesh, 4, 2):
        torch.testing.assert_close(inside, alone, rtol=0, atol=1e-5)


def test_the_gpu_kernel_flex_attention_with_a_block_mask_gives_the_cpu_kernels_logits() -> None:
    """The GPU path (a compiled BlockMask and flex attention) checked on CPU, where torch 2.13 runs flex
    attention compiled in forward only: same logits as SDPA with the explicit mask."""
    model = initialized_model(tiny_args())
    generator = torch.Generator().manual_seed(0)
    tokens = torch.stack([torch.cat(documents(generator, lengths, 97))[:64] for lengths in ([13, 21, 11, 19], [40, 30])])
    with torch.no_grad():
        flex = model(tokens, find_documents(tokens, EOS, "flex"))
        sdpa = model(tokens, find_documents(tokens, EOS, "sdpa"))
        causal = model(tokens)
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)
    assert (flex - causal).abs().max() > 1e-3


def test_flex_attention_inside_compiled_blocks_gives_the_same_logits() -> None:
    """parallel.compile compiles each block with fullgraph=True: flex attention must compile inside it."""
    model = initialized_model(tiny_args())
    generator = torch.Generator().manual_seed(2)
    tokens = torch.cat(documents(generator, [20, 25, 19], 97))[:64][None]
    with torch.no_grad():
        sdpa = model(tokens, find_documents(tokens, EOS, "sdpa"))
        for block in model.layers.values():
            block.compile(fullgraph=True)
        flex = model(tokens, find_documents(tokens, EOS, "flex"))
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)


def test_training_steps_count_the_query_key_pairs_their_mask_allows() -> None:
    """MFU's attention FLOPs, counted from the tokens outside the model: each query attends its position
    within its document + 1 keys, exactly the pairs the document mask allows; without the mask, the
    causal triangle."""
    from meshtrain.model.flops import AttentionWork

    work = AttentionWork()
    generator = torch.Generator().manual_seed(4)
    tokens = torch.stack([torch.cat(documents(generator, lengths, 97))[:40] for lengths in ([7, 20, 13], [25, 15])])
    allowed = int((find_documents(tokens, EOS, "sdpa").mask == 0).sum())
    work.count_tokens(tokens, EOS, None)
    keys_per_query, window = work.take()
    assert (keys_per_query, window) == (allowed / tokens.numel(), 40)
    assert allowed == sum(n * (n + 1) // 2 for n in (7, 20, 13, 25, 15))
    assert work.take() is None  # taking starts afresh
    work.count_tokens(tokens, None, None)  # no document mask: causal over the window
    assert work.take() == (41 / 2, 40)


def test_logged_steps_report_mfu_from_the_flops_computed_and_over_the_whole_window() -> None:
    from meshtrain.checkpoint.state import Progress
    from meshtrain.model.flops import ModelFlops, flops_per_token
    from meshtrain.observe.metrics import TrainingMetrics
    from meshtrain.train.guard import BadStepLimit, SpikeRules, StepGuard
    from meshtrain.train.records import LoopOutputs
    from meshtrain.train.step import StepOutput
    from meshtrain.train.loop import StepDone
    from meshtrain.train.step_log import StepLog

    from meshtrain.model.flops import AttentionWork

    args = tiny_args()
    model = initialized_model(args, document_eos=EOS)
    work = AttentionWork()
    generator = torch.Generator().manual_seed(5)
    tokens = torch.stack([torch.cat(documents(generator, [10, 22, 16], 97))[:48] for _ in range(2)])
    peak = 1e9
    metrics = TrainingMetrics(run="r", rank=0, node="n", device=torch.device("cpu"),
                              flops_per_token=flops_per_token(args, 48), peak_flops_per_s=peak)
    outputs = LoopOutputs(None, metrics, None)
    progress, records = Progress(), []
    guard = StepGuard(torch.optim.SGD(model.parameters(), lr=0.0), torch.device("cpu"), SpikeRules(window=4))
    log = StepLog(2, 1, progress, BadStepLimit(guard, 3, progress, outputs), outputs, records, (work, args))
    log.at_start()
    model(tokens).sum().backward()
    work.count_tokens(tokens, model.document_eos, model.context_parallel)  # as train_step does
    log.after_step(StepDone(1, last=True, logged=True, lr=0.1, output=StepOutput(torch.tensor(1.0), torch.tensor(1.0),
                                                                                  tokens.numel()), data_wait_s=0.0))

    record = records[-1]
    pairs = 2 * sum(n * (n + 1) // 2 for n in (10, 22, 16))
    assert record.flops_per_token == ModelFlops.of(args).per_token(pairs / tokens.numel())
    assert record.flops_per_token_full_attention == flops_per_token(args, 48) > record.flops_per_token

    def gauge(name: str) -> float:
        return metrics.registry.get_sample_value(name, {"run": "r", "replica": "0", "rank": "0", "node": "n"})

    assert gauge("meshtrain_mfu_ratio") == pytest.approx(record.tokens_per_s * record.flops_per_token / peak)
    assert gauge("meshtrain_mfu_full_attention_ratio") == pytest.approx(
        record.tokens_per_s * record.flops_per_token_full_attention / peak)
