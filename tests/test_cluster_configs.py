"""Cluster manifests (cluster/) and the GPU job configs they run, checked offline.

- The Ray cluster-launcher configs pass the JSON schema Ray ships and Ray's own
  ``validate_config`` (after ``prepare_config`` merged the provider defaults, as ``ray up`` does),
  and say what meshtrain needs: a head with 0 CPUs, autoscaled 8-GPU worker types, Ray metrics on
  port 8080, and the shared file system at the path the GPU configs write their runs to.
- The KubeRay manifests: kinds, autoscaling, replica bounds, the shared volume on every pod, the
  meshtrain and Ray metrics ports, Ray's own conversion of the RayCluster into an autoscaling
  config, and a RayJob entrypoint whose files exist and whose config fits the cluster it creates.
- Every GPU config passes ``--dry-run`` with the expected mesh and a per-rank memory plan that fits
  an 80 GB H100 with headroom.

Nothing here needs cloud credentials, a Kubernetes cluster or a GPU.
"""

from __future__ import annotations

import json
import re
import shlex
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.aws.config import _configure_subnets_and_groups_from_network_interfaces
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)
from ray.autoscaler._private.util import prepare_config, validate_config

from meshtrain.config import MetricsConfig
from meshtrain.config.loading import load_config
from meshtrain.config.schema import MeshtrainConfig
from test_cli import TOTAL, check_memory, parse_dry_run, run_pretrain

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
KUBERAY = CLUSTER / "kuberay"
LAUNCHER_CONFIGS = ["aws.yaml", "gcp.yaml"]
SHARED_MOUNT = "/mnt/shared"
RAY_METRICS_PORT = 8080
GPUS_PER_NODE = 8

# config file -> (replicate, shard, strategy, workers)
# name -> (the mesh line's dimensions, strategy, workers, data-parallel ranks)
GPU_CONFIGS = {
    "llama3_8b_1node.yaml": ("replicate=1, shard=8", "hybrid_shard", 8, 8),
    "llama3_8b_4nodes.yaml": ("replicate=4, shard=8", "hybrid_shard", 32, 32),
    "llama3_70b_16nodes.yaml": ("replicate=4, shard=4, tensor=8", "hybrid_shard", 128, 16),
    "llama3_8b_128k_context.yaml": ("replicate=4, shard=1, context=8", "hybrid_shard", 32, 4),
}
H100_GIB = 80e9 / 2**30  # "80 GB" is 74.5 GiB
# What the plan leaves out (CUDA context, NCCL buffers, allocator fragmentation, the output head
# gathered for the loss) needs room: the planned total must stay below this.
PLANNED_LIMIT_GIB = 72.0


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def gpu_config(name: str) -> MeshtrainConfig:
    return load_config(REPO / "jobs" / "configs" / name)


def largest_gpu_job() -> int:
    return max(gpu_config(name).scaling.num_workers for name in GPU_CONFIGS)


def gpu_accelerator_types() -> set[str]:
    return {gpu_config(name).scaling.accelerator_type for name in GPU_CONFIGS}


# --- Ray cluster launcher: cluster/aws.yaml, cluster/gcp.yaml ------------------------------------


