"""A real two-node Ray cluster on one machine: two network namespaces with their own IPs, a Ray
head in one, a Ray worker node in the other, the driver beside the head.

Ray Train groups workers by node IP, so only nodes with their own addresses give ``node_rank`` 0
and 1 and make ``parallel.shard=auto`` build the 2 (replicate) x 2 (shard) HSDP mesh. Needs root
on Linux (``ip netns``); elsewhere it is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from jobs import REPO, assert_same_weights, model_weights, read_metrics
from meshtrain.config import FaultToleranceConfig
from meshtrain.observe.goodput import goodput_line, goodput_of
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    EvictionRecord,
    InterruptedRecord,
    PreemptedRecord,
    ReplicaJoinedRecord,
    ReplicaLostRecord,
    ResizeRecord,
    ResizeSaveRecord,
    StragglerRecord,
    TrainRecord,
)
from raynodes import RayNode, ray_env, wait_until


IFACE = "mt0"  # the veth end in each namespace has this name, so one GLOO_SOCKET_IFNAME fits both
JOB = [
    "scaling.num_workers=4", "train.global_batch_size=16", "train.micro_batch_size=4",
    "train.steps=30", "train.log_every=1", "checkpoint.interval=10", "checkpoint.keep=5",
]


def unavailable() -> str | None:
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    return None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Cluster:
    head_ns: str
    worker_ns: str
    head_ip: str
    worker_ip: str
    storage: Path
    logs: Path
    head: RayNode | None = None
    worker: RayNode | None = None
    # The cluster's own token: the worker node may start before the head has written one to ~/.ray.
    token: str = field(default_factory=lambda: secrets.token_hex(32))

    @property
    def address(self) -> str:
        return f"{self.head_ip}:6379"

    def node_env(self) -> dict[str, str]:
        # Gloo otherwise binds to the address of the machine's hostname, unreachable from the namespaces.
        # Ray 2.60 clusters started with `ray start` require its token: nodes and drivers send it.
        return ray_env(GLOO_SOCKET_IFNAME=IFACE, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)

    def start_head(self) -> None:
        self.head = RayNode(
            ["--head", f"--node-ip-address={self.head_ip}", "--port=6379", "--num-cpus=2",
             "--include-dashboard=false", "--object-store-memory=400000000"],
            prefix=["ip", "netns", "exec", self.head_ns], env=self.node_env(), log=self.logs / "head.log",
        ).start()

    def start_worker(self) -> None:
        self.worker = RayNode(
            [f"--address={self.address}", f"--node-ip-address={self.worker_ip}", "--num-cpus=2",
             "--object-store-memory=400000000"],
            prefix=["ip", "netns", "exec", self.worker_ns], env=self.node_env(), log=self.logs / "worker.log",
        ).start()

    def alive_nodes(self) -> int:
        probe = subprocess.run(
            ["ip", "netns", "exec", self.head_ns, sys.executable, "-c",
             "import ray; ray.init(logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"],
            env={**self.node_env(), "RAY_ADDRESS": self.address}, capture_output=True, text=True, timeout=120,
        )
        lines = probe.stdout.strip().splitlines()  # Ray may print warnings (lagging heartbeats) before the count
        return int(lines[-1]) if probe.returncode == 0 and lines and lines[-1].isdigit() else 0

    def job(self, name: str, *overrides: str) -> subprocess.Popen[str]:
        """``python jobs/pretrain.py`` as a driver on the head's namespace, joining the cluster."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.head_ns, sys.executable, "jobs/pretrain.py", *JOB,
             f"run.storage_path={self.storage}", f"run.name={name}", *overrides],
            cwd=REPO, env={**self.node_env(), "RAY_ADDRESS": self.address},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )


def controller_log_tail(lines: int = 15) -> str:
    """The newest Ray Train controller's last decisions (for a job that did not end in time)."""
    logs = sorted(Path("/tmp/ray/session_latest/logs/train").glob("ray-train-app-controller-*.log"), key=os.path.getmtime)
    if not logs:
        return "(no controller log)"
    messages = []
    for line in logs[-1].read_text(errors="replace").splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if "Skipping resize decision" not in message.get("message", ""):
            messages.append(f"{message.get('asctime')} {message.get('message', '')[:400]}")
    return "\n".join(messages[-lines:])


