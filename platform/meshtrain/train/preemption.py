"""Stopping on notice: a worker told it will be stopped saves the current step and exits, so the run
loses at most the step in flight instead of everything since the last checkpoint.

Notices come two ways:

* **SIGTERM**: a spot/preemptible reclaim (AWS gives two minutes, GCP 30 s), a Kubernetes eviction
  (``terminationGracePeriodSeconds``, 30 s by default) or an operator. In a Ray worker the signal
  reaches Ray's own handler in the process's main thread (``ray._private.worker.main_loop``), which
  exits at once; the training thread cannot install a handler there, so :func:`defer_sigterm` makes
  that handler record the notice instead and lets the process end on meshtrain's terms.
* **Ray's drain notice**: Ray Train 2.60 starts a ``PreemptionWatcher`` actor per worker group that
  polls Ray Core for draining nodes (``ray drain-node``, the autoscaler, a cloud's own notice) and
  marks every worker of the group; :meth:`PreemptionNotice.local` reads that mark locally (Ray's
  public ``ray.train.get_preemption_info()`` is a barrier through Ray on every call, too slow for
  every step).

meshtrain's elastic policy asks the group to save before Ray resizes it
(:mod:`meshtrain.cluster.elastic_policy`) on a channel of its own, :func:`request_resize`, run in each
worker's process through Ray's ``execute`` on the worker's actor; the ranks save, answer
(:func:`resize_answer`) and wait to be restarted. Not through Ray's preemption mark: Ray's controller
reads every worker's mark in its health polls and takes any mark as a preemption (it stops making
scaling decisions and waits up to 120 s for the group to exit), so a request still there at a poll
turned a grow into a restart minutes later, from whatever checkpoint was newest by then.

A third kind of notice is an **interrupt**: Ctrl-C (SIGINT) or ``ray job stop`` (SIGTERM) reaching
the driver. The driver writes a :class:`StopRequest` into the run directory and every rank's
:class:`StopRequestWatch` turns it into a notice; the ranks save at the next step boundary as for a
preemption, but then finish normally, so Ray does not restart them and the driver can say where the
run stopped.

One rank hearing is enough: :class:`StopVote` all-reduces every rank's flag each step (a one-int
all-reduce on the loop's own gloo group, posted when the step starts and read when it ends, so it overlaps
the step), every rank agrees to stop at the same step boundary, saves that step synchronously and
leaves the training function with :class:`Preempted`; Ray restarts (or, elastic, shrinks) the group,
which resumes from that checkpoint. If the save has not committed within ``run.preemption_save_s``
of the notice, the worker exits anyway: the notice period is ending.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshtrain import ray_compat
from meshtrain.observe.run_folder import (
    Interrupted,
    InterruptedRecord,
    PreemptedRecord,
    ResizeSaveRecord,
    StopRequest,
    TrainRecord,
    WarningRecord,
)
from meshtrain.train.loop import LoopPart, StepDone, StepStart
from meshtrain.train.watchdog import _exit_worker

if TYPE_CHECKING:
    from meshtrain.train.checkpointing import Checkpointing
    from meshtrain.train.records import LoopOutputs, TrainResult


# What a rank's notice flag says, ordered so the all-reduced maximum is what the group does.
NO_NOTICE, RESIZE, PREEMPT, INTERRUPT = 0, 1, 2, 3


class _ResizeRequest:
    """The elastic policy's pending request in this worker's process, and this rank's answer: the step it
    saved for it and whether the save committed. A token per request, so an answer never belongs to an
    earlier request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._token: str | None = None
        self._answer: tuple[int, bool] | None = None

    def ask(self, token: str) -> None:
        with self._lock:
            self._token, self._answer = token, None

    def pending(self) -> bool:
        with self._lock:
            return self._token is not None and self._answer is None

    def answer(self, step: int, saved: bool) -> None:
        with self._lock:
            if self._token is not None:
                self._answer = (step, saved)

    def answered(self, token: str) -> tuple[int, bool] | None:
        with self._lock:
            return self._answer if token == self._token else None


_RESIZE = _ResizeRequest()


