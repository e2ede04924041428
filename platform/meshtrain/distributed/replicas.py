"""Replica groups under a per-step quorum (``fault_tolerance.mode=replica``): the one module that speaks
to torchft.

Each replica group is one copy of the model (its workers shard it with FSDP2, and split it with
tensor and context parallel, on their own mesh). Worker ``r`` of every group is linked to worker
``r`` of the others by a process group that torchft rebuilds at each quorum, so a lost group costs the
others no restart: each step asks the lighthouse who is alive, the live groups split the step's
samples, sum their gradients and vote to commit; a group that joins receives the state of a live peer,
rank to same rank, from its memory.

Only the manager, its reconfigurable process group and its transport are used, not torchft's DDP or
optimizer wrappers, so torch's own reconfigurable process groups can replace it later.

Gradients are summed over the replicas explicitly after the backward pass, not in FSDP2's all-reduce
hook: FSDP2 calls that hook only when it reduces over more than one rank, so a replica group of one
worker would train on its own share alone (measured: each replica's gradient was its half's, norm
0.71 of the batch's). torchft's own average (``ReduceOp.AVG``) divides in a future's callback that
``wait`` does not wait for; sums with meshtrain's own scale avoid it.

A group that heartbeats but stops making progress inside a step (hung) or stops altogether (frozen)
would hold its peers in the cross-replica sum for the collective's whole timeout. Its peers wait only
until a deadline (``train/replica_pace.py``), then tell the lighthouse to end the groups that have not
reached the sum (each group posts the step it reached on the run's board, a key-value store beside the
lighthouse), through torchft's own kill route, which ends the group's manager process: a hung group's
workers exit and Ray replaces the group; a frozen one cannot answer and has already stopped
heartbeating, so the lighthouse leaves it out of the next quorum. A group that steps slower than the
others (``train/replica_stragglers.py``) is ended the same way when ``scaling.evict_stragglers`` is set,
once per group index: Ray's replacement heals from a peer as a lost group's does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

from meshtrain.config import ConfigError, FaultToleranceConfig
from meshtrain.config.network import Endpoint

FT_EXTRA = "pip install -e '.[ft]'"
Ended = Literal["hung", "frozen", "slow"]  # why a replica group's peers ended it


def check_torchft() -> None:
    """ConfigError (one line) when replica mode cannot run here: torchft is not installed."""
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(f"fault_tolerance.mode=replica needs torchft: {FT_EXTRA}, or set fault_tolerance.mode=restart")


@dataclass(frozen=True)
class ReplicaPlacement:
    """Where a worker's replica group sits among the run's: shipped to every worker of the group."""

    index: int  # this group's index, 0..replicas-1 (a replacement takes the lost group's)
    replicas: int  # the run's replica groups
    lighthouse: str  # the lighthouse's address (http://host:port)
    joining: bool = False  # replaces a lost group: receives a live peer's state, reads no checkpoint
    # The newest committed step when the launch began (0: none; None: no limit). A group of the launch
    # loads that one, not one a peer saved since: a group that starts late heals from its peers anyway.
    resume_step: int | None = None
    board: str | None = None  # the run's board (host:port), where each group posts the step it reached


class GroupCompute(NamedTuple):
    """A replica group's transformer-block compute per step, and the node of its slowest worker."""

    seconds: float
    node: str


@dataclass(frozen=True)
class StepQuorum:
    """Who trains the next step: the live replica groups and this group's place among them."""

    participants: int  # live replica groups taking part
    rank: int  # this group's rank among them (0 writes the run's records and checkpoints)
    step: int  # steps committed before this one (a healed group has its peer's)
    healed: bool  # this group just received a peer's state
    source: int | None = None  # healed: the replica group it came from
    received_bytes: int = 0  # healed: the tensor bytes this worker received


def _quiet_torchft() -> None:
    """torchft's servers log every quorum and commit at info level (several lines per step and replica
    group); warnings and errors stay. RUST_LOG set by the user wins."""
    os.environ.setdefault("RUST_LOG", "warn")


class LighthouseServer:
    """The run's quorum service (torchft's Rust lighthouse), kept by the driver for the run's life."""

    def __init__(self, settings: FaultToleranceConfig, replicas: int, bind: str = "[::]:0") -> None:
        _quiet_torchft()
        from torchft._torchft import LighthouseServer as Server

        self._server = Server(
            bind=bind,
            min_replicas=settings.min_replicas,
            # The first quorum waits this long for every replica group before going on with fewer.
            join_timeout_ms=int(settings.join_timeout_s * 1000),
            heartbeat_timeout_ms=int(settings.heartbeat_timeout_s * 1000),
        )
        self._board: dist.TCPStore | None = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        self.replicas = replicas

    def board_on(self, host: str) -> str:
        """The board's address at ``host`` (host:port)."""
        assert self._board is not None, "the lighthouse is closed"
        return Endpoint(host, self._board.port).target

    @property
    def address(self) -> str:
        return self._server.address()

    def address_on(self, host: str) -> str:
        """Its address at ``host`` (the driver's node address): torchft advertises the machine's hostname,
        which other nodes may not resolve, or resolve to their own loopback."""
        return f"http://{_on_host(self.address, host)}"

    def close(self) -> None:
        self._server.shutdown()
        self._board = None