def finish(job: subprocess.Popen[str], timeout: float = 400, code: int = 0) -> str:
    try:
        output, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        output, _ = job.communicate()
        raise AssertionError(
            f"the job did not end in {timeout:.0f}s; its output ends:\n{output[-4000:]}\n"
            f"Ray Train's controller said last:\n{controller_log_tail()}"
        ) from None
    assert job.returncode == code, output[-4000:]
    return output


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    tag = os.getpid() % 200 + 20
    home = tmp_path_factory.mktemp("two-nodes")
    nodes = Cluster(f"mt{tag}head", f"mt{tag}work", f"10.213.{tag}.1", f"10.213.{tag}.2", home / "runs", home)
    ip("netns", "add", nodes.head_ns)
    ip("netns", "add", nodes.worker_ns)
    try:
        ip("link", "add", f"mt{tag}h", "type", "veth", "peer", "name", f"mt{tag}w")
        for namespace, end, address in ((nodes.head_ns, f"mt{tag}h", nodes.head_ip), (nodes.worker_ns, f"mt{tag}w", nodes.worker_ip)):
            ip("link", "set", end, "netns", namespace)
            ip("-n", namespace, "link", "set", end, "name", IFACE)
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", IFACE)
            ip("-n", namespace, "link", "set", IFACE, "up")
            ip("-n", namespace, "link", "set", "lo", "up")
        nodes.start_head()
        nodes.start_worker()
        wait_until(lambda: nodes.alive_nodes() == 2, 180, "two live Ray nodes", interval=2)
        yield nodes
    finally:
        for node in (nodes.worker, nodes.head):
            if node is not None:
                node.kill()
        subprocess.run(["ip", "netns", "del", nodes.worker_ns], capture_output=True)
        subprocess.run(["ip", "netns", "del", nodes.head_ns], capture_output=True)


def losses(run_dir: Path) -> dict[int, float]:
    return {r.step: r.loss for r in read_metrics(run_dir) if isinstance(r, TrainRecord)}


def test_auto_mesh_on_two_nodes_is_2x2_with_each_shard_group_on_one_node(cluster: Cluster) -> None:
    output = finish(cluster.job("hsdp"))
    summary = json.loads((cluster.storage / "hsdp" / "summary.json").read_text())
    assert summary["mesh_shape"] == [2, 2] and summary["world_size"] == 4
    # Rank 0 checked, from every rank's node, that each shard group is on one node.
    assert "[meshtrain] placement: each of the 2 shard groups of 2 ranks is on one node" in output, output[-3000:]
    # Ray numbers nodes from the one that holds world rank 0, which may be either of them.
    placement = {(w["node_rank"], w["node_ip"]) for w in summary["workers"]}
    assert len(placement) == 2 and {rank for rank, _ in placement} == {0, 1}, summary["workers"]
    assert {ip for _, ip in placement} == {cluster.head_ip, cluster.worker_ip}, summary["workers"]
    assert sorted(w["local_rank"] for w in summary["workers"]) == [0, 0, 1, 1]
    assert list(losses(cluster.storage / "hsdp")) == list(range(1, 31))


