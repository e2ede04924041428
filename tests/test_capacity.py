"""The capacity preflight: pure packing of worker bundles onto nodes, the one-line error and the
waiting line, Ray's autoscaler state read through faked Ray calls, and two real launches on this
machine that ask for more CPUs than Ray has (a local Ray, and a `ray start` head joined through
RAY_ADDRESS) and exit 2 with one line instead of retrying forever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jobs import REPO, job_command, job_env
from meshtrain.cluster import capacity
from meshtrain.cluster.capacity import (
    Autoscaler,
    NodeGroup,
    check,
    max_workers,
    worker_bundle,
    worker_resources,
)
from meshtrain.config import ConfigError, ScalingConfig
from ports import free_port
from raynodes import RayNode, ray_env, wait_until

H100 = "accelerator_type:H100"
ERROR_PREFIX = "meshtrain: config error: "


def scaling(**settings: Any) -> ScalingConfig:
    return ScalingConfig(**settings)


# --- bundles -------------------------------------------------------------------------------------


def test_bundle_per_worker() -> None:
    assert worker_bundle(scaling(cpus_per_worker=0.5)) == {"CPU": 0.5}
    assert worker_bundle(scaling(use_gpu=True, cpus_per_worker=8)) == {"CPU": 8, "GPU": 1}
    assert worker_bundle(scaling(use_gpu=True, accelerator_type="H100")) == {"CPU": 1, "GPU": 1, H100: 0.001}


def test_bundle_is_what_ray_train_reserves() -> None:
    import ray.train

    settings = scaling(num_workers=4, use_gpu=True, cpus_per_worker=2, accelerator_type="H100")
    ray_scaling = ray.train.ScalingConfig(
        num_workers=4, use_gpu=True, resources_per_worker=worker_resources(settings), accelerator_type="H100"
    )
    assert ray_scaling._resources_per_worker_not_none == worker_bundle(settings)


# --- packing -------------------------------------------------------------------------------------

NODES = [{"CPU": 4.0}, {"CPU": 2.0}, {"CPU": 1.5}, {"CPU": 0.0}]


@pytest.mark.parametrize(
    ("strategy", "held"), [("PACK", 7), ("SPREAD", 7), ("STRICT_PACK", 4), ("STRICT_SPREAD", 3)]
)
def test_packing_per_strategy(strategy: str, held: int) -> None:
    assert max_workers(NODES, {"CPU": 1}, strategy) == held


def test_fractional_cpus_count_in_rays_fixed_point() -> None:
    # 0.3 / 0.1 is 2.9999999999999996 in floating point; Ray places three bundles.
    assert max_workers([{"CPU": 0.3}], {"CPU": 0.1}, "PACK") == 3
    assert max_workers([{"CPU": 2.0}] * 3, {"CPU": 0.75}, "PACK") == 6
    assert max_workers([{"CPU": 2.0}], {"CPU": 0.7}, "STRICT_PACK") == 2


def test_gpus_and_accelerator_types() -> None:
    h100 = {"CPU": 192.0, "GPU": 8.0, H100: 1.0}
    l4 = {"CPU": 96.0, "GPU": 8.0, "accelerator_type:L4": 1.0}
    head = {"CPU": 0.0}
    gpu = {"CPU": 1, "GPU": 1}
    assert max_workers([head, h100, h100, l4], gpu, "PACK") == 24
    assert max_workers([head, h100, h100, l4], {**gpu, H100: 0.001}, "PACK") == 16
    assert max_workers([head, h100, h100, l4], {**gpu, H100: 0.001}, "STRICT_PACK") == 8
    assert max_workers([head, l4], {**gpu, H100: 0.001}, "PACK") == 0
    assert max_workers([{"CPU": 4.0, "GPU": 8.0}], {"CPU": 1, "GPU": 1}, "PACK") == 4  # CPUs bind


def test_cluster_limits_cap_the_total() -> None:
    assert max_workers([{"CPU": 8.0, "GPU": 8.0}] * 4, {"CPU": 1, "GPU": 1}, "PACK", {"GPU": 20}) == 20


# --- the decision --------------------------------------------------------------------------------


def error(settings: ScalingConfig, nodes: list[dict[str, float]], autoscaler: Autoscaler | None) -> str:
    with pytest.raises(ConfigError) as raised:
        check(settings, nodes, autoscaler)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_fits_now() -> None:
    assert check(scaling(num_workers=2), [{"CPU": 2.0}], None) is None
    assert check(scaling(num_workers=2), [{"CPU": 2.0}], Autoscaler(None, {})) is None


def test_fixed_cluster_too_small() -> None:
    assert error(scaling(num_workers=4), [{"CPU": 2.0}], None) == (
        "scaling.num_workers=4 needs 4 CPUs (1 per worker, scaling.cpus_per_worker) but this Ray cluster has "
        "2 CPUs on 1 node and no autoscaler; lower scaling.num_workers to 2 or scaling.cpus_per_worker to 0.5"
    )


def test_fixed_cluster_packs_per_node() -> None:
    # 3 CPUs in all, but no node holds two 1-CPU workers: 0.75 lets each node hold two.
    message = error(scaling(num_workers=4), [{"CPU": 1.5}, {"CPU": 1.5}], None)
    assert "has 3 CPUs on 2 nodes and no autoscaler" in message
    assert message.endswith("lower scaling.num_workers to 2 or scaling.cpus_per_worker to 0.75")


def test_gpus_missing() -> None:
    message = error(scaling(num_workers=2, use_gpu=True), [{"CPU": 2.0}], None)
    assert message == (
        "scaling.num_workers=2 needs 2 CPUs (1 per worker, scaling.cpus_per_worker) and 2 GPUs "
        "(1 per worker, scaling.use_gpu) but this Ray cluster has 2 CPUs and 0 GPUs on 1 node "
        "and no autoscaler; add nodes that have these resources"
    )


def test_gpus_bind_so_no_cpu_advice() -> None:
    message = error(scaling(num_workers=16, use_gpu=True), [{"CPU": 192.0, "GPU": 8.0}], None)
    assert message.endswith(
        "has 192 CPUs and 8 GPUs on 1 node and no autoscaler; lower scaling.num_workers to 8"
    )


def test_strict_strategies() -> None:
    nodes = [{"CPU": 4.0}, {"CPU": 4.0}]
    spread = error(scaling(num_workers=4, placement_strategy="STRICT_SPREAD"), nodes, None)
    assert ", one per node (scaling.placement_strategy=STRICT_SPREAD) but" in spread
    assert spread.endswith("lower scaling.num_workers to 2 or use scaling.placement_strategy=PACK")
    packed = error(scaling(num_workers=6, placement_strategy="STRICT_PACK"), nodes, None)
    assert ", all on one node (scaling.placement_strategy=STRICT_PACK) but" in packed
    assert packed.endswith(
        "lower scaling.num_workers to 4 or scaling.cpus_per_worker to 0.6666 "
        "or use scaling.placement_strategy=PACK"
    )


def test_accelerator_type_missing() -> None:
    nodes = [{"CPU": 96.0, "GPU": 8.0, "accelerator_type:L4": 1.0}]
    message = error(scaling(num_workers=8, use_gpu=True, accelerator_type="H100"), nodes, None)
    assert " on H100 nodes (scaling.accelerator_type) but this Ray cluster has 96 CPUs and 8 GPUs " in message
    assert "(0 of them H100)" in message
    assert message.endswith("unset scaling.accelerator_type")


GPU_GROUP = NodeGroup("gpu", {"CPU": 192.0, "GPU": 8.0}, more=2)
HEAD = {"CPU": 0.0}


def test_autoscaler_can_grow_enough_waits() -> None:
    line = check(scaling(num_workers=16, use_gpu=True), [HEAD], Autoscaler((GPU_GROUP,), {}))
    assert line == (
        "[meshtrain] waiting for the cluster to provide 16 workers (0 fit now): scaling.num_workers=16 needs "
        "16 CPUs (1 per worker, scaling.cpus_per_worker) and 16 GPUs (1 per worker, scaling.use_gpu); "
        "its autoscaler may add 2 more 'gpu' nodes (192 CPUs and 8 GPUs each)"
    )


def test_autoscaler_cannot_grow_enough_fails() -> None:
    groups = (GPU_GROUP, NodeGroup("cpu", {"CPU": 8.0}, more=None))
    message = error(scaling(num_workers=24, use_gpu=True), [HEAD], Autoscaler(groups, {}))
    assert "has 0 CPUs and 0 GPUs on 1 node and its autoscaler may add 2 more 'gpu' nodes" in message
    assert "any number of 'cpu' nodes (8 CPUs and 0 GPUs each)" in message
    assert message.endswith("lower scaling.num_workers to 16")


def test_autoscaler_limits() -> None:
    unlimited = Autoscaler((NodeGroup("gpu", {"CPU": 192.0, "GPU": 8.0}, more=None),), {"GPU": 12})
    message = error(scaling(num_workers=16, use_gpu=True), [HEAD], unlimited)
    assert message.endswith("lower scaling.num_workers to 12")
    assert check(scaling(num_workers=12, use_gpu=True), [HEAD], unlimited) is not None


def test_autoscaler_of_unknown_reach_waits() -> None:
    line = check(scaling(num_workers=4), [{"CPU": 2.0}], Autoscaler(None, {}))
    assert line is not None
    assert line.startswith("[meshtrain] waiting for the cluster to provide 4 workers (2 fit now): ")
    assert "an autoscaler runs but does not publish which nodes it may add" in line


# --- reading Ray's state (Ray calls faked) -------------------------------------------------------


def test_read_cluster_config_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray._private.state import state
    from ray.core.generated import autoscaler_pb2

    config = autoscaler_pb2.ClusterConfig(
        node_group_configs=[
            autoscaler_pb2.NodeGroupConfig(name="gpu", resources={"CPU": 192, "GPU": 8}, max_count=4),
            autoscaler_pb2.NodeGroupConfig(name="cpu", resources={"CPU": 8}, max_count=-1),
        ],
        max_resources={"GPU": 24},
    )
    monkeypatch.setattr(state, "get_cluster_config", lambda: config)
    nodes = [{"Labels": {}}, {"Labels": {"ray.io/node-group": "gpu"}}]
    assert capacity.read_autoscaler(nodes) == Autoscaler(
        (NodeGroup("gpu", {"CPU": 192, "GPU": 8}, 3), NodeGroup("cpu", {"CPU": 8}, None)), {"GPU": 24}
    )


@pytest.mark.parametrize(
    ("v2", "mapping", "expected"),
    [
        (True, None, Autoscaler(None, {})),
        (False, {"ab12": "node_ab12", "cd34": "node_cd34"}, None),  # v1 read-only: a manual cluster
        (False, {"10.0.0.1": "ray.head.default", "10.0.0.2": "gpu"}, Autoscaler(None, {})),
        (False, None, Autoscaler(None, {})),  # no report from a monitor: may grow
    ],
    ids=["v2", "v1-read-only", "v1-node-types", "no-report"],
)
def test_read_autoscaler_kind(
    v2: bool, mapping: dict[str, str] | None, expected: Autoscaler | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray.autoscaler.v2.utils
    from ray._private.state import state

    monkeypatch.setattr(state, "get_cluster_config", lambda: None)
    monkeypatch.setattr(ray.autoscaler.v2.utils, "is_autoscaler_v2", lambda fetch_from_server: v2)
    report = None if mapping is None else {"node_type_mapping": mapping}
    monkeypatch.setattr(capacity, "_v1_report", lambda deadline: report)
    assert capacity.read_autoscaler([{"Labels": {}}]) == expected


def test_preflight_prints_the_waiting_line_once_and_quiets_ray_train(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    monkeypatch.setattr(ray, "nodes", lambda: [
        {"Alive": True, "Resources": {"CPU": 2.0}, "Labels": {}},
        {"Alive": False, "Resources": {"CPU": 64.0}, "Labels": {}},
    ])
    monkeypatch.setattr(capacity, "read_autoscaler", lambda nodes: Autoscaler(None, {}))
    # preflight sets os.environ itself: record a value first, so the undo also removes what it sets
    # (later tests' jobs inherit this process's environment).
    monkeypatch.setenv(capacity.START_TIMEOUT_ENV, "")
    monkeypatch.delenv(capacity.START_TIMEOUT_ENV)
    capacity.check_capacity(scaling(num_workers=4), local_ray=False)
    out, err = capsys.readouterr()
    assert err == "" and len(out.splitlines()) == 1
    assert out.startswith("[meshtrain] waiting for the cluster to provide 4 workers (2 fit now): ")
    assert os.environ[capacity.START_TIMEOUT_ENV] == "3600"

    monkeypatch.setenv(capacity.START_TIMEOUT_ENV, "120")  # the user's choice stays
    capacity.check_capacity(scaling(num_workers=4), local_ray=False)
    assert os.environ[capacity.START_TIMEOUT_ENV] == "120"


def test_preflight_reads_the_autoscaler_only_when_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0}, "Labels": {}}])
    monkeypatch.setattr(capacity, "read_autoscaler", lambda nodes: pytest.fail("read the autoscaler"))
    capacity.check_capacity(scaling(num_workers=2), local_ray=False)  # fits: nothing read
    with pytest.raises(ConfigError, match="and no autoscaler"):
        capacity.check_capacity(scaling(num_workers=4), local_ray=True)


# --- real launches -------------------------------------------------------------------------------

# Starting Ray is most of a launch: 20-55 s on this 2-CPU machine, depending on its other load.
# Before the preflight, this launch retried forever.
LAUNCH_TIMEOUT_S = 90


def too_many_workers(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Twice as many 1-CPU workers as this machine has CPUs (with a batch they divide)."""
    workers = 2 * (os.cpu_count() or 1)
    return subprocess.run(
        job_command(f"scaling.num_workers={workers}", f"train.global_batch_size={8 * workers}",
                    f"run.storage_path={tmp_path}"),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
    )


