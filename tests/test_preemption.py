"""Preemption notices: SIGTERM (or Ray's drain notice) makes every rank save the current step and
leave, the resumed run matches an unbroken one, and a save that does not commit in time ends the
worker anyway. The Ray end to end case (SIGTERM to one of two workers) is in test_recovery.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from meshtrain.checkpoint.storage import CheckpointStorage, checkpoint_root
from meshtrain.config.loading import load_config
from meshtrain.data import DataPlan
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    InterruptedRecord,
    PreemptedRecord,
    Record,
    ResizeSaveRecord,
    StopRequest,
    WarningRecord,
)
from meshtrain.train.preemption import Preempted, PreemptionNotice, defer_sigterm
from meshtrain.train.faults import FaultInjection
from meshtrain.train.loop import StepStart
from trainers import cpu_trainer
from test_step_guard import run, snapshot


def config(tmp_path: Path, name: str, *overrides: str):
    return load_config(None, [
        "train.log_every=1", "train.global_batch_size=8", "train.micro_batch_size=4", "data.seq_len=32",
        "data.vocab_size=512", "data.max_documents=24", "optim.warmup_steps=2", "optim.schedule_steps=20",
        "scaling.num_workers=1", "checkpoint.enabled=true", "checkpoint.interval=100", "checkpoint.mode=async",
        "eval.interval=null", f"run.storage_path={tmp_path}", f"run.name={name}", *overrides,
    ])


def test_sigterm_saves_the_step_and_the_resumed_run_matches_an_unbroken_one(
    corpus: DataPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    unbroken, _ = run(config(tmp_path, "unbroken", "train.steps=8"), corpus)

    original = FaultInjection.before_step

    def sigterm_at_step_5(self, start: StepStart) -> None:
        if start.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # after step 5 cast its vote: the ranks agree at step 6
        original(self, start)

    monkeypatch.setattr(FaultInjection, "before_step", sigterm_at_step_5)
    cfg = config(tmp_path, "preempted", "train.steps=8")
    with pytest.raises(Preempted, match=r"^rank 0: stopped at step 6 on a preemption notice \(SIGTERM\); "
                       r"checkpoint of step 6 committed$"):
        run(cfg, corpus)
    assert [c.step for c in CheckpointStorage(checkpoint_root(cfg.checkpoint, cfg.run)).committed()] == [6]

    monkeypatch.setattr(FaultInjection, "before_step", original)
    resumed, events = run(cfg, corpus)
    assert [e.step for e in events if isinstance(e, CheckpointLoadRecord)] == [6]
    expected, got = snapshot(unbroken), snapshot(resumed)
    assert expected.keys() == got.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_the_drivers_stop_request_saves_the_step_and_finishes_without_a_restart(
    corpus: DataPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C on the driver: the ranks save at the next step boundary and return normally (no
    Preempted, so Ray would not restart them); a request of another launch is ignored."""
    unbroken, _ = run(config(tmp_path, "whole", "train.steps=8"), corpus)
    cfg = config(tmp_path, "interrupted", "train.steps=8")
    request = StopRequest(str(tmp_path / "stop_request.json"), "launch-2")
    StopRequest(request.path, "launch-1").write("SIGINT to the driver")  # an earlier launch's: ignored
    original = FaultInjection.before_step

    def interrupt_at_step_3(self, start: StepStart) -> None:
        if start.step == 3:
            request.write("SIGINT to the driver")
            time.sleep(1.2)  # the watch (every 0.5 s) sees it before step 4 casts its vote
        original(self, start)

    monkeypatch.setattr(FaultInjection, "before_step", interrupt_at_step_3)
    events: list[Record] = []
    trainer = cpu_trainer(cfg, corpus, events.append, stop_request=request)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    assert result.interrupted == {"step": 4, "saved": True, "reason": "SIGINT to the driver"}
    assert [e for e in events if isinstance(e, InterruptedRecord)] == [InterruptedRecord(**result.interrupted)]
    assert [c.step for c in CheckpointStorage(checkpoint_root(cfg.checkpoint, cfg.run)).committed()] == [4]

    monkeypatch.setattr(FaultInjection, "before_step", original)
    request.clear()
    resumed, events = run(cfg, corpus)
    assert [e.step for e in events if isinstance(e, CheckpointLoadRecord)] == [4]
    expected, got = snapshot(unbroken), snapshot(resumed)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_the_sigterm_route_is_restored_after_the_run(corpus: DataPlan, tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    run(config(tmp_path, "restored", "train.steps=2"), corpus)
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_save_that_misses_the_budget_ends_the_worker_and_one_in_time_does_not() -> None:
    exits: list[str] = []
    late = PreemptionNotice(0.2, rank=3, exit_process=exits.append)
    late.give("SIGTERM")
    time.sleep(0.5)
    assert exits == ["[meshtrain] rank 3: no committed checkpoint 0.2s after the preemption notice (SIGTERM); exiting "
                     "(run.preemption_save_s); the run resumes from its last committed checkpoint"]
    in_time = PreemptionNotice(0.3, rank=0, exit_process=exits.append)
    in_time.give("SIGTERM")
    in_time.give("another SIGTERM")  # a second notice changes nothing
    in_time.done()
    time.sleep(0.5)
    assert len(exits) == 1 and in_time.reason == "SIGTERM"


def test_in_a_ray_worker_thread_rays_sigterm_exit_becomes_a_notice() -> None:
    """Ray's worker handles SIGTERM in its main thread by calling an exit function of
    ray._private.worker; a training thread cannot install a handler, so it replaces that function."""
    import ray._private.worker as ray_worker

    notice = PreemptionNotice(60.0, rank=1)
    undo: list = []
    thread = threading.Thread(target=lambda: undo.append(defer_sigterm(notice)))
    thread.start()
    thread.join()
    try:
        ray_worker.raise_sys_exit_with_custom_error_message("The process receives a SIGTERM.", exit_code=1)
        assert notice.given and notice.reason == "SIGTERM"
        with pytest.raises(SystemExit):  # any other exit Ray asks for still happens
            ray_worker.raise_sys_exit_with_custom_error_message("exit_actor() is called.")
    finally:
        notice.done()
        undo[0]()
    assert ray_worker.raise_sys_exit_with_custom_error_message.__module__ != __name__


def test_a_budget_shorter_than_a_step_is_reported_once(corpus: DataPlan, tmp_path: Path) -> None:
    _, events = run(config(tmp_path, "tight", "train.steps=4", "run.preemption_save_s=0.000001"), corpus)
    warnings = [e for e in events if isinstance(e, WarningRecord)]
    assert len(warnings) == 1 and warnings[0].setting == "run.preemption_save_s"
    assert warnings[0].message.startswith("run.preemption_save_s=1e-06 is shorter than one step (")
    _, quiet = run(config(tmp_path, "roomy", "train.steps=4"), corpus)
    assert not [e for e in quiet if isinstance(e, WarningRecord)]


def test_rays_notices_are_a_preemption_and_the_elastic_policys_requests_a_resize_answered_after_the_save(monkeypatch) -> None:
    """What Ray Train's PreemptionWatcher leaves in a worker's context (read every step without a call
    through Ray) is a preemption; the elastic policy's request arrives on its own channel (never in Ray's
    mark, which Ray's controller would take for a preemption) and is answered, per token, once saved."""
    import meshtrain.train.preemption as preemption
    from ray.train.v2.api.preemption import PreemptionInfo

    context = type("Context", (), {})()
    context.preemption_context = type("PreemptionContext", (), {"preemption_info": None})()
    monkeypatch.setattr(preemption, "_ray_context", lambda: context)
    monkeypatch.setattr(preemption, "_RESIZE", preemption._ResizeRequest())
    notice = PreemptionNotice(60.0, rank=0)
    assert notice.local() == preemption.NO_NOTICE and preemption.resize_answer("a") is None
    preemption.request_resize("a")
    assert notice.local() == preemption.RESIZE and not notice.given
    assert context.preemption_context.preemption_info is None  # nothing Ray's controller polls
    assert preemption.resize_answer("a") is None  # not saved yet
    notice.answer_resize(12, True)
    assert notice.local() == preemption.NO_NOTICE
    assert preemption.resize_answer("a") == (12, True) and preemption.resize_answer("b") is None
    preemption.request_resize("b")  # a later request forgets the earlier answer
    assert preemption.resize_answer("b") is None and preemption.resize_answer("a") is None
    context.preemption_context.preemption_info = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"ab12": [2, 3]})
    assert notice.local() == preemption.PREEMPT and notice.reason == "Ray drains node(s) ab12"
    notice.done()