class ReplicaPeers:
    """This worker's link to the same-rank workers of the other replica groups.

    ``state`` and ``load_state`` give and take everything a joining group needs (model and optimizer
    shards, schedule, counters) as plain tensors and numbers; torchft sends them rank to same rank.
    """

    def __init__(
        self,
        settings: FaultToleranceConfig,
        placement: ReplicaPlacement,
        group_rank: int,
        group_size: int,
        device: torch.device,
        state: Callable[[], dict[str, Any]],
        load_state: Callable[[dict[str, Any]], None],
        host: str | None = None,
    ) -> None:
        _quiet_torchft()
        from torchft.manager import Manager

        self.placement = placement
        self._healed_from: tuple[int, int] | None = None  # (source replica group, bytes received)
        self._closed = False
        self._late = False  # a sum of this step ran past its deadline
        self._heartbeat_timeout_s = settings.heartbeat_timeout_s
        self._board_timeout = timedelta(seconds=settings.timeout_s)
        self._board: dist.TCPStore | None = None  # one worker per group posts and declares
        self._board_reader: dist.TCPStore | None = None  # the group's other workers, once they find it alone
        if group_rank == 0:
            self._board = self._open_board()

        def send() -> dict[str, Any]:
            return {"state": state(), "replica": placement.index}

        def heal(received: dict[str, Any]) -> None:
            load_state(received["state"])
            self._healed_from = (int(received["replica"]), tensor_bytes(received["state"]))

        host = host or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        self._store = _GroupStore(host, group_rank, group_size)
        timeout = timedelta(seconds=settings.timeout_s)
        self._manager = Manager(
            pg=_process_group(device, timeout, host),
            checkpoint_transport=_transport(host, timeout),
            load_state_dict=heal,
            state_dict=send,
            min_replica_size=settings.min_replicas,
            use_async_quorum=False,  # a joining group trains in its first step: its samples follow the quorum
            timeout=timeout,
            quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
            connect_timeout=timeout,
            rank=group_rank,
            world_size=group_size,
            store_addr=host,
            store_port=self._store.port,
            lighthouse_addr=placement.lighthouse,
            replica_id=f"replica_{placement.index}",
            hostname=host,
            # Every group initializes the same weights from the seed, or loads the same checkpoint.
            init_sync=False,
            max_retries=settings.max_uncommitted_steps,
        )
        self._members = _QuorumMembers(self._manager._client)
        self._manager._client = self._members

    def quorum(self) -> StepQuorum:
        """Join the next step's quorum; a group behind its peers receives a live peer's state first."""
        manager = self._manager
        self._healed_from = None
        self._late = False
        manager.start_quorum()
        rank = manager.participating_rank()
        if rank is None:  # only a group that healed may sit out a step; with a synchronous quorum it takes part
            raise RuntimeError(f"replica group {self.placement.index} is not taking part in step {manager.current_step() + 1}")
        healed = self._healed_from
        return StepQuorum(manager.num_participants(), rank, manager.current_step(), healed is not None,
                          *(healed if healed is not None else (None, 0)))

    def sum_gradients(self, parameters: list[torch.nn.Parameter], deadline: float | None = None) -> None:
        """Sum each gradient (this rank's shard) over the live replica groups, in one flat buffer per dtype."""
        local = [_local(p.grad) for p in parameters if p.grad is not None]
        if self._board is not None:
            self._board.set(_reached_key(self.placement.index), str(self._manager.current_step() + 1))
        for dtype in {grad.dtype for grad in local}:
            grads = [grad for grad in local if grad.dtype == dtype]
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            self.sum(flat, deadline)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def sum(self, tensor: torch.Tensor, deadline: float | None = None) -> None:
        """``tensor`` summed over the live replica groups, in place (zeros after a failed collective:
        that step is not committed). ``deadline`` (``time.monotonic``): stop waiting for the peers then;
        the step is not committed, and ``late`` says so."""
        work = self._manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM)
        if deadline is None:
            work.wait()
            return
        done = work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        if time.monotonic() >= deadline:
            self._late = True
            if done:  # this group was the late one (a frozen process resumed): its peers went on without it
                self._manager.report_error(TimeoutError("the cross-replica sum ended past its deadline"))

    @property
    def late(self) -> bool:
        """A sum of this step ran past its deadline: some peer group never reached it."""
        return self._late

    def end_late_peers(self, step: int) -> dict[int, Ended]:
        """The peer groups of the last quorum that never reached the sum of ``step`` (on the board), each
        ended through the lighthouse: ``hung`` when its manager took the order (its workers exit),
        ``frozen`` when it could not answer (it no longer heartbeats either). Empty on a worker that
        does not declare (only group rank 0 does), or without a board."""
        if self._board is None:
            return {}
        ended: dict[int, Ended] = {}
        for member in self._members.ids:
            index = _replica_index(member)
            if index == self.placement.index or self._reached(index) >= step:
                continue
            ended[index] = self._end(member, step)
        return ended

    def end_slow_peer(self, index: int, step: int) -> bool:
        """End peer group ``index`` of the last quorum, which steps slower than the others, after step
        ``step`` (through the lighthouse, as a hung one): Ray replaces it. Once per group index in a launch
        (a replacement that is slow too stays: the slowness is not its node's); False when it was ended
        for slowness before, is not in the last quorum, or this worker does not declare."""
        members = [member for member in self._members.ids if _replica_index(member) == index]
        if self._board is None or not members or index == self.placement.index:
            return False
        if self._board.add(_evicted_key(index), 1) > 1:  # atomic: two groups never both evict it
            return False
        self._end(members[0], step)
        return True

    def _end(self, member: str, step: int) -> Ended:
        """Send the lighthouse's kill order for group ``member`` and mark it ended at ``step`` on the board
        (a frozen group reads it once it resumes). The order waits for its answer (at most 2 s for a frozen
        group's): the lighthouse finds the group's manager in its last quorum, which this group's next
        quorum request would replace."""
        assert self._board is not None
        ended = _kill(self.placement.lighthouse, member, min(2.0, self._heartbeat_timeout_s))
        self._board.set(_ended_key(_replica_index(member)), str(step))
        return ended

    def was_ended(self, healed: bool, alone: bool) -> int | None:
        """The step at which this group's peers ended it (on the board; None: they did not, or it has
        since healed from a peer (``healed``: it just did)). A frozen group cannot take the kill order,
        so it reads it here once it resumes: its peers went on without it, perhaps to the run's end.
        The group's first worker reads it at every quorum (and clears it once healed); the others only
        when the quorum holds this group ``alone``, the one case in which it leaves, so that every worker
        of the group leaves together."""
        board = self._board
        if board is None and alone and not self._closed:
            board = self._board_reader = self._board_reader or self._open_board()
        if board is None:
            return None
        key = _ended_key(self.placement.index)
        if not board.check([key]):
            return None
        if healed:  # back among its peers, with their state
            if board is self._board:
                board.delete_key(key)
            return None
        return int(board.get(key))

    def _open_board(self) -> dist.TCPStore | None:
        if self.placement.board is None:
            return None
        host, port = self.placement.board.rsplit(":", 1)
        return dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                             timeout=self._board_timeout)

    @property
    def groups(self) -> frozenset[int]:
        """The replica groups of the last quorum, by index (empty before the first)."""
        return frozenset(map(_replica_index, self._members.ids))

    def compare_compute(self, seconds: float, node: str) -> dict[int, GroupCompute]:
        """Post this group's block compute per step (and its slowest worker's node) on the board; the
        latest that each group of the last quorum posted, by group index (this one's included). Empty on a
        worker that does not post (only group rank 0 does), or without a board."""
        if self._board is None:
            return {}
        self._board.set(_compute_key(self.placement.index), json.dumps([seconds, node]))
        posted: dict[int, GroupCompute] = {}
        for index in map(_replica_index, self._members.ids):
            key = _compute_key(index)
            if self._board.check([key]):
                value, where = json.loads(self._board.get(key))
                posted[index] = GroupCompute(float(value), str(where))
        return posted

    def _reached(self, index: int) -> int:
        key = _reached_key(index)
        assert self._board is not None
        return int(self._board.get(key)) if self._board.check([key]) else 0

    def commit(self) -> bool:
        """Every live group's vote: True when the step's collectives succeeded everywhere (then apply it)."""
        return self._manager.should_commit()

    def set_step(self, step: int) -> None:
        """The committed steps so far, after a checkpoint load (every live group loads the same one)."""
        self._manager.load_state_dict({"step": step, "batches_committed": step})

    def close(self) -> None:
        """Leave: heartbeats stop, so the lighthouse drops this group from the next quorum (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._manager.shutdown(wait=False)
        self._store.close()
        self._board = self._board_reader = None


def _reached_key(index: int) -> str:
    return f"reached/{index}"


def _ended_key(index: int) -> str:
    return f"ended/{index}"


def _compute_key(index: int) -> str:
    return f"compute/{index}"


def _evicted_key(index: int) -> str:
    return f"evicted/{index}"


def _replica_index(replica_id: str) -> int:
    """torchft's replica id of a group: ``replica_<index>:<uuid>``."""
    return int(replica_id.split(":", 1)[0].removeprefix("replica_"))