def test_losing_the_second_node_recovers_once_it_is_back(cluster: Cluster) -> None:
    reference = cluster.storage / "hsdp" / "checkpoints" / "step-00000030"
    if not (reference / "COMMITTED").exists():
        finish(cluster.job("hsdp"))
    run_dir = cluster.storage / "recovered"
    job = cluster.job("recovered")
    try:
        first = run_dir / "checkpoints" / "step-00000010" / "COMMITTED"
        wait_until(lambda: first.exists() or job.poll() is not None, 300, "the first committed checkpoint", interval=0.1)
        assert job.poll() is None, "the job ended before the node could be stopped"
        stopped_at = max(losses(run_dir))
        assert cluster.worker is not None
        cluster.worker.kill()  # every Ray process of the second node, its training workers included
        time.sleep(5)
        cluster.start_worker()
        output = finish(job)
    finally:
        if job.poll() is None:
            job.kill()
    assert stopped_at < 30
    loads = [r for r in read_metrics(run_dir) if isinstance(r, CheckpointLoadRecord)]
    assert loads and loads[-1].step in (10, 20), output[-3000:]
    starts = [json.loads(line) for line in (run_dir / "worker_starts.jsonl").read_text().splitlines()]
    assert len(starts) >= 2 and {w["node_ip"] for w in starts[-1]["workers"]} == {cluster.head_ip, cluster.worker_ip}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mesh_shape"] == [2, 2]
    scratch = cluster.logs / "weights"
    scratch.mkdir(exist_ok=True)
    assert_same_weights(model_weights(reference, scratch), model_weights(run_dir / "checkpoints" / "step-00000030", scratch))


ELASTIC = ("scaling.min_workers=2", "scaling.resize_check_interval_s=5")


def train_records(run_dir: Path) -> dict[int, TrainRecord]:
    """The last record of each step (a step trained twice, before and after a restart, keeps its second)."""
    return {r.step: r for r in read_metrics(run_dir) if isinstance(r, TrainRecord)}


def node_down(cluster: Cluster) -> None:
    if cluster.worker is not None:
        cluster.worker.kill()
    wait_until(lambda: cluster.alive_nodes() == 1, 120, "Ray to mark the second node dead", interval=2)