def assert_one_line_capacity_error(result: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    cpus = os.cpu_count() or 1
    workers = 2 * cpus
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert "TrainController" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    mentions = [line for line in lines if "scaling.num_workers" in line or line.startswith("meshtrain")]
    assert mentions == [
        f"{ERROR_PREFIX}scaling.num_workers={workers} needs {workers} CPUs "
        "(1 per worker, scaling.cpus_per_worker) "
        f"but this Ray cluster has {cpus} CPUs on 1 node and no autoscaler; "
        f"lower scaling.num_workers to {cpus} or scaling.cpus_per_worker to 0.5"
    ]
    assert lines[-1] == mentions[0]
    # Nothing trained, nor even prepared: the check runs before the data.
    assert not list(tmp_path.rglob("metrics.jsonl")) and not list(tmp_path.rglob("checkpoints"))
    assert not (tmp_path / "token_stores").exists()


def test_local_ray_too_small_exits_2_with_one_line(tmp_path: Path) -> None:
    assert_one_line_capacity_error(too_many_workers(tmp_path, job_env(own_ray=True)), tmp_path)


def test_joined_cluster_without_autoscaler_exits_2_with_one_line(tmp_path: Path) -> None:
    """A head started by hand (`ray start`), sized like the local Ray: its autoscaler v1 monitor is
    read-only, which the driver learns from the monitor's report."""
    port = free_port()
    env = ray_env(RAY_AUTH_MODE="token")  # Ray 2.60 clusters started with `ray start` require a token
    head = RayNode(
        ["--head", "--node-ip-address=127.0.0.1", f"--port={port}", f"--num-cpus={os.cpu_count() or 1}",
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
         "--include-dashboard=false", "--object-store-memory=200000000"],
        env=env, log=tmp_path / "head.log",
    ).start()
    try:
        address = f"127.0.0.1:{port}"
        probe = [sys.executable, "-c", "import ray; ray.init(logging_level='ERROR'); print(len(ray.nodes()))"]

        def joined() -> bool:
            joining = subprocess.run(
                probe, env={**env, "RAY_ADDRESS": address}, capture_output=True, timeout=60
            )
            return joining.returncode == 0

        wait_until(joined, timeout=120, what="the Ray head")
        storage = tmp_path / "runs"
        assert_one_line_capacity_error(too_many_workers(storage, {**env, "RAY_ADDRESS": address}), storage)
    finally:
        head.kill()