def request_resize(token: str) -> None:
    """Ask this worker's ranks to save at the next step boundary and wait for Ray to resize the group
    (run in the worker's process by the elastic policy through Ray's ``execute``)."""
    _RESIZE.ask(token)


def resize_answer(token: str) -> tuple[int, bool] | None:
    """This rank's answer to request ``token``: (step saved, committed), or None until its save is done."""
    return _RESIZE.answered(token)


class Preempted(RuntimeError):
    """Raised by every rank after the preemption save, so Ray restarts the worker group from it."""


class PreemptionNotice:
    """Whether this worker has been told it will be stopped, and when."""

    def __init__(self, budget_s: float, rank: int, exit_process: Callable[[str], None] | None = None) -> None:
        self.budget_s, self.rank = budget_s, rank
        self.reason: str | None = None
        self.received: float | None = None
        self.interrupted = False  # the notice is the driver's stop request, not a preemption
        self._given = threading.Event()
        self._done = threading.Event()
        self._exit = exit_process or _exit_worker

    def give(self, reason: str, interrupt: bool = False) -> None:
        """Record a notice (thread-safe; a second one changes nothing) and start its deadline.
        ``interrupt``: the driver was interrupted, so the group saves and finishes instead of restarting."""
        if self._given.is_set():
            return
        self.reason, self.received, self.interrupted = reason, time.monotonic(), interrupt
        self._given.set()
        kind = "interrupted" if interrupt else "preemption notice"
        sys.stdout.write(f"[meshtrain] rank {self.rank}: {kind} ({reason}); saving at the next step boundary, "
                         f"within run.preemption_save_s={self.budget_s:g}\n")
        sys.stdout.flush()
        threading.Thread(target=self._deadline, name="meshtrain-preemption-deadline", daemon=True).start()

    def _deadline(self) -> None:
        if not self._done.wait(self.budget_s):
            self._exit(
                f"[meshtrain] rank {self.rank}: no committed checkpoint {self.budget_s:g}s after the preemption notice "
                f"({self.reason}); exiting (run.preemption_save_s); the run resumes from its last committed checkpoint"
            )

    def done(self) -> None:
        """The preemption save committed: the deadline no longer applies."""
        self._done.set()

    @property
    def given(self) -> bool:
        return self._given.is_set()

    def local(self) -> int:
        """This worker's notice: PREEMPT (by signal or Ray's drain notice), RESIZE (meshtrain's elastic
        policy asks the group to save before it grows it) or NO_NOTICE."""
        if self._given.is_set():
            return INTERRUPT if self.interrupted else PREEMPT
        info = _ray_notice()
        if info is not None and info.preempted_node_to_ranks:
            self.give(f"Ray drains node(s) {', '.join(info.preempted_node_ids)}")
            return PREEMPT
        return RESIZE if _RESIZE.pending() else NO_NOTICE

    @staticmethod
    def answer_resize(step: int, saved: bool) -> None:
        """The group saved ``step`` for the elastic policy's request (``saved``: committed): the policy may resize."""
        _RESIZE.answer(step, saved)


class StopRequestWatch:
    """Turns the driver's stop request into an interrupt notice on this rank (checked twice a second
    on a thread of its own, so the step pays nothing)."""

    def __init__(self, request: StopRequest, notice: PreemptionNotice, interval_s: float = 0.5) -> None:
        self.request, self.notice, self.interval_s = request, notice, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshtrain-stop-request", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            reason = self.request.read()
            if reason is not None:
                self.notice.give(reason, interrupt=True)
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _ray_context() -> Any:
    return ray_compat.train_context()


def _ray_notice() -> Any:
    """Ray Train's notice to this worker (PreemptionInfo), read from the worker's own context."""
    return ray_compat.preemption_info(_ray_context())


def defer_sigterm(notice: PreemptionNotice) -> Callable[[], None]:
    """Route SIGTERM to ``notice`` instead of ending the process; returns the undo.

    In the main thread (a plain process, the tests) this installs a signal handler. In a Ray worker,
    where the training function runs in another thread, it replaces the function Ray's SIGTERM
    handler calls to exit (looked up by name in ``ray._private.worker`` at every signal).
    """
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda _signum, _frame: notice.give("SIGTERM"))

        def restore() -> None:
            signal.signal(signal.SIGTERM, previous)

        return restore
    undo = ray_compat.route_sigterm_exit(lambda: notice.give("SIGTERM"))
    return undo if undo is not None else lambda: None