def test_an_elastic_run_shrinks_without_the_lost_node_and_grows_back_when_it_returns(cluster: Cluster) -> None:
    """Elastic (scaling.min_workers=2), one timeline. The second node is lost after the first checkpoint:
    the run resumes on the head's two workers (1x2) from the newest checkpoint, with the unbroken 2x2 run's
    samples per step and its losses within 1e-4. Once 1x2 trains, the node returns: Ray's next capacity
    check (scaling.resize_check_interval_s) finds room for 2x2, the 1x2 group saves the step it is at, and
    2x2 resumes from exactly that step. The 1x2 group's first checkpoint (scheduled, or the grow's save) holds
    bitwise the weights of a 1x2 run resumed from the unbroken run's checkpoint at the same step and trained
    to that step. Three 2x2 steps later the
    driver is interrupted (the barrier that ends the timeline): the workers save the step they are at and
    the job exits 130 naming it. No step after the shrink's resume is trained twice."""
    unbroken = cluster.storage / "hsdp"
    if not (unbroken / "checkpoints" / "step-00000030" / "COMMITTED").exists():
        finish(cluster.job("hsdp"))
    if cluster.worker is None:
        cluster.start_worker()
        wait_until(lambda: cluster.alive_nodes() == 2, 180, "two live Ray nodes", interval=2)
    run_dir = cluster.storage / "elastic"
    # The horizon is the barrier below, not the step count; the LR schedule is the unbroken run's.
    job = cluster.job("elastic", *ELASTIC, "train.steps=2000", "optim.schedule_steps=30", "checkpoint.keep=100")

    def trained(world_size: int, after: int = 0) -> list[TrainRecord]:
        return [r for r in read_metrics(run_dir) if isinstance(r, TrainRecord) and r.world_size == world_size
                and r.step > after]

    try:
        first = run_dir / "checkpoints" / "step-00000010" / "COMMITTED"
        wait_until(lambda: first.exists() or job.poll() is not None, 300, "the first committed checkpoint", interval=0.1)
        assert job.poll() is None, "the job ended before the node could be lost"
        lost_at = time.time()
        assert cluster.worker is not None
        cluster.worker.kill()
        cluster.worker = None
        wait_until(lambda: bool(trained(2)) or job.poll() is not None, 300, "training on the head's node (1x2)",
                   interval=0.2)
        assert job.poll() is None, "the job ended before the node could return"
        cluster.start_worker()

        def grown() -> bool:
            saves = [r for r in read_metrics(run_dir) if isinstance(r, ResizeSaveRecord)]
            return bool(saves) and len(trained(4, after=saves[-1].step)) >= 3

        wait_until(lambda: grown() or job.poll() is not None, 400, "3 steps on 2x2 after the node returned",
                   interval=0.2)
        assert job.poll() is None, "the job ended before it grew back"
        job.send_signal(signal.SIGINT)
        output = finish(job, code=130)
    finally:
        if job.poll() is None:
            job.kill()
    records = read_metrics(run_dir)
    resizes = [r for r in records if isinstance(r, ResizeRecord)]
    assert [(r.from_workers, r.to_workers) for r in resizes] == [(4, 2), (2, 4)], output[-3000:]
    assert "capacity lost" in resizes[0].reason and "capacity returned" in resizes[1].reason
    assert "worker group resized from 4 to 2 workers" in output
    starts = [json.loads(line) for line in (run_dir / "worker_starts.jsonl").read_text().splitlines()]
    assert [s["world_size"] for s in starts] == [4, 2, 4] and starts[1]["resized_from"] == 4
    # The shrink resumed from the newest committed checkpoint; the grow from the step the 1x2 group saved.
    [saved] = [r for r in records if isinstance(r, ResizeSaveRecord)]
    assert saved.saved, saved
    resumed_from, grown_from = [r.step for r in records if isinstance(r, CheckpointLoadRecord)]
    assert resumed_from in (10, 20) and grown_from == saved.step, output[-3000:]
    [interrupted] = [r for r in records if isinstance(r, InterruptedRecord)]
    assert interrupted.saved and interrupted.step >= saved.step + 3, interrupted
    assert f"meshtrain: interrupted at step {interrupted.step}; checkpoint step {interrupted.step} committed" in output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mesh_shape"] == [2, 2] and summary["world_size"] == 4
    assert [(r["from_workers"], r["to_workers"]) for r in summary["resizes"]] == [(4, 2), (2, 4)]

    # Every step once after the shrink's resume: 1x2 up to the grow's save, 2x2 from the next step on.
    steps, reference = train_records(run_dir), train_records(unbroken)
    since_shrink = [r for r in records if isinstance(r, TrainRecord)]
    since_shrink = since_shrink[next(i for i, r in enumerate(since_shrink) if r.world_size == 2):]
    assert [r.step for r in since_shrink] == list(range(resumed_from + 1, interrupted.step + 1)), output[-3000:]
    assert list(steps) == list(range(1, interrupted.step + 1))
    for step, record in steps.items():
        assert record.samples == [(step - 1) * 16, step * 16], step
        assert record.world_size == (4 if step <= resumed_from or step > saved.step else 2), step
        if step <= 30:  # the unbroken run's steps: the same samples, the same schedule
            assert record.loss == pytest.approx(reference[step].loss, rel=1e-4), step
    back = min(r.time for r in steps.values() if r.world_size == 2)
    print(f"node lost -> training on 1x2 again: {back - lost_at:.1f}s; grow: saved step {saved.step} in "
          f"{saved.save_s:.2f}s; max loss difference {max(abs(r.loss - reference[s].loss) / reference[s].loss for s, r in steps.items() if s <= 30):.2e} (relative)")

    # The same reshard by hand: the unbroken run's checkpoint, resumed on 2 workers (one node) to the 1x2 group's
    # first checkpoint (checkpoint.interval=10 after the resume, or the grow's save if that came first).
    compared_at = min(resumed_from + 10, saved.step)
    assert compared_at in [r.step for r in records if isinstance(r, (CheckpointSaveRecord, ResizeSaveRecord))]
    resharded = cluster.storage / "resharded"
    name = f"step-{resumed_from:08d}"
    shutil.copytree(unbroken / "checkpoints" / name, resharded / "checkpoints" / name)
    finish(cluster.job("resharded", "scaling.num_workers=2", f"train.steps={compared_at}", "optim.schedule_steps=30"))
    assert json.loads((resharded / "summary.json").read_text())["mesh_shape"] == [1, 2]
    scratch = cluster.logs / "elastic-weights"
    scratch.mkdir(exist_ok=True)
    at = f"checkpoints/step-{compared_at:08d}"
    assert_same_weights(model_weights(resharded / at, scratch), model_weights(run_dir / at, scratch))