@pytest.fixture(scope="module")
def ray_schema() -> dict:
    schema = json.loads((files("ray.autoscaler") / "ray-schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return schema


@pytest.fixture(scope="module", params=LAUNCHER_CONFIGS)
def launcher(request: pytest.FixtureRequest) -> tuple[str, dict]:
    return request.param, load_yaml(CLUSTER / request.param)


def worker_types(config: dict) -> dict[str, dict]:
    head = config["head_node_type"]
    return {name: t for name, t in config["available_node_types"].items() if name != head}


def ray_start_commands(config: dict) -> list[str]:
    commands = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    return [cmd for cmd in commands if "ray start" in cmd]


def initialization_commands(config: dict, node_type: str) -> list[str]:
    """What a node of this type runs first: its own list, else the global one (as Ray does)."""
    own = config["available_node_types"][node_type].get("initialization_commands")
    return config["initialization_commands"] if own is None else own


def test_launcher_config_matches_rays_schema(launcher: tuple[str, dict], ray_schema: dict) -> None:
    _, config = launcher
    jsonschema.validate(config, ray_schema)  # as written
    jsonschema.validate(prepare_config(config), ray_schema)  # with the provider's defaults merged


def test_launcher_config_passes_rays_validator(launcher: tuple[str, dict]) -> None:
    # What `ray up` runs before it talks to the cloud: defaults, setup-command merge, per-type
    # min/max workers, then the schema and the cross-field checks (head type, sum of min_workers).
    _, config = launcher
    prepared = prepare_config(config)
    validate_config(prepared)
    assert prepared["available_node_types"][prepared["head_node_type"]]["max_workers"] == 0
    for cmd in config["setup_commands"]:
        assert cmd in prepared["head_setup_commands"] and cmd in prepared["worker_setup_commands"]


def test_head_runs_no_training(launcher: tuple[str, dict]) -> None:
    _, config = launcher
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"]["CPU"] == 0
    assert "GPU" not in head["resources"]
    [head_start] = [cmd for cmd in config["head_start_ray_commands"] if "ray start" in cmd]
    assert "--head" in head_start and "--num-cpus=0" in head_start.split()


def test_autoscaled_gpu_worker_types(launcher: tuple[str, dict]) -> None:
    _, config = launcher
    workers = worker_types(config)
    assert workers
    for name, node_type in workers.items():
        low, high = node_type["min_workers"], node_type["max_workers"]
        assert isinstance(low, int) and isinstance(high, int), name
        assert 0 <= low <= high <= config["max_workers"], name
        assert node_type["resources"]["GPU"] == GPUS_PER_NODE, name
    assert config["max_workers"] >= sum(t["max_workers"] for t in workers.values())
    # Each accelerator a GPU config asks for is advertised by a type big enough for the largest job.
    for accelerator in gpu_accelerator_types():
        label = f"accelerator_type:{accelerator}"
        capable = [t for t in workers.values() if t["resources"].get(label) == 1]
        assert capable, accelerator
        assert max(t["max_workers"] for t in capable) * GPUS_PER_NODE >= largest_gpu_job()


def test_ray_metrics_port_is_fixed(launcher: tuple[str, dict]) -> None:
    _, config = launcher
    commands = ray_start_commands(config)
    assert len(commands) == 2  # head and workers
    for cmd in commands:
        assert f"--metrics-export-port={RAY_METRICS_PORT}" in cmd.split(), cmd


def test_shared_file_system_is_the_runs_storage(launcher: tuple[str, dict]) -> None:
    _, config = launcher
    for name in GPU_CONFIGS:
        storage = gpu_config(name).run.storage_path
        assert Path(storage).parent == Path(SHARED_MOUNT), (name, storage)
    storage_paths = {gpu_config(name).run.storage_path for name in GPU_CONFIGS}
    assert len(storage_paths) == 1
    [storage] = storage_paths
    for node_type in config["available_node_types"]:
        commands = " ".join(initialization_commands(config, node_type))
        assert re.search(rf"\bmount\b[^;]* {re.escape(SHARED_MOUNT)}(;|\s|$)", commands), node_type
        assert f"mkdir -p {storage}" in commands, node_type  # the runs folder, for the ssh user


def test_nodes_install_meshtrain_from_the_synced_repository(launcher: tuple[str, dict]) -> None:
    _, config = launcher
    assert config["file_mounts"] == {"~/meshtrain": "."}
    assert any("pip install -e ~/meshtrain" in cmd for cmd in config["setup_commands"])
    # Worker types' own initialization lists write the NCCL settings `ray start` reads.
    [worker_start] = [cmd for cmd in config["worker_start_ray_commands"] if "ray start" in cmd]
    assert ". ~/meshtrain-nccl.env" in worker_start
    for name in worker_types(config):
        commands = initialization_commands(config, name)
        assert any("~/meshtrain-nccl.env" in cmd for cmd in commands), name


def test_aws_p5_uses_all_efa_interfaces() -> None:
    config = load_yaml(CLUSTER / "aws.yaml")
    types = worker_types(config).values()
    [p5] = [t for t in types if t["node_config"]["InstanceType"] == "p5.48xlarge"]
    interfaces = p5["node_config"]["NetworkInterfaces"]
    assert sorted(i["NetworkCardIndex"] for i in interfaces) == list(range(32))
    assert {i["InterfaceType"] for i in interfaces} <= {"efa", "efa-only"}
    assert [i["InterfaceType"] for i in interfaces if i["NetworkCardIndex"] == 0] == ["efa"]
    # Ray's own check for node configs with NetworkInterfaces (every one has a subnet and groups).
    resolved = _configure_subnets_and_groups_from_network_interfaces(p5["node_config"])
    head_subnets = config["available_node_types"]["head"]["node_config"]["SubnetIds"]
    assert set(resolved["SubnetIds"]) == set(head_subnets)
    env = " ".join(p5["initialization_commands"])
    for setting in ("FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1", "NCCL_SOCKET_IFNAME="):
        assert setting in env, setting


# --- KubeRay: cluster/kuberay/ --------------------------------------------------------------------


@pytest.fixture(scope="module")
def raycluster() -> dict:
    return load_yaml(KUBERAY / "raycluster.yaml")


@pytest.fixture(scope="module")
def rayjob() -> dict:
    return load_yaml(KUBERAY / "rayjob.yaml")


@pytest.fixture(scope="module")
def shared_claim() -> dict:
    return load_yaml(KUBERAY / "storage.yaml")


def cluster_specs(raycluster: dict, rayjob: dict) -> list[tuple[str, dict]]:
    return [("RayCluster", raycluster["spec"]), ("RayJob", rayjob["spec"]["rayClusterSpec"])]


def gpu_group(spec: dict) -> dict:
    groups = [
        g
        for g in spec["workerGroupSpecs"]
        if g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
    ]
    assert len(groups) == 1
    return groups[0]


def pod_shared_mounts(pod_spec: dict, claim: str) -> set[str]:
    """Mount paths, in the Ray container, of the volume backed by ``claim``."""
    volumes = {
        v["name"]
        for v in pod_spec["volumes"]
        if v.get("persistentVolumeClaim", {}).get("claimName") == claim
    }
    mounts = pod_spec["containers"][0]["volumeMounts"]
    return {m["mountPath"] for m in mounts if m["name"] in volumes}


def start_param_resources(group: dict) -> dict[str, int]:
    """The ``resources`` rayStartParam, decoded as Ray's KubeRay autoscaler decodes it."""
    text = group["rayStartParams"].get("resources")
    return json.loads(text[1:-1].replace("\\", "")) if text else {}


def test_kuberay_kinds(raycluster: dict, rayjob: dict, shared_claim: dict) -> None:
    assert (raycluster["apiVersion"], raycluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert (rayjob["apiVersion"], rayjob["kind"]) == ("ray.io/v1", "RayJob")
    assert (shared_claim["apiVersion"], shared_claim["kind"]) == ("v1", "PersistentVolumeClaim")
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True
    for where, spec in cluster_specs(raycluster, rayjob):
        assert spec["enableInTreeAutoscaling"] is True, where
        assert spec["rayVersion"] == ray.__version__, where  # the pinned ray of pyproject.toml


def test_kuberay_head_and_gpu_group(raycluster: dict, rayjob: dict) -> None:
    for where, spec in cluster_specs(raycluster, rayjob):
        head = spec["headGroupSpec"]
        assert head["rayStartParams"]["num-cpus"] == "0", where
        assert head["rayStartParams"]["metrics-export-port"] == str(RAY_METRICS_PORT), where
        assert "dashboard-host" in head["rayStartParams"], where
        head_container = head["template"]["spec"]["containers"][0]
        head_ports = {p["containerPort"] for p in head_container["ports"]}
        assert {8265, RAY_METRICS_PORT} <= head_ports, where

        group = gpu_group(spec)
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], where
        container = group["template"]["spec"]["containers"][0]
        assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == str(GPUS_PER_NODE), where
        assert group["rayStartParams"]["metrics-export-port"] == str(RAY_METRICS_PORT), where
        ports = {p["containerPort"] for p in container["ports"]}
        base = MetricsConfig().port
        assert {RAY_METRICS_PORT, *range(base, base + GPUS_PER_NODE)} <= ports, where
        names = [p["name"] for p in container["ports"]]
        assert len(set(names)) == len(names) and all(len(n) <= 15 for n in names), where


def test_kuberay_shared_volume_on_every_pod(
    raycluster: dict, rayjob: dict, shared_claim: dict
) -> None:
    claim = shared_claim["metadata"]["name"]
    assert "ReadWriteMany" in shared_claim["spec"]["accessModes"]
    for where, spec in cluster_specs(raycluster, rayjob):
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        pods = [group["template"]["spec"] for group in groups]
        for pod in pods:
            assert pod_shared_mounts(pod, claim) == {SHARED_MOUNT}, where
    for name in GPU_CONFIGS:
        assert Path(gpu_config(name).run.storage_path).parent == Path(SHARED_MOUNT)


def test_ray_reads_the_raycluster_as_meant(raycluster: dict) -> None:
    # The conversion Ray's autoscaler applies to the RayCluster in the cluster; it ends in
    # validate_config against the same schema as the launcher configs.
    cr = {**raycluster, "metadata": {**raycluster["metadata"], "namespace": "default"}}
    autoscaling = _derive_autoscaling_config_from_ray_cr(cr)
    types = autoscaling["available_node_types"]
    head = types[autoscaling["head_node_type"]]
    assert head["resources"]["CPU"] == 0 and "GPU" not in head["resources"]
    group = gpu_group(raycluster["spec"])
    worker = types[group["groupName"]]
    assert worker["resources"]["GPU"] == GPUS_PER_NODE
    for accelerator in gpu_accelerator_types():
        assert worker["resources"][f"accelerator_type:{accelerator}"] == 1
    assert worker["max_workers"] * GPUS_PER_NODE >= largest_gpu_job()


def test_rayjob_cluster_matches_the_raycluster(raycluster: dict, rayjob: dict) -> None:
    cluster, job = raycluster["spec"], rayjob["spec"]["rayClusterSpec"]
    assert job["headGroupSpec"] == cluster["headGroupSpec"]
    assert job["rayVersion"] == cluster["rayVersion"]
    cluster_group, job_group = gpu_group(cluster), gpu_group(job)
    assert job_group["groupName"] == cluster_group["groupName"]
    assert job_group["rayStartParams"] == cluster_group["rayStartParams"]
    assert job_group["template"] == cluster_group["template"]


def rayjob_command(rayjob: dict) -> tuple[Path, list[str]]:
    """(config file, overrides) of the RayJob entrypoint, after checking its shape."""
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert argv[:2] == ["python", "jobs/pretrain.py"], argv
    assert argv.count("--config") == 1
    at = argv.index("--config")
    config_path = argv[at + 1]
    overrides = argv[2:at] + argv[at + 2 :]
    assert all("=" in item and not item.startswith("-") for item in overrides), overrides
    return REPO / config_path, overrides


def test_rayjob_entrypoint_runs_a_config_that_fits_its_cluster(rayjob: dict) -> None:
    runtime_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])
    assert isinstance(runtime_env, dict) and runtime_env["working_dir"]
    config_path, overrides = rayjob_command(rayjob)
    assert (REPO / "jobs" / "pretrain.py").is_file()
    assert config_path.is_file() and config_path.name in GPU_CONFIGS, config_path
    cfg = load_config(config_path, overrides)
    assert cfg.run.name  # a fixed name: re-creating the RayJob resumes the run
    group = gpu_group(rayjob["spec"]["rayClusterSpec"])
    assert cfg.scaling.num_workers == group["replicas"] * GPUS_PER_NODE
    assert cfg.scaling.num_workers <= group["maxReplicas"] * GPUS_PER_NODE
    assert cfg.scaling.workers_per_node == GPUS_PER_NODE
    assert start_param_resources(group) == {f"accelerator_type:{cfg.scaling.accelerator_type}": 1}