def test_a_drain_notice_during_the_resize_wait_leaves_at_once_from_the_saved_step(monkeypatch) -> None:
    """A drained node reaches the ranks twice: the elastic policy's resize request (save, then wait for
    Ray to resize) and Ray's own drain notice. The notice that lands during the wait ends it: the step is
    already saved, so the rank leaves now instead of sleeping out the wait and training on."""
    import meshtrain.train.preemption as preemption
    from meshtrain.train.preemption import NoticeHandling
    from ray.train.v2.api.preemption import PreemptionInfo

    context = type("Context", (), {})()
    context.preemption_context = type("PreemptionContext", (), {"preemption_info": None})()
    monkeypatch.setattr(preemption, "_ray_context", lambda: context)
    monkeypatch.setattr(preemption, "_RESIZE", preemption._ResizeRequest())
    preemption.request_resize("grow")
    notice = PreemptionNotice(60.0, rank=0)
    vote = type("Vote", (), {"result": lambda self: notice.local()})()
    saves: list[int] = []
    checkpointing = type("Checkpointing", (), {"save_now": lambda self, step: saves.append(step) or True})()
    records: list[Record] = []
    outputs = type("Outputs", (), {"emit": lambda self, record: records.append(record)})()
    beats: list[str] = []

    def drained_while_waiting(message: str) -> None:
        beats.append(message)
        if len(beats) == 2:
            context.preemption_context.preemption_info = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"ab12": [1]})

    handling = NoticeHandling(notice, vote, checkpointing, outputs, rank=0, budget_s=60.0,
                              resize_check_interval_s=300.0, beat=drained_while_waiting)
    with pytest.raises(Preempted, match="stopped at step 7 .*Ray drains node.s. ab12.*checkpoint of step 7 committed"):
        handling.after_step(7)
    assert saves == [7] and len(beats) == 2  # it stopped waiting at the beat that saw the drain
    assert [(type(r), r.step, r.saved) for r in records] == [(ResizeSaveRecord, 7, True), (PreemptedRecord, 7, True)]
    assert preemption.resize_answer("grow") == (7, True)  # the policy may resize: the step is saved


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, as in a foreground terminal (a shell starts a background job with
    SIGINT ignored, and the handler the driver restores is the one it found)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_driver_asks_once_then_a_second_interrupt_stops_at_once(tmp_path: Path, python_sigint: None) -> None:
    from meshtrain.cluster.interrupts import DriverInterrupts

    request = StopRequest(str(tmp_path / "stop_request.json"), "launch-7")
    StopRequest(request.path, "launch-6").write("left by an earlier launch")
    with DriverInterrupts(request, preemption_save_s=25.0) as interrupts:
        assert request.read() is None and not Path(request.path).exists()  # the earlier launch's is gone
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: ask the workers to save
        assert interrupts.received == "SIGINT" and request.read() == "SIGINT to the driver"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)  # again (ray job stop): stop at once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and not Path(request.path).exists()
    with DriverInterrupts(request, preemption_save_s=None), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # without preemption handling the workers cannot save on notice