def test_a_straggler_node_is_evicted_and_the_run_goes_on_without_it(cluster: Cluster) -> None:
    """The second node's ranks compute 3x slower from step 3: they are named stragglers, and the node
    is drained through Ray (scaling.evict_stragglers: the call behind `ray drain-node`, as an autoscaler
    makes on a spot reclaim). Ray Train's PreemptionWatcher marks every worker, the ranks save the step
    they are at, and the elastic group restarts on the head from exactly that step and completes.
    Under tensor parallel (a TP group on each node, its placement checked from every rank's node like
    the shard groups'): the stop vote, the straggler times and the preemption save run on every rank,
    the smaller group is one whole TP group, and every step's loss is the 2x2 HSDP run's (a slow rank
    changes no number)."""
    unbroken = cluster.storage / "hsdp"
    if not (unbroken / "checkpoints" / "step-00000030" / "COMMITTED").exists():
        finish(cluster.job("hsdp"))
    if cluster.worker is None:
        cluster.start_worker()
        wait_until(lambda: cluster.alive_nodes() == 2, 180, "two live Ray nodes", interval=2)
    run_dir = cluster.storage / "evicted"
    job = cluster.job("evicted", *ELASTIC, "parallel.tensor=2", "scaling.evict_stragglers=true", "fault.kind=slow",
                      f"fault.node={cluster.worker_ip}", "fault.at_step=3", "fault.slow_factor=3", "metrics.straggler_factor=2", "metrics.straggler_patience=3")
    try:
        output = finish(job)
    finally:
        if job.poll() is None:
            job.kill()
        node_down(cluster)  # a drained node takes no new work: the next test starts it again
        cluster.worker = None
    records = read_metrics(run_dir)
    # Only what led to the eviction is checked: later, 2 ranks sharing 2 busy cores may cross factor 2 by noise
    # (the head is never drained for it).
    [eviction] = [r for r in records if isinstance(r, EvictionRecord) and r.evicted]
    stragglers = [r for r in records if isinstance(r, StragglerRecord) and r.step <= eviction.step]
    assert stragglers and all(r.node == cluster.worker_ip and r.slowdown >= 2 for r in stragglers), stragglers
    straggler = stragglers[0]
    assert eviction.evicted and eviction.node == cluster.worker_ip, eviction
    # Ray ends the drained node's share in two ways at once, in either order: its PreemptionWatcher's notice
    # naming the node (a "preempted" save, then the ranks leave) and meshtrain's elastic policy seeing the
    # capacity go (a "resize_save", then the ranks wait for the resize; a notice during that wait makes them
    # leave at once, from that save). Every save is of the step the ranks are at, and the group that follows
    # resumes from the last one. (The group may have started on the head alone and grown first: the load
    # after the drain is the one checked.)
    after = records[records.index(eviction):]
    load = next(i for i, r in enumerate(after) if isinstance(r, CheckpointLoadRecord))
    saves = [r for r in after[:load] if isinstance(r, (PreemptedRecord, ResizeSaveRecord))]
    assert saves and all(r.saved for r in saves), saves
    assert all(r.reason.startswith("Ray drains node(s)") for r in saves if isinstance(r, PreemptedRecord)), saves
    preempted = saves[-1]
    assert after[load].step == preempted.step, (saves, output[-3000:])
    # No step trained twice: every restart resumed where the group before it stopped.
    assert [r.step for r in records if isinstance(r, TrainRecord)] == list(range(1, 31)), output[-3000:]
    steps = train_records(run_dir)
    assert {r.world_size for s, r in steps.items() if s > preempted.step} == {2}
    assert json.loads((run_dir / "summary.json").read_text())["mesh_shape"] == [1, 1, 2]
    assert "[meshtrain] placement: each of the 2 tensor/context groups of 2 ranks is on one node" in output, (
        output[-3000:])
    # Same samples per step as HSDP on 2x2, summed in other orders (TP 2 replicated over the nodes, then
    # TP 2 alone): the losses agree to float precision at first, and the difference grows only where
    # training is unstable (a gradient spike amplifies it). A wrong reduction is off from the first
    # update on, by far more.
    hsdp = losses(unbroken)
    for step, record in steps.items():
        assert record.loss == pytest.approx(hsdp[step], rel=1e-5 if step <= 10 else 1e-3), step
    evicted_at = next(r.time for r in records if isinstance(r, TrainRecord) and r.step == straggler.step)
    resumed = min(r.time for r in steps.values() if r.world_size == 2)
    print(f"straggler named at step {straggler.step} ({straggler.slowdown:.2f}x); node drained; step "
          f"{preempted.step} committed ({preempted.event}, {preempted.save_s:.1f}s to save); training on the "
          f"head {resumed - evicted_at:.1f}s after the straggler was named; steps lost: 0")