class StopVote:
    """Every rank's notice flag, all-reduced (max) once per step on a gloo group of its own."""

    def __init__(self, notice: PreemptionNotice, group: Any) -> None:
        self.notice, self.group = notice, group  # a gloo group (None: one process)
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._work: Any = None

    def cast(self) -> None:
        """Post this rank's notice (when the step starts)."""
        self._flag = torch.tensor([self.notice.local()], dtype=torch.int32)
        if self.group is not None:
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def result(self) -> int:
        """The strongest notice any rank had when the step started (when the step ends)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return int(self._flag.item())

    def notices(self) -> list[tuple[str | None, float | None]]:
        """Every rank's (reason, seconds since) of its notice, gathered once the ranks agreed to stop
        (ages, not times: monotonic clocks differ between machines)."""
        received = self.notice.received
        mine = (self.notice.reason, time.monotonic() - received if received is not None else None)
        if self.group is None:
            return [mine]
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        return gathered

    def close(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None


class NoticeHandling:
    """What the loop does after a step once every rank has voted on notices: save and leave on a
    preemption (Ray restarts the group), save and finish on the driver's interrupt, save and wait on
    a resize request; and, once measured, whether the save budget can hold a step at all."""

    def __init__(
        self,
        notice: PreemptionNotice,
        vote: StopVote,
        checkpointing: Checkpointing,
        outputs: LoopOutputs,
        rank: int,
        budget_s: float,
        resize_check_interval_s: float,
        beat: Callable[[str], None],
        hand_over: Callable[[], int] | None = None,
    ) -> None:
        """``hand_over`` (replica mode): leave the run's quorum if other replica groups are live, and
        return how many are (0: none, so this group saves before it leaves)."""
        self.notice, self.vote, self.checkpointing, self.outputs = notice, vote, checkpointing, outputs
        self.rank, self.budget_s, self.resize_check_interval_s, self.beat = rank, budget_s, resize_check_interval_s, beat
        self.hand_over = hand_over
        self._budget_checked = False

    def after_step(self, step: int) -> Interrupted | None:
        """Act on this step's vote; the interrupt record when the driver asked the run to stop (the loop
        then ends), else None. A preemption raises :class:`Preempted` after its save."""
        decision = self.vote.result()
        if decision == INTERRUPT:
            return self._stop_on_interrupt(step)
        if decision == PREEMPT:
            self._stop_on_notice(step)
        elif decision == RESIZE:
            self._save_for_resize(step)
        return None

    def check_budget(self, step: int, records: list[TrainRecord]) -> None:
        """Once, when measured: a preemption budget that cannot hold a step and a save is a setting to fix."""
        if self._budget_checked or len(records) < 2:
            return
        self._budget_checked = True
        step_s = records[-1].step_time_s
        if self.budget_s < step_s:
            warning = (f"run.preemption_save_s={self.budget_s:g} is shorter than one step ({step_s:.1f}s at step "
                       f"{step}): a preempted run cannot save in time; raise it toward the notice period (AWS spot: 120 s)")
            self.outputs.emit(WarningRecord(step=step, setting="run.preemption_save_s", message=warning))

    def _stop_on_notice(self, step: int) -> None:
        """Every rank agreed that a notice came: save this step, then leave so Ray restarts the group.
        A replica group whose peers live leaves without saving: they hold the state it would save, and
        they stop waiting for it as soon as it has left their quorum."""
        notices = self.vote.notices()
        ages = [age for _, age in notices]
        started = time.perf_counter()
        peers_live = self.hand_over() if self.hand_over is not None else 0
        saved = self.checkpointing.save_now(step) if not peers_live else False
        save_s = time.perf_counter() - started
        noticed = [rank for rank, (reason, _) in enumerate(notices) if reason is not None]
        reason = "; ".join(sorted({notices[rank][0] or "" for rank in noticed})) or "a notice"
        known = [age for age in ages if age is not None]
        self.outputs.emit(PreemptedRecord(
            step=step, reason=reason, ranks=noticed, saved=saved, save_s=save_s,
            notice_to_commit_s=max(known) + save_s if known else None,  # from the earliest notice to the commit
            replica_peers_live=peers_live if self.hand_over is not None else None,
        ), any_replica=True)
        self.notice.done()
        if peers_live:
            kept = f"the {peers_live} live replica group(s) hold its state and train on"
        elif saved:
            kept = f"checkpoint of step {step} committed"
        else:
            kept = "no checkpoint saved (checkpoints off, or a skipped step)"
        raise Preempted(f"rank {self.rank}: stopped at step {step} on a preemption notice ({reason}); {kept}")

    def _stop_on_interrupt(self, step: int) -> Interrupted:
        """The driver was interrupted (Ctrl-C, ``ray job stop``): save this step and finish normally,
        so Ray does not restart the group and the driver can say where to resume from."""
        saved = self.checkpointing.save_now(step)
        self.notice.done()
        self.outputs.emit(InterruptedRecord(step=step, saved=saved, reason=self.notice.reason))
        return Interrupted(step=step, saved=saved, reason=self.notice.reason)

    def _save_for_resize(self, step: int) -> None:
        """The elastic policy will grow the group: save this step, then wait for Ray to restart the group
        (it resizes once every rank has answered), so the larger group loses no step. Should the
        restart not come, training goes on."""
        started = time.perf_counter()
        saved = self.checkpointing.save_now(step)
        self.outputs.emit(ResizeSaveRecord(step=step, saved=saved, save_s=time.perf_counter() - started))
        self.notice.answer_resize(step, saved)
        waiting_until = time.monotonic() + self.resize_check_interval_s + 60
        while time.monotonic() < waiting_until:
            if self.notice.local() == PREEMPT:
                self._leave_saved(step, saved)
            self.beat(f"waiting for Ray to resize the group after the checkpoint of step {step}")
            time.sleep(0.5)

    def _leave_saved(self, step: int, saved: bool) -> None:
        """A preemption notice came while the group waited to be resized (a drained node: Ray's
        PreemptionWatcher and the elastic policy both act on it): this step is already saved, so leave
        now rather than sleep out the wait and train on a node that is going away."""
        reason = self.notice.reason or "a notice"
        self.outputs.emit(PreemptedRecord(step=step, reason=reason, ranks=[self.rank], saved=saved, save_s=0.0))
        self.notice.done()
        kept = f"checkpoint of step {step} committed" if saved else "no checkpoint saved"
        raise Preempted(f"rank {self.rank}: stopped at step {step} on a preemption notice ({reason}) while waiting "
                        f"for a resize; {kept}")


class Notices(LoopPart):
    """The loop's notices (``run.preemption_save_s``): each step's vote is cast as the step begins and
    acted on when it ends (see :class:`NoticeHandling`); the driver's interrupt, when it stops the run,
    goes into ``result``. :meth:`listen` routes SIGTERM and the driver's stop request here, last in
    the loop's setup, so a setup that fails leaves no signal route and no thread behind."""

    def __init__(self, notice: PreemptionNotice, vote: StopVote, handling: NoticeHandling, result: TrainResult) -> None:
        self.notice, self.vote, self.handling, self.result = notice, vote, handling, result
        self._restore_sigterm: Callable[[], None] | None = None
        self._watch: StopRequestWatch | None = None

    def listen(self, stop_request: StopRequest | None) -> None:
        self._restore_sigterm = defer_sigterm(self.notice)
        if stop_request is not None:
            self._watch = StopRequestWatch(stop_request, self.notice)

    def before_step(self, start: StepStart) -> None:
        self.vote.cast()

    def after_step(self, done: StepDone) -> bool:
        if done.logged:
            self.handling.check_budget(done.step, self.result.records)
        self.result.interrupted = self.handling.after_step(done.step)
        return self.result.interrupted is None

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        if self._restore_sigterm is not None:
            self._restore_sigterm()
        self.vote.close()