def test_every_referenced_repository_file_exists() -> None:
    referenced = set()
    for path in sorted(CLUSTER.rglob("*.yaml")):
        referenced |= set(re.findall(r"\bjobs/[\w./-]+\.(?:py|yaml)\b", path.read_text()))
    assert "jobs/pretrain.py" in referenced
    missing = sorted(ref for ref in referenced if not (REPO / ref).is_file())
    assert not missing, missing


# --- GPU job configs: --dry-run -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_gpu_config_dry_run_fits_an_h100(name: str) -> None:
    dims, strategy, workers, ranks = GPU_CONFIGS[name]
    result = run_pretrain("--config", f"jobs/configs/{name}", "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    config, lines, memory = parse_dry_run(result.stdout)
    check_memory(memory)
    assert config == gpu_config(name).model_dump(mode="json")
    assert config["scaling"]["use_gpu"] is True
    assert config["scaling"]["workers_per_node"] == GPUS_PER_NODE
    assert config["model"]["preset"] in ("llama3_8b", "llama3_70b")
    assert config["run"]["storage_path"] == f"{SHARED_MOUNT}/meshtrain-runs"
    assert config["checkpoint"]["enabled"] is True
    # The mesh, with no "assuming ..." note: workers_per_node is set.
    assert lines["mesh"] == f"mesh: ({dims}) on {workers} workers, strategy={strategy}, reshard_after_forward=True"
    assert f"x {ranks} {'workers' if ranks == workers else 'data-parallel ranks'} x " in lines["batch"]
    assert memory[TOTAL] < PLANNED_LIMIT_GIB < H100_GIB, memory


def test_rayjob_entrypoint_dry_run(rayjob: dict) -> None:
    config_path, overrides = rayjob_command(rayjob)
    result = run_pretrain("--config", str(config_path.relative_to(REPO)), *overrides, "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    config, _, memory = parse_dry_run(result.stdout)
    assert config["run"]["name"] == load_config(config_path, overrides).run.name
    assert memory[TOTAL] < PLANNED_LIMIT_GIB
