"""Replica groups (fault_tolerance.mode=replica) without Ray: two replica groups of one worker each,
each in its own process around the real trainer, under a lighthouse in this process. One is
SIGKILLed mid-run; the other keeps stepping, and a replacement joins by receiving its state from the
survivor's memory. Every step is trained once, on the same samples as one worker would, with the
same losses and weights."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import statistics
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
import torch

from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from meshtrain.data import DataPlan
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    PreemptedRecord,
    Record,
    ReplicaJoinedRecord,
    ReplicaLostRecord,
    ReplicaStragglerRecord,
    TrainRecord,
    read_records,
)

if importlib.util.find_spec("torchft") is None:  # not importorskip: importing it here would set its log level
    pytest.skip("torchft (the ft extra) is not installed", allow_module_level=True)

STEPS, KILL_AT, HEARTBEAT_S = 24, 5, 1.0
COLLECTIVE_TIMEOUT_S = 10.0  # fault_tolerance.timeout_s: a wait it ends was not ended by the heartbeat
STEP_S = 0.25  # each replica's step time, so a replacement starts while the survivor still trains
FROZEN_S = 20.0  # a frozen replica's SIGSTOP lasts this long: its peer trains to the end meanwhile


def config(tmp_path: Path, name: str, *overrides: str) -> MeshtrainConfig:
    return load_config(None, [
        "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=32",
        "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=2", "optim.schedule_steps=30",
        f"train.steps={STEPS}", "eval.interval=null", "checkpoint.enabled=true", "checkpoint.interval=4",
        "checkpoint.mode=sync", f"run.storage_path={tmp_path}", f"run.name={name}", *overrides,
    ])


def replica_config(tmp_path: Path, name: str, *overrides: str) -> MeshtrainConfig:
    return config(tmp_path, name, "scaling.num_workers=2", "parallel.strategy=hybrid_shard", "parallel.shard=1",
                  "fault_tolerance.mode=replica", f"fault_tolerance.heartbeat_timeout_s={HEARTBEAT_S}",
                  f"fault_tolerance.timeout_s={COLLECTIVE_TIMEOUT_S}", "fault_tolerance.join_timeout_s=1", *overrides)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def endpoints(lighthouse: Any) -> tuple[str, str]:
    """A test lighthouse's address and its board's, as a driver ships them to the replica groups."""
    return lighthouse.address, lighthouse.board_on("127.0.0.1")


def replica_process(cfg: MeshtrainConfig, corpus: DataPlan, index: int, lighthouse: tuple[str, str], joining: bool,
                    out: str, die_in_backward_at: int | None = None, die_while_healing: bool = False,
                    started: Any = None, step_s: float = STEP_S, go: Any = None, ready: Any = None,
                    hold_after: int | None = None, slow_from: int | None = None) -> None:
    """One replica group's only worker: the real trainer, each step taking at least ``step_s`` (twice
    that from step ``slow_from`` on).

    ``started`` (a barrier): the groups of a launch take their first step together, as groups started
    at once on a cluster would; on a loaded machine one could otherwise train alone for steps.
    ``go`` (an event): a replacement started ahead (its imports done) builds its trainer once it is set.
    ``ready`` (an event): a replacement sets it once its trainer is built, just before it runs; a survivor
    given ``hold_after`` waits for it after that step (once), so it cannot finish the run alone before a
    replacement that starts slowly on a loaded machine can join.

    ``die_in_backward_at``: SIGKILL in the backward pass of that step (when the first block's gradient
    is being computed); ``die_while_healing``: SIGKILL while the received state is being loaded."""
    import os
    import signal

    from meshtrain.train.healing import HealingState
    import meshtrain.train.trainer as trainer_module
    from meshtrain.distributed.replicas import ReplicaPlacement
    from meshtrain.observe.progress import StepRecorder
    from trainers import cpu_trainer

    torch.set_num_threads(1)
    original = trainer_module.train_step

    held = False

    def paced(*args: Any, **kwargs: Any) -> Any:
        nonlocal held
        if hold_after is not None and not held and trainer.progress.step == hold_after:
            held = True
            ready.wait(timeout=120)
        started = time.perf_counter()
        output = original(*args, **kwargs)
        slow = slow_from is not None and trainer.progress.step + 1 >= slow_from
        time.sleep(max(0.0, step_s * (2 if slow else 1) - (time.perf_counter() - started)))
        return output

    trainer_module.train_step = paced

    recorder = StepRecorder(Path(cfg.run.storage_path) / cfg.run.name / "metrics.jsonl")
    if die_while_healing:
        def load_and_die(self: HealingState, received: dict[str, Any]) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        HealingState.load_state_dict = load_and_die  # type: ignore[method-assign]
    if go is not None:
        go.wait(timeout=120)
    trainer = cpu_trainer(cfg, corpus, recorder.record,
                          replica=ReplicaPlacement(index, 2, lighthouse[0], joining, board=lighthouse[1]))
    if die_in_backward_at is not None:
        def in_backward(*_: Any) -> None:
            if trainer.progress.step + 1 == die_in_backward_at:
                os.kill(os.getpid(), signal.SIGKILL)

        trainer.model.layers["0"].register_full_backward_hook(in_backward)
    if started is not None:
        started.wait(timeout=120)
    if ready is not None and hold_after is None:
        ready.set()
    try:
        trainer.run()
    finally:
        trainer.close()
    torch.save(weights(trainer.model), out)


def assert_close_weights(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Replica mode sums the step's gradients in another order than one worker does (each replica's
    micro-batches, then across replicas; and the steps a lost replica missed on one), so the weights
    differ by fp32 rounding: within 1e-5 of the model's norm after STEPS AdamW steps, and each tensor
    within 3e-5 of its own (measured up to 1.02e-5). A wrong reduction (an average where a sum
    belongs, a replica's share missing) is off by orders of magnitude more."""
    difference = sum(((weights[name] - value).norm() ** 2).item() for name, value in expected.items()) ** 0.5
    norm = sum((value.norm() ** 2).item() for value in expected.values()) ** 0.5
    assert difference / norm <= 1e-5, difference / norm
    for name, value in expected.items():
        drift = ((weights[name] - value).norm() / value.norm()).item()
        assert drift <= 3e-5, (name, drift)