def test_replica_mode_loses_a_node_trains_on_without_it_and_the_group_rejoins_when_it_returns(cluster: Cluster) -> None:
    """fault_tolerance.mode=replica with two replica groups of two workers (shard 2), one group per node.
    The worker node's Ray is killed: the head's group trains on alone (strict: the same samples), while
    the other group cannot restart, no node having room for it. Once the node is back, Ray starts that
    group there and it joins by receiving the head group's state over the nodes' network (torchft's
    transport at the node's address). Every step is logged once, no checkpoint is read, and the steps
    the 2x2 HSDP run also trains (1-30, the same schedule) have its losses. The horizon is a barrier:
    three steps of both groups after the rejoin, the driver is interrupted and the job exits 130."""
    pytest.importorskip("torchft")
    if cluster.worker is None:
        cluster.start_worker()
    wait_until(lambda: cluster.alive_nodes() == 2, 180, "two live Ray nodes", interval=2)
    unbroken = cluster.storage / "hsdp"
    if not (unbroken / "checkpoints" / "step-00000030" / "COMMITTED").exists():
        finish(cluster.job("hsdp"))
    run_dir = cluster.storage / "replicas"
    # The horizon is the barrier below, not the step count; the LR schedule is the HSDP run's.
    job = cluster.job("replicas", "fault_tolerance.mode=replica", "parallel.shard=2", "fault_tolerance.heartbeat_timeout_s=2",
                      "train.steps=2000", "optim.schedule_steps=30", "checkpoint.interval=20")

    def both_train() -> bool:
        return any(isinstance(r, TrainRecord) and r.replicas == 2 and r.step >= 3 for r in read_metrics(run_dir))

    try:
        wait_until(lambda: both_train() or job.poll() is not None, 300, "both groups training", interval=0.2)
        assert job.poll() is None, "the job ended before the node could be lost"
        starts = [json.loads(line) for line in (run_dir / "worker_starts.jsonl").read_text().splitlines()]
        nodes = {s["replica"]: {w["node_ip"] for w in s["workers"]} for s in starts}
        assert sorted(nodes.values(), key=sorted) == sorted([{cluster.head_ip}, {cluster.worker_ip}], key=sorted), starts
        [away] = [index for index, ips in nodes.items() if ips == {cluster.worker_ip}]
        assert cluster.worker is not None
        cluster.worker.kill()
        cluster.worker = None
        lost_at = time.time()

        def trained_alone() -> bool:
            records = read_metrics(run_dir)
            lost = [i for i, r in enumerate(records) if isinstance(r, ReplicaLostRecord)]
            return bool(lost) and sum(isinstance(r, TrainRecord) for r in records[lost[0]:]) >= 5

        wait_until(lambda: trained_alone() or job.poll() is not None, 120, "5 steps without the lost group", interval=0.2)
        assert job.poll() is None, "the run ended before the node came back"
        cluster.start_worker()

        def rejoined() -> bool:
            records = read_metrics(run_dir)
            lost = [i for i, r in enumerate(records) if isinstance(r, ReplicaLostRecord)]
            joined = [i for i, r in enumerate(records) if isinstance(r, ReplicaJoinedRecord) and lost and i > lost[0]]
            return bool(joined) and sum(isinstance(r, TrainRecord) and r.replicas == 2 for r in records[joined[0]:]) >= 3

        wait_until(lambda: rejoined() or job.poll() is not None, 400, "3 steps of both groups after the rejoin",
                   interval=0.2)
        assert job.poll() is None, "the run ended before the group rejoined"
        job.send_signal(signal.SIGINT)
        output = finish(job, code=130)
    finally:
        if job.poll() is None:
            job.kill()
    records = read_metrics(run_dir)
    trained = [r for r in records if isinstance(r, TrainRecord)]
    last = trained[-1].step
    assert "meshtrain: interrupted at step" in output, output[-3000:]
    # The groups stop at the step boundary where each sees the driver's stop request, which may differ by
    # a step: the later one then records the earlier one's leaving (after the rejoin, checked below) and
    # trains that step alone. The first loss is the node's.
    lost, *stopping = [r for r in records if isinstance(r, ReplicaLostRecord)]
    # Only the first live group writes records. When the node's group was that writer, it may die after
    # its last step committed on both groups but before writing that step's record (seen on the clean clone
    # of 58ee2e7: step 45 committed, the loss recorded at 46): that one record is lost with it.
    steps = [r.step for r in trained]
    unwritten = sorted(set(range(1, last + 1)) - set(steps))
    assert steps == sorted(set(steps)) and unwritten in ([], [lost.step - 1]), output[-3000:]
    stopped = min([r.step for r in records if isinstance(r, InterruptedRecord)] + [r.step - 1 for r in stopping])
    # The groups start seconds apart (each its own Ray Train run): the first trains alone until the other
    # joins by healing from it at its first quorum, as a replacement does (seen: at step 22).
    late = [r.step for r in records[:records.index(lost)] if isinstance(r, ReplicaJoinedRecord)]
    first_together = late[-1] if late else 0
    assert {r.replicas for r in trained if r.step <= first_together} <= {1}, late
    assert {r.replicas for r in trained if first_together < r.step < lost.step} == {2}, late
    # Dropped by the heartbeat (2 s), not by the cross-replica collective's timeout.
    assert lost.participants == 1 and lost.time - lost_at < FaultToleranceConfig().timeout_s, lost
    joined = [r for r in records if isinstance(r, ReplicaJoinedRecord) and r.step >= lost.step]
    assert len(joined) == 1, output[-3000:]
    assert len(stopping) <= 1 and all(r.step > joined[0].step for r in stopping), stopping
    assert joined[0].replica == away and joined[0].source == 1 - away and joined[0].participants == 2
    assert joined[0].bytes > 0 and joined[0].step < stopped  # trained together after it
    assert not [r for r in records if isinstance(r, CheckpointLoadRecord)]  # no checkpoint was read
    restarted = [json.loads(line) for line in (run_dir / "worker_starts.jsonl").read_text().splitlines()]
    assert [s["replica"] for s in restarted].count(away) >= 2 and [s["replica"] for s in restarted].count(1 - away) == 1
    hsdp = losses(unbroken)
    for record in trained[:30]:
        assert record.loss == pytest.approx(hsdp[record.step], rel=1e-4), record.step
    # The launch's own account, from its records (an interrupted driver adds no goodput to the summary).
    goodput = goodput_of(records, trained[0].time - trained[0].step_time_s, trained[-1].time)
    assert goodput["lost_s"]["redone"] == 0.0, goodput
    alone = [r.step for r in trained if lost.step <= r.step <= joined[0].step]
    assert {r.replicas for r in trained if r.step in alone} == {1}
    assert {r.replicas for r in trained if joined[0].step < r.step <= stopped} == {2}
    print(f"replica mode, node lost at step {lost.step}: {len(alone)} steps on one group, "
          f"rejoined at step {joined[0].step} ({joined[0].bytes / 2**20:.1f} MiB in {joined[0].seconds:.1f}s), "
          f"{goodput_line(goodput)}")