def _kill(lighthouse: str, replica_id: str, timeout_s: float) -> Ended:
    """Tell the lighthouse to end a replica group (torchft's kill route: its manager process exits at
    once); ``hung`` when the order reached a live process, ``frozen`` when it got no answer."""
    url = f"{lighthouse}/replica/{urllib.parse.quote(replica_id)}/kill"
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=timeout_s).close()
    except urllib.error.HTTPError:  # the manager exits before it answers: the lighthouse reports an error
        return "hung"
    except OSError:  # no answer in time (the process is stopped), or no lighthouse to ask
        return "frozen"
    return "hung"


class _QuorumMembers:
    """torchft's manager client, keeping the replica ids of the last quorum (the manager does not)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.ids: list[str] = []

    def _quorum(self, **kwargs: Any) -> Any:
        result = self._client._quorum(**kwargs)
        self.ids = list(result.replica_ids)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def tensor_bytes(value: Any) -> int:
    """The bytes of every tensor in a nested state (what a healing transfer carries)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _on_host(address: str, host: str) -> str:
    """``address`` (host:port, as torchft advertises it) with its host replaced by ``host``."""
    return Endpoint(host, int(address.rsplit(":", 1)[1])).target


def _transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, advertising this worker's node address (its own advertises
    the machine's hostname, which other nodes may not resolve, or resolve to their own loopback) and
    loading what a peer sends as weights only: torchft unpickles it whole (``weights_only=False``), so
    anything that can answer on a peer's port could run code in the joining worker. The healing state
    is tensors and plain values (``train/healing.py``), which the weights-only loader reads."""
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class NodeAddressedTransport(HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{Endpoint(host, port).target}/checkpoint/"

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as response:
                return _streaming_load(response, weights_only=True)

    return NodeAddressedTransport(timeout=timeout, num_chunks=0)


def _process_group(device: torch.device, timeout: timedelta, host: str) -> Any:
    """torchft's reconfigurable process group, its rendezvous store advertised at this worker's node
    address (torchft advertises the machine's hostname, as its HTTP transport does)."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    base = ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo

    class NodeAddressedProcessGroup(base):  # type: ignore[misc, valid-type]
        def get_reconfigure_handle(self) -> str:
            handle = json.loads(super().get_reconfigure_handle())
            handle["store"] = _on_host(handle["store"], host)
            return json.dumps(handle)

        def reconfigure(self, opts: Any) -> Any:
            # torchft drops the old group here, and gloo's destructor waits for a collective still in
            # flight: one a late peer never joined would hold the new quorum for the whole timeout.
            # The old group is let go on a thread of its own instead, which takes the only reference to
            # it: had this thread kept one (a local) past that thread's end, the destructor would run here.
            # Not a daemon: a process that ends while gloo's threads still wait in that collective aborts
            # (std::terminate), so its exit waits for the collective to end (the peer resumes, or timeout_s).
            if self._pg is not None:  # type: ignore[has-type]
                held: list[Any] = [self._pg]  # type: ignore[has-type]
                self._pg = None
                threading.Thread(target=_let_go, args=(held,), name="meshtrain-old-replica-group").start()
            return super().reconfigure(opts)

    return NodeAddressedProcessGroup(timeout=timeout)


def _let_go(held: list[Any]) -> None:
    """Abort the old process group in ``held`` and drop it: its destructor, which waits for a collective
    a late peer never joined (until that peer resumes, or the collective's timeout), runs on this thread."""
    group = held.pop()
    group.abort()


class _GroupStore:
    """The replica group's own key-value store for its manager: served by group rank 0, its port
    handed to the group's other ranks over the group's process group."""

    def __init__(self, host: str, group_rank: int, group_size: int) -> None:
        port = torch.zeros(1, dtype=torch.int64)
        self._store: dist.TCPStore | None = None
        if group_rank == 0:
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port[0] = self._store.port
        if group_size > 1:
            dist.broadcast(port, src=0)
        self.port = int(port.item())

    def close(self) -> None:
        self._store = None