def train_records(run_dir: Path) -> list[TrainRecord]:
    return [r for r in read_records(run_dir / "metrics.jsonl") if isinstance(r, TrainRecord)]


@pytest.fixture(scope="module")
def reference(corpus: DataPlan, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The same steps on one worker in restart mode: the losses and weights replica mode must give."""
    cfg = config(tmp_path_factory.mktemp("reference"), "reference", "scaling.num_workers=1")
    records: list[Record] = []
    trainer = run_one_worker(cfg, corpus, records.append)
    return {r.step: r.loss for r in records if isinstance(r, TrainRecord)}, weights(trainer.model)


@pytest.mark.parametrize("killed, how", [(1, "before"), (0, "before"), (1, "backward"), (1, "healing")],
                         ids=["the-other-replica", "the-replica-writing-the-records", "mid-backward",
                              "and-its-first-replacement-while-healing"])
def test_a_killed_replica_costs_the_survivor_no_restart_and_its_replacement_heals_from_memory(
    corpus: DataPlan, tmp_path: Path, reference: tuple[dict[int, float], dict[str, torch.Tensor]], killed: int,
    how: str,
) -> None:
    from meshtrain.distributed.replicas import LighthouseServer

    expected_losses, expected_weights = reference
    fault = [f"fault.kill_rank={killed}", f"fault.at_step={KILL_AT}"] if how != "backward" else []
    cfg = replica_config(tmp_path, "replicas", *fault)
    run_dir = tmp_path / "replicas"
    lighthouse = LighthouseServer(cfg.fault_tolerance, replicas=2)
    spawn = multiprocessing.get_context("spawn")
    out = {index: str(tmp_path / f"replica{index}.pt") for index in (0, 1)}
    started = spawn.Barrier(2)
    # Two replacements in a row take two process starts (~8 s each here): the survivor steps slower then,
    # so it is still training when the second one is ready to join (a hold would keep the first from
    # its quorum). With one replacement, the survivor trains two steps alone, then waits until the
    # replacement's trainer is built.
    step_s = {index: 3 * STEP_S if how == "healing" and index != killed else STEP_S for index in (0, 1)}
    ready = spawn.Event()
    hold_after = KILL_AT + 1 if how != "healing" else None
    processes = {index: spawn.Process(target=replica_process, args=(
        cfg, corpus, index, endpoints(lighthouse), False, out[index],
        KILL_AT if how == "backward" and index == killed else None, False, started, step_s[index], None,
        ready if index != killed else None, hold_after if index != killed else None))
        for index in (0, 1)}
    try:
        for process in processes.values():
            process.start()
        processes[killed].join(timeout=120)
        assert processes[killed].exitcode == -9, processes[killed].exitcode  # SIGKILL at step KILL_AT
        killed_at = time.time()
        go = spawn.Event()
        replacement = spawn.Process(target=replica_process, args=(cfg, corpus, killed, endpoints(lighthouse), True,
                                                                  out[killed], None, False, None, STEP_S, go, ready))
        replacement.start()
        if how == "healing":  # the first replacement dies loading what it received; a second one joins
            doomed = spawn.Process(target=replica_process, args=(cfg, corpus, killed, endpoints(lighthouse), True,
                                                                 out[killed], None, True))
            doomed.start()
            doomed.join(timeout=120)
            assert doomed.exitcode == -9, doomed.exitcode
        go.set()
        survivor = processes[1 - killed]
        for process in (survivor, replacement):
            process.join(timeout=180)
            assert process.exitcode == 0, process.exitcode
    finally:
        for process in [*processes.values(), *([replacement] if "replacement" in locals() else [])]:
            if process.is_alive():
                process.kill()
        lighthouse.close()

    records = read_records(run_dir / "metrics.jsonl")
    trained = train_records(run_dir)
    # Every step trained and logged once, in order, by the first live group: the killed one before its
    # death when it was writing, the survivor after.
    assert [r.step for r in trained] == list(range(1, STEPS + 1))
    for record in trained:
        assert record.loss == pytest.approx(expected_losses[record.step], rel=1e-4), record.step
    # Each record names the replica groups that trained its step: both, the survivor alone, both again.
    assert trained[0].replicas == trained[-1].replicas == 2 and {r.replicas for r in trained} == {1, 2}
    # The survivor stalled about one heartbeat timeout (the lighthouse dropped the killed group then), not
    # a restart and not the cross-replica collective's timeout (the test's own hold aside).
    times = {r.step: r.time for r in trained}
    gaps = {step: times[step] - times[step - 1] for step in range(2, STEPS + 1) if hold_after is None or step != hold_after + 1}
    assert max(gaps.values()) < COLLECTIVE_TIMEOUT_S, gaps
    lost_records = [r for r in records if isinstance(r, ReplicaLostRecord)]
    lost = [(r.step, r.participants) for r in lost_records]
    assert lost[0] == (KILL_AT, 1)
    assert lost_records[0].quorum_s <= lost_records[0].stall_s < COLLECTIVE_TIMEOUT_S, lost_records[0]
    # The replacement that died while loading its state was in one quorum, when the survivor's quorum
    # counted it before it died (a second loss; that step was trained again), else in none.
    assert len(lost) in ((1, 2) if how == "healing" else (1,)) and all(live == 1 for _, live in lost), lost
    joined = [r for r in records if isinstance(r, ReplicaJoinedRecord)]
    assert len(joined) == 1 and joined[0].replica == killed and joined[0].participants == 2
    # From the survivor's memory: the weights and both AdamW moments (fp32), the step counters and the guard.
    weight_bytes = sum(value.numel() * value.element_size() for value in expected_weights.values())
    assert joined[0].source == 1 - killed and 3 * weight_bytes <= joined[0].bytes <= 3 * weight_bytes + 2**20
    assert KILL_AT <= joined[0].step < STEPS
    assert joined[0].time - killed_at <= 60
    assert not [r for r in records if isinstance(r, CheckpointLoadRecord)]  # no checkpoint was read
    saved = [r.step for r in records if isinstance(r, CheckpointSaveRecord)]
    assert saved == list(range(4, STEPS + 1, 4))  # by one group each
    final = {index: torch.load(out[index]) for index in (0, 1)}
    for name in expected_weights:
        assert torch.equal(final[0][name], final[1][name]), name  # the replicas hold one model
    assert_close_weights(final[0], expected_weights)
    summary = {"joined_after_kill_s": round(joined[0].time - killed_at, 1),
               "longest_gap_s": round(max(gaps.values()), 2), "stall_s": round(lost_records[0].stall_s, 2),
               "quorum_s": round(lost_records[0].quorum_s, 2)}
    print(json.dumps(summary))


def test_a_preempted_replica_hands_over_without_a_save_and_its_replacement_heals(
    corpus: DataPlan, tmp_path: Path, reference: tuple[dict[int, float], dict[str, torch.Tensor]]
) -> None:
    """SIGTERM (a spot notice, or Ray draining a straggler's node) to replica 1 once step KILL_AT is
    logged: at the next step boundary it leaves the quorum without saving, since replica 0 holds the
    same state; replica 0 trains on alone, and a replacement heals from it. Every step is trained once,
    with the one-worker losses and weights."""
    import os
    import signal

    from meshtrain.distributed.replicas import LighthouseServer

    expected_losses, expected_weights = reference
    cfg = replica_config(tmp_path, "preempted")
    run_dir = tmp_path / "preempted"
    lighthouse = LighthouseServer(cfg.fault_tolerance, replicas=2)
    spawn = multiprocessing.get_context("spawn")
    out = {index: str(tmp_path / f"replica{index}.pt") for index in (0, 1)}
    started = spawn.Barrier(2)
    # The survivor steps slower than a process starts, and the replacement is started ahead (as Ray keeps
    # a restarted worker's process ready), so it is still training when the replacement joins.
    processes = [spawn.Process(target=replica_process, args=(cfg, corpus, index, endpoints(lighthouse), False, out[index],
                                                              None, False, started, 3 * STEP_S if index == 0 else STEP_S))
                 for index in (0, 1)]
    go = spawn.Event()
    replacement = spawn.Process(target=replica_process, args=(cfg, corpus, 1, endpoints(lighthouse), True, out[1],
                                                              None, False, None, STEP_S, go))
    try:
        for process in [*processes, replacement]:
            process.start()
        deadline = time.monotonic() + 120
        while not any(isinstance(r, TrainRecord) and r.step >= KILL_AT for r in read_records(run_dir / "metrics.jsonl")):
            assert time.monotonic() < deadline and processes[1].is_alive(), "replica 1 never reached the step"
            time.sleep(0.05)
        os.kill(processes[1].pid, signal.SIGTERM)
        noticed_at = time.time()
        processes[1].join(timeout=60)
        assert processes[1].exitcode == 1, processes[1].exitcode  # Preempted: Ray would restart the group
        # The replacement is released once the survivor trains alone (as Ray's restart takes seconds): had it
        # joined at the very quorum the preempted group left, no step would go on without a group.
        while not any(isinstance(r, ReplicaLostRecord) for r in read_records(run_dir / "metrics.jsonl")):
            assert time.monotonic() < deadline + 60 and processes[0].is_alive(), "replica 0 never went on alone"
            time.sleep(0.05)
        go.set()
        for process in (processes[0], replacement):
            process.join(timeout=180)
            assert process.exitcode == 0, process.exitcode
    finally:
        for process in [*processes, replacement]:
            if process.is_alive():
                process.kill()
        lighthouse.close()

    records = read_records(run_dir / "metrics.jsonl")
    [preempted] = [r for r in records if isinstance(r, PreemptedRecord)]
    assert preempted.reason == "SIGTERM" and preempted.replica_peers_live == 1 and not preempted.saved, preempted
    assert preempted.step >= KILL_AT
    # Only the scheduled saves, by one group each: the leaving group saved nothing of its own.
    assert [r.step for r in records if isinstance(r, CheckpointSaveRecord)] == list(range(4, STEPS + 1, 4))
    assert not [r for r in records if isinstance(r, CheckpointLoadRecord)]
    trained = train_records(run_dir)
    assert [r.step for r in trained] == list(range(1, STEPS + 1))
    for record in trained:
        assert record.loss == pytest.approx(expected_losses[record.step], rel=1e-4), record.step
    lost = [(r.step, r.participants) for r in records if isinstance(r, ReplicaLostRecord)]
    assert lost == [(preempted.step + 1, 1)], lost
    [joined] = [r for r in records if isinstance(r, ReplicaJoinedRecord)]
    assert joined.replica == 1 and joined.source == 0 and joined.time - noticed_at <= 60
    times = [r.time for r in trained]
    assert max(b - a for a, b in zip(times, times[1:])) <= HEARTBEAT_S + 2 + 3 * STEP_S
    final = {index: torch.load(out[index]) for index in (0, 1)}
    for name in expected_weights:
        assert torch.equal(final[0][name], final[1][name]), name
    assert_close_weights(final[0], expected_weights)


@pytest.mark.parametrize("fault", ["hung", "frozen", "slow", "evicted"])
def test_a_hung_or_frozen_replica_costs_its_peer_a_bounded_stall_and_a_slow_one_is_not_declared_hung(
    corpus: DataPlan, tmp_path: Path, reference: tuple[dict[int, float], dict[str, torch.Tensor]], fault: str
) -> None:
    """Inside step KILL_AT, after its quorum, replica 1 hangs (sleeps forever, heartbeating) or freezes
    (SIGSTOP: every thread stops; resumed FROZEN_S later), or from then on takes twice as long per step.
    Replica 0 waits in the step's cross-replica sum only until its deadline (fault_tolerance.hang_factor
    x the median step, at least fault_tolerance.hang_floor_s), then has the lighthouse end the hung group
    (it exits, as Ray would see) or finds the frozen one unreachable (it no longer heartbeats; resumed after
    replica 0 trained to the end, it reads that it was ended and leaves), and trains on alone: its stall stays within the issue's bound, every step is
    trained once with the one-worker losses, the record names the cause and goodput counts the stall as
    lost to it. The slow group is waited for at every step and never declared hung; it is reported as a
    straggler group; with scaling.evict_stragglers (``evicted``) its peer ends it once reported (it exits,
    for Ray to replace) and the record names the cause ``slow``."""
    from meshtrain.observe.goodput import goodput_of

    expected_losses, expected_weights = reference
    slow = fault in ("slow", "evicted")
    floor_s = 1.5 if slow else 3.0  # small enough that a wrong bound would declare the slow group
    # The slow group also computes 2x slower (fault.kind=slow, inside its blocks, where the straggler timer sees it).
    injected = {"hung": ["fault.kind=hang"], "frozen": ["fault.kind=freeze", f"fault.freeze_s={FROZEN_S}"],
                "slow": ["fault.kind=slow", "fault.slow_factor=2"],
                "evicted": ["fault.kind=slow", "fault.slow_factor=2", "scaling.evict_stragglers=true"]}
    at = ["fault.kill_rank=1", f"fault.at_step={KILL_AT}", *injected[fault]]
    cfg = replica_config(tmp_path, fault, *at, f"fault_tolerance.hang_floor_s={floor_s}", "run.hang_timeout_s=120")
    run_dir = tmp_path / fault
    started = time.time()
    step_s = 2 * STEP_S if slow else STEP_S
    # The hung and the evicted groups exit on the kill order; the frozen one, once it resumes, finds that its
    # peers ended it and none of them is live (it trained to the end), and leaves rather than train their steps again.
    run_replicas(cfg, corpus, tmp_path, exitcodes=(0, 0 if fault == "slow" else 1), step_s=step_s,
                 slow_from={1: KILL_AT} if slow else {})
    ended = time.time()

    records = read_records(run_dir / "metrics.jsonl")
    trained = train_records(run_dir)
    assert [r.step for r in trained] == list(range(1, STEPS + 1))
    for record in trained:
        assert record.loss == pytest.approx(expected_losses[record.step], rel=1e-4), record.step
    lost = [r for r in records if isinstance(r, ReplicaLostRecord)]
    report = goodput_of(records, started, ended)
    # Every second of the launch is productive or lost to one cause (each cause is rounded to the millisecond).
    assert report["productive_s"] + sum(report["lost_s"].values()) == pytest.approx(report["wall_s"], abs=0.01)
    stragglers = [r for r in records if isinstance(r, ReplicaStragglerRecord)]
    if fault == "slow":
        assert not lost and {r.replicas for r in trained} == {2}, lost
        # Reported once, after metrics.straggler_patience logged steps at 2x; the peers go on waiting for it.
        # (On a loaded machine one logged step may end an episode and a later one start another.)
        assert {r.replica for r in stragglers} == {1} and stragglers[0].logged_steps == 5, stragglers
        # Its earliest is step KILL_AT + 4; on a loaded machine a noisy logged step restarts the count.
        assert stragglers[0].slowdown >= 1.5 and stragglers[0].step < STEPS, stragglers
        assert_close_weights(torch.load(tmp_path / "replica0.pt"), expected_weights)
        return
    [lost_record] = lost
    cause = "slow" if fault == "evicted" else fault
    if fault == "evicted":  # reported once and ended after that step: the next one goes on without it
        assert [(r.replica, r.replaced) for r in stragglers] == [(1, True)], stragglers
        assert lost_record.step == stragglers[0].step + 1 and lost_record.participants == 1, (lost_record, stragglers)
    else:
        assert lost_record.step == KILL_AT and lost_record.participants == 1, lost_record
    assert lost_record.cause == cause and lost_record.groups == [1], lost_record
    median_step_s = statistics.median(r.step_time_s for r in trained if r.step < KILL_AT)
    assert lost_record.stall_s <= max(10.0, 3 * median_step_s) + HEARTBEAT_S, (lost_record, median_step_s)
    assert report["lost_s"][f"replica_{cause}"] >= 0.95 * lost_record.stall_s, report
    assert {r.replicas for r in trained if lost_record.step <= r.step <= lost_record.step + 2} == {1}
    assert_close_weights(torch.load(tmp_path / "replica0.pt"), expected_weights)
    print(json.dumps({"fault": fault, "stall_s": round(lost_record.stall_s, 2), "quorum_s": round(lost_record.quorum_s, 2),
                      "lost_s": report["lost_s"][f"replica_{cause}"]}))


def run_replicas(cfg: MeshtrainConfig, corpus: DataPlan, tmp_path: Path, exitcodes: tuple[int, int] = (0, 0),
                 step_s: float = STEP_S, slow_from: dict[int, int] | None = None) -> None:
    """Two replica groups of one worker from the first step, each saving its final weights to
    ``tmp_path / replica{index}.pt``; they must end with ``exitcodes``. ``slow_from``: a group's steps
    take twice ``step_s`` from that step on."""
    from meshtrain.distributed.replicas import LighthouseServer

    lighthouse = LighthouseServer(cfg.fault_tolerance, replicas=2)
    spawn = multiprocessing.get_context("spawn")
    started = spawn.Barrier(2)
    processes = [spawn.Process(target=replica_process, args=(
        cfg, corpus, index, endpoints(lighthouse), False, str(tmp_path / f"replica{index}.pt"), None, False, started,
        step_s, None, None, None, (slow_from or {}).get(index))) for index in (0, 1)]
    try:
        for process in processes:
            process.start()
        for process, exitcode in zip(processes, exitcodes):
            process.join(timeout=180)
            assert process.exitcode == exitcode, process.exitcode
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        lighthouse.close()


def run_one_worker(cfg: MeshtrainConfig, corpus: DataPlan, on_record: Callable[[Any], None] | None = None) -> Any:
    """The trainer of one worker in restart mode, run to its end; records go to the run's metrics.jsonl
    unless ``on_record`` is given."""
    from meshtrain.observe.progress import StepRecorder
    from trainers import cpu_trainer

    if on_record is None:
        on_record = StepRecorder(Path(cfg.run.storage_path) / cfg.run.name / "metrics.jsonl").record
    trainer = cpu_trainer(cfg, corpus, on_record)
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer


@pytest.mark.parametrize("first", ["replica", "restart"])
def test_a_checkpoint_of_either_mode_resumes_in_the_other_with_the_unbroken_losses(
    corpus: DataPlan, tmp_path: Path, reference: tuple[dict[int, float], dict[str, torch.Tensor]], first: str
) -> None:
    """Half the steps in one mode, the rest resumed from its step-12 checkpoint in the other: every
    replica group of a replica-mode start loads it (none replaces a lost one), one worker loads a
    replica group's."""
    expected_losses, _ = reference
    half = f"train.steps={STEPS // 2}"
    one_worker = lambda *o: config(tmp_path, "switched", "scaling.num_workers=1", *o)  # noqa: E731
    replicas = lambda *o: replica_config(tmp_path, "switched", *o)  # noqa: E731
    if first == "replica":
        run_replicas(replicas(half), corpus, tmp_path)
        run_one_worker(one_worker(), corpus)
    else:
        run_one_worker(one_worker(half), corpus)
        run_replicas(replicas(), corpus, tmp_path)
    records = read_records(tmp_path / "switched" / "metrics.jsonl")
    loaded_by = 1 if first == "replica" else 2  # each replica group of a start reads it
    assert [r.step for r in records if isinstance(r, CheckpointLoadRecord)] == [STEPS // 2] * loaded_by
    trained = [r for r in records if isinstance(r, TrainRecord)]
    assert [r.step for r in trained] == list(range(1, STEPS + 1))
    for record in trained:
        assert record.loss == pytest.approx(expected_losses[record.step], rel=1e-4), record.step


class _Planted:
    """An object whose unpickling would create ``path``: what a hostile peer's healing bytes could hold."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.touch, (self.path,))


def test_the_healing_transport_loads_a_peers_state_as_weights_only(tmp_path: Path) -> None:
    """A joining worker reads tensors and plain values from its peer, never an object that runs code when
    unpickled (torchft's own transport unpickles whatever it receives)."""
    from datetime import timedelta

    from meshtrain.distributed.replicas import _transport

    timeout = timedelta(seconds=10)
    sender, receiver = _transport("127.0.0.1", timeout), _transport("127.0.0.1", timeout)
    try:
        state = {"user": {"default": {"train": {"w": torch.arange(6.0).reshape(2, 3), "step": 7}, "lr": [1e-3]}},
                 "torchft": {"step": 7, "batches_committed": 7}}
        sender.send_checkpoint(dst_ranks=[1], step=7, state_dict=state, timeout=timeout)
        received = receiver.recv_checkpoint(src_rank=0, metadata=sender.metadata(), step=7, timeout=timeout)
        assert torch.equal(received["user"]["default"]["train"]["w"], state["user"]["default"]["train"]["w"])
        assert received["torchft"] == {"step": 7, "batches_committed": 7}
        planted = tmp_path / "planted"
        sender.send_checkpoint(dst_ranks=[1], step=8, state_dict={"user": _Planted(planted)}, timeout=timeout)
        with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
            receiver.recv_checkpoint(src_rank=0, metadata=sender.metadata(), step=8, timeout=timeout)
        assert not planted.exists()
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_changed_quorum_destroys_the_old_process_group_on_its_own_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo's destructor waits for a collective that a frozen peer never joined (until it resumes): the
    old group of a changed quorum must die on the thread that lets it go, never on torchft's quorum
    thread, however soon its abort returns (through Ray, the quorum thread once kept the last reference
    and the survivor waited out a 30 s freeze)."""
    import threading
    from datetime import timedelta

    from torchft.process_group import ProcessGroupGloo

    from meshtrain.distributed.replicas import _process_group

    destroyed_on: list[str] = []

    class OldGroup:
        def abort(self) -> None:
            pass

        def __del__(self) -> None:
            destroyed_on.append(threading.current_thread().name)

    monkeypatch.setattr(ProcessGroupGloo, "reconfigure", lambda self, opts: "reconfigured")
    group = _process_group(torch.device("cpu"), timedelta(seconds=5), "127.0.0.1")
    for _ in range(20):
        group._pg = OldGroup()
        assert group.reconfigure(None) == "reconfigured"
        for thread in threading.enumerate():
            if thread.name == "meshtrain-old-replica-group":
                thread.join(timeout=5)
    assert destroyed_on == ["meshtrain-old-replica-group"] * 20


def test_a_joining_group_takes_its_peers_step_pace_with_its_state() -> None:
    """A group that heals has measured no step of its own: it takes the peer's recent step durations with
    the rest of its state (through the weights-only transport), so from its first step it gives a
    frozen or hung peer the same deadline (through Ray, a group that joined at step 5 had none, and
    waited for its frozen peer until that peer resumed)."""
    from datetime import timedelta
    from types import SimpleNamespace

    from meshtrain.distributed.replicas import _transport
    from meshtrain.train.healing import _GUARD_TENSORS, HealingState
    from meshtrain.train.replica_pace import StepPace

    class Weights:
        def __init__(self, value: float) -> None:
            self.w = torch.full((2,), value)

        def state_dict(self) -> dict[str, Any]:
            return {"w": self.w}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.w = state["w"]

    def guard() -> Any:
        return SimpleNamespace(skipped_before=0, **{name: torch.zeros(1) for name in _GUARD_TENSORS})

    peer_pace, own_pace = StepPace(2.5, 1.0), StepPace(2.5, 1.0)
    for seconds in (0.5, 0.75, 1.0, 2.0):
        peer_pace.committed(seconds)
    peer = HealingState(Weights(1.0), guard(), peer_pace)  # type: ignore[arg-type]
    joining = HealingState(Weights(0.0), guard(), own_pace)  # type: ignore[arg-type]
    assert own_pace.bound_s() is None
    timeout = timedelta(seconds=10)
    sender, receiver = _transport("127.0.0.1", timeout), _transport("127.0.0.1", timeout)
    try:
        sender.send_checkpoint(dst_ranks=[1], step=4, state_dict=peer.state_dict(), timeout=timeout)
        joining.load_state_dict(receiver.recv_checkpoint(src_rank=0, metadata=sender.metadata(), step=4, timeout=timeout))
    finally:
        sender.shutdown()
        receiver.shutdown()
    assert torch.equal(joining.state.w, torch.ones(2))
    assert own_pace.recent() == [0.5, 0.75, 1.0, 2.0] and own_pace.bound_s() == peer_pace.bound_s() == 2.5 * 0.875


def test_a_slow_group_is_ended_once_by_the_first_of_the_others_and_never_below_min_replicas() -> None:
    """scaling.evict_stragglers in replica mode, on the run's board (a real TCPStore): three groups post
    their compute; group 2 stays 3x slower. Only group 0 (the first of the others) reports it, and ends it
    once (a second report, after a replacement that is as slow, only reports); group 1 reports nothing.
    With min_replicas=3, ending one of three would go below it: reported, not ended."""
    import torch.distributed as dist

    from meshtrain.distributed.replicas import GroupCompute, ReplicaPlacement
    from meshtrain.train.replica_stragglers import ReplicaEviction, ReplicaStragglers
    from meshtrain.train.stragglers import Streaks

    board = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    posted = {0: GroupCompute(1.0, "a"), 1: GroupCompute(1.1, "b"), 2: GroupCompute(3.0, "c")}
    ended: list[tuple[int, int, int]] = []

    class Peers:  # the board part of ReplicaPeers: once per group index, as end_slow_peer keeps it
        def __init__(self, index: int) -> None:
            self.placement = ReplicaPlacement(index, 3, "http://unused")

        def compare_compute(self, seconds: float, node: str) -> dict[int, GroupCompute]:
            return dict(posted)

        def end_slow_peer(self, group: int, step: int) -> bool:
            if board.add(f"evicted/{group}", 1) > 1:
                return False
            ended.append((self.placement.index, group, step))
            return True

    class Outputs:
        def __init__(self) -> None:
            self.records: list[ReplicaStragglerRecord] = []

        def emit(self, record: ReplicaStragglerRecord, *, any_replica: bool = False) -> None:
            assert any_replica
            self.records.append(record)

    def group(index: int, min_replicas: int) -> tuple[ReplicaStragglers, Outputs]:
        peers, outputs = Peers(index), Outputs()
        evict = ReplicaEviction(lambda slow, step: peers.end_slow_peer(slow, step), min_replicas)
        return ReplicaStragglers(peers, 1.5, 2, outputs, evict), outputs  # type: ignore[arg-type]

    (first, first_out), (second, second_out) = group(0, 1), group(1, 1)
    for step in (10, 20, 30):
        first(step, 1.0, "a")
        second(step, 1.1, "b")
    assert [(r.step, r.replica, r.replaced, r.node) for r in first_out.records] == [(20, 2, True, "c")]
    assert second_out.records == [] and ended == [(0, 2, 20)]
    # A replacement that is as slow: reported again after it recovered once, never ended a second time.
    first.streaks = Streaks(1.5, 2)
    for step in (40, 50):
        first(step, 1.0, "a")
    assert [(r.step, r.replaced) for r in first_out.records] == [(20, True), (50, False)] and len(ended) == 1
    # Ending one of three groups with min_replicas=3 would stall the run: reported only.
    board.delete_key("evicted/2")
    guarded, guarded_out = group(0, 3)
    for step in (10, 20):
        guarded(step, 1.0, "a")
    assert [(r.replica, r.replaced) for r in guarded_out.records] == [(2, False)] and len(ended) == 1


def test_every_worker_of_a_group_its_peers_ended_reads_it_when_alone() -> None:
    """A frozen group its peers ended reads so from the board when it resumes; a group of several
    workers leaves together: its other workers read the board too, but only when the quorum holds their
    group alone (at no other quorum: one connection per group in a step, not one per worker), and only
    the first worker clears the mark once the group healed."""
    from datetime import timedelta

    import torch.distributed as dist

    from meshtrain.distributed.replicas import ReplicaPeers, ReplicaPlacement

    board = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    placement = ReplicaPlacement(1, 2, "http://unused", board=f"127.0.0.1:{board.port}")

    def worker(first: bool) -> ReplicaPeers:
        peers = ReplicaPeers.__new__(ReplicaPeers)  # the board part alone: no torchft manager
        peers.placement, peers._closed, peers._board_timeout = placement, False, timedelta(seconds=5)
        peers._board_reader = None
        peers._board = peers._open_board() if first else None
        return peers

    first, other = worker(True), worker(False)
    board.set("ended/1", "7")
    assert other.was_ended(healed=False, alone=False) is None and other._board_reader is None
    assert (first.was_ended(healed=False, alone=True), other.was_ended(healed=False, alone=True)) == (7, 7)
    assert other.was_ended(healed=True, alone=False) is None and board.check(["ended/1"])  # only the first clears
    assert first.was_ended(healed=True, alone=False) is None and not board.check(["ended/1"])
