"""The dashboard against a real Prometheus scraping a real run, and its queries' meaning in both
fault-tolerance modes.

Prometheus (Debian's package; .ci/run installs it) runs on loopback with cluster/prometheus.yml,
re-pointed at this test's run storage and scraping every second. A short job trains, loses a
worker to an injected SIGKILL and resumes. Afterwards every PromQL expression in
dashboards/meshtrain.json is evaluated over the job's time window as Grafana would, and must
return data; the values Prometheus holds must agree with metrics.jsonl.

Offline, promtool evaluates every expression on the series of one run trained in either mode (one
group of four workers, or two replica groups of two), which must show the same run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs import REPO, read_metrics, run_job
from meshtrain.observe.run_folder import (
    CheckpointLoadRecord,
    CheckpointSaveRecord,
    DownstreamEvalFailedRecord,
    DownstreamEvalRecord,
    MixtureRecord,
    TextSamplesRecord,
    TrainRecord,
)
from ports import free_port


DASHBOARD = REPO / "dashboards" / "meshtrain.json"
RUN = "observed"
SCRAPE_INTERVAL = "1s"
RATE_INTERVAL = "4s"  # what Grafana's $__rate_interval is for a 1s scrape interval


def prometheus_config(storage: Path) -> dict[str, Any]:
    """cluster/prometheus.yml with meshtrain's targets read from this test's storage, scraped every second."""
    config = yaml.safe_load((REPO / "cluster" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = SCRAPE_INTERVAL
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"ray", "meshtrain"}
    jobs["meshtrain"]["scrape_interval"] = SCRAPE_INTERVAL
    [discovery] = jobs["meshtrain"]["file_sd_configs"]
    shipped = "/mnt/shared/meshtrain-runs/"
    assert all(path.startswith(shipped) for path in discovery["files"]), discovery
    # The workers' and the drivers' targets files, in this test's storage.
    discovery["files"] = [str(storage / path.removeprefix(shipped)) for path in discovery["files"]]
    discovery["refresh_interval"] = "1s"
    jobs["ray"]["file_sd_configs"][0]["refresh_interval"] = "1s"
    # The copy lives elsewhere: its rule files are cluster/'s own, so the real Prometheus loads the alerts.
    config["rule_files"] = [str(REPO / "cluster" / rule) for rule in config.get("rule_files", [])]
    return config


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def range_query(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        return self.get("/api/v1/query_range", query=expr, start=start, end=end, step="1s")["result"]

    def instant(self, expr: str, at: float) -> dict[str, float]:
        """``{rank label or "": value}`` of an instant query."""
        result = self.get("/api/v1/query", query=expr, time=at)["result"]
        return {series["metric"].get("rank", ""): float(series["value"][1]) for series in result}


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, Path]]:
    binary = shutil.which("prometheus")
    assert binary, "Prometheus is not installed: apt-get install -y prometheus (.ci/run does this)"
    home = tmp_path_factory.mktemp("prometheus")
    storage = home / "runs"
    config = home / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(storage)))
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log = (home / "prometheus.log").open("w")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={home / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (home / "prometheus.log").read_text()
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Prometheus did not become ready in 60 s"
            time.sleep(0.25)
        yield Prometheus(url), storage
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def dashboard_queries() -> tuple[list[str], list[str]]:
    """(PromQL of every panel target, label_values() queries of the variables) in the dashboard."""
    exprs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    dashboard = json.loads(DASHBOARD.read_text())
    walk(dashboard["panels"])
    variables = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs, variables


def grafana_substitute(expr: str, window_s: float, run: str = RUN, rate_interval: str = RATE_INTERVAL) -> str:
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__range", f"{int(window_s)}s")
    expr = expr.replace("$run", re.escape(run))
    assert "$" not in expr, f"unhandled Grafana variable in {expr}"
    return expr


def test_dashboard_queries_return_data_from_a_real_run(prometheus: tuple[Prometheus, Path]) -> None:
    server, storage = prometheus
    exprs, variables = dashboard_queries()
    assert len(exprs) >= 20 and variables == ["label_values(meshtrain_step, run)"]
    # Grafana's provisioning files must find this dashboard where dashboards/ is mounted.
    provider = yaml.safe_load((REPO / "dashboards" / "dashboards" / "meshtrain.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/provisioning"
    datasource = yaml.safe_load((REPO / "dashboards" / "datasources" / "prometheus.yaml").read_text())
    assert datasource["datasources"][0]["type"] == "prometheus"

    base_port = free_port()
    started = time.time()
    job = run_job(  # its own Ray: the job's Prometheus scrapes the metrics of the Ray its driver started
        "train.steps=60", "train.log_every=5", "checkpoint.interval=20",
        "fault.kill_rank=1", "fault.at_step=30",
        # Downstream evaluation of every checkpoint (20, 40, 60) in Ray tasks beside the workers; step 20's
        # task fails (an injected crash): one line, and training and the later evaluations go on.
        "eval.downstream.tasks=[meshtrain_mc,meshtrain_ppl]", "eval.downstream.include_path=tests/data/downstream",
        "eval.downstream.limit=4", "eval.downstream.num_cpus=0.01", "eval.samples.prompts=[import os]",
        "fault.downstream_fail_step=20",
        # Two sources in two stages: the data row's panels (shares per source, the stage).
        "data.sources=[{source: stdlib, name: code}, {source: stdlib, name: few, max_documents: 40}]",
        "data.stages=[{name: warm, until_step: 10, weights: {code: 1}}, {name: main, weights: {code: 1, few: 1}}]",
        f"run.storage_path={storage}", f"run.name={RUN}",
        f"metrics.port={base_port}", "metrics.bind_address=127.0.0.1", "metrics.final_scrape_timeout_s=5",
        timeout=400, own_ray=True,
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    ended = time.time() + 2
    time.sleep(2)
    window = ended - started
    records = read_metrics(storage / RUN)
    logged = [r for r in records if isinstance(r, TrainRecord)]
    saves = [r for r in records if isinstance(r, CheckpointSaveRecord)]
    loads = [r for r in records if isinstance(r, CheckpointLoadRecord)]
    assert logged[-1].step == 60 and len(loads) == 1 and loads[0].step == 20
    assert json.loads((storage / "prometheus" / f"{RUN}.json").read_text()) == []  # the job ended
    assert json.loads((storage / "prometheus" / "driver" / f"{RUN}.json").read_text()) == []

    scored = [r for r in records if isinstance(r, DownstreamEvalRecord)]
    empty = []
    for expr in exprs:
        series = server.range_query(grafana_substitute(expr, window), started, ended)
        if not any(value != "NaN" for s in series for _, value in s["values"]):
            empty.append(expr)
    assert not empty, f"{len(empty)} dashboard queries returned no data: {empty}"
    assert RUN in server.get("/api/v1/label/run/values", **{"match[]": "meshtrain_step"})

    def last(selector: str) -> dict[str, float]:
        """``{rank: value}`` of a metric (or a selector left open: ``name{label="x"``) at the end."""
        selector = selector + ", " if "{" in selector else selector + "{"
        return server.instant(f'last_over_time({selector}run="{RUN}"}}[{int(window) + 60}s])', ended)

    assert last("meshtrain_step") == {"0": 60.0, "1": 60.0}
    # Restart mode's one group is replica group 0; the driver's series (the run's goodput) have no replica.
    replicas = "/api/v1/label/replica/values"
    assert server.get(replicas, **{"match[]": f'meshtrain_step{{run="{RUN}"}}'}) == ["0"]
    assert server.get(replicas, **{"match[]": f'meshtrain_goodput_ratio{{run="{RUN}"}}'}) == []
    assert last('meshtrain_data_stage{stage="main"') == {"0": 1.0} and last('meshtrain_data_stage{stage="warm"') == {"0": 0.0}
    mixed = [r for r in records if isinstance(r, MixtureRecord)][-1]
    assert mixed.stage == "main" and last('meshtrain_data_source_share{source="few"')["0"] == pytest.approx(
        mixed.sources["few"], rel=1e-12)
    assert last("meshtrain_loss")["0"] == pytest.approx(logged[-1].loss, rel=1e-12)
    assert last("meshtrain_learning_rate")["0"] == pytest.approx(logged[-1].lr, rel=1e-12)
    assert last("meshtrain_grad_norm")["0"] == pytest.approx(logged[-1].grad_norm, rel=1e-12)
    assert last("meshtrain_run_tokens")["0"] == logged[-1].tokens
    assert last("meshtrain_tokens_per_second")["0"] == pytest.approx(logged[-1].tokens_per_s / 2, rel=1e-12)
    assert last("meshtrain_run_restarts") == {"0": 1.0, "1": 1.0}
    assert last("meshtrain_checkpoint_step")["0"] == saves[-1].step == 60
    assert last("meshtrain_checkpoint_size_bytes")["0"] == saves[-1].bytes
    assert last("meshtrain_checkpoint_save_duration_seconds")["0"] == pytest.approx(saves[-1].total_s, rel=1e-12)
    assert last("meshtrain_checkpoint_load_duration_seconds")["0"] == pytest.approx(loads[0].load_s, rel=1e-12)
    assert last("meshtrain_workers") == {"0": 2.0, "1": 2.0}
    assert last("meshtrain_mesh_shard_degree")["0"] == 2 and last("meshtrain_mesh_replicate_degree")["0"] == 1
    # The restarted group trained steps 21-60 (it resumed from step 20), half of each step's tokens per rank.
    per_rank_step = logged[-1].tokens / 60 / 2
    assert last("meshtrain_tokens_total") == {"0": 40 * per_rank_step, "1": 40 * per_rank_step}
    assert last("meshtrain_step_duration_seconds_count") == {"0": 40.0, "1": 40.0}

    # The driver's evaluations landed in metrics.jsonl and the run folder, and the driver exported each
    # as it landed: step 60's too, which finishes after the workers are gone.
    assert sorted((r.step, r.task) for r in scored) == [
        (step, task) for step in (40, 60) for task in ("meshtrain_mc", "meshtrain_ppl")], scored
    assert all((storage / RUN / "downstream" / f"step-{step:08d}" / "results.json").is_file() for step in (40, 60))
    assert sorted(r.step for r in records if isinstance(r, TextSamplesRecord)) == [40, 60]
    [failed] = [r for r in records if isinstance(r, DownstreamEvalFailedRecord)]
    assert failed.step == 20 and failed.error.startswith("RuntimeError: fault.downstream_fail_step=20"), failed
    assert job.stdout.count("[meshtrain] downstream evaluation of step 20 failed (RuntimeError: ") == 1, job.stdout[-3000:]
    assert "training is not affected" in job.stdout
    assert "[meshtrain] sample step 60: 'import os' -> " in job.stdout, job.stdout[-3000:]
    summary = json.loads((storage / RUN / "summary.json").read_text())
    assert {task: r["step"] for task, r in summary["downstream"].items()} == {"meshtrain_mc": 60, "meshtrain_ppl": 60}
    for task in ("meshtrain_mc", "meshtrain_ppl"):
        assert last(f'meshtrain_downstream_step{{task="{task}"') == {"": 60.0}, task
    [final] = [r for r in scored if r.step == 60 and r.task == "meshtrain_mc"]
    assert last('meshtrain_downstream_score{task="meshtrain_mc", metric="acc"') == {"": pytest.approx(final.scores["acc"], rel=1e-12)}

    # The driver's goodput: live while the run trained, and its final value (summary.json's) scraped before
    # the driver closed its endpoint. The restart cost this run its gap and the steps after step 20 once more.
    goodput = summary["goodput"]
    assert last("meshtrain_goodput_ratio") == {"": pytest.approx(goodput["goodput"], rel=1e-12)}
    lost = {cause: seconds for cause, seconds in goodput["lost_s"].items()}
    assert lost["restarts"] > 0 and lost["redone"] > 0 and lost["start_up"] > 0, goodput
    assert last('meshtrain_lost_seconds{cause="redone"') == {"": pytest.approx(lost["redone"], rel=1e-12)}
    assert goodput["productive_s"] + sum(lost.values()) == pytest.approx(goodput["wall_s"], rel=1e-3)
    assert f"[meshtrain] goodput {goodput['goodput']:.1%} of {goodput['wall_s']:.1f}s (lost: " in job.stdout

    # Ray's own metrics flow through Ray's service discovery file in the same Prometheus.
    # Ray lists several targets (each node's metrics agent, the dashboard's): one answering is enough.
    ray_up = server.instant(f'max(max_over_time(up{{job="ray"}}[{int(window) + 60}s]))', ended)
    assert ray_up == {"": 1.0}, f"no Ray metrics target was scraped: {ray_up}"


# --- the queries in both fault-tolerance modes, offline ------------------------------------------

# One run trained two ways: restart mode's one group of 4 workers (shard 2 x tensor 2), and
# fault_tolerance.mode=replica's two replica groups of 2 workers (shard 2), each group training its
# share of every step's samples. Each worker trains the same quarter of each step's tokens; every rank
# of every group reports the run's step, loss, tokens and evaluation; the first group's rank 0 commits
# the checkpoints; each group's rank 0 reports the data mixture; the one group restarted twice, each
# replica group once. The driver serves the goodput and downstream scores, with no replica label.
MODES = {"restart": [("0", rank) for rank in range(4)], "replica": [(group, rank) for group in "01" for rank in range(2)]}
SAMPLES = 21  # one every 15 s, from 0 to 5 minutes
EVAL_AT, SYNTHETIC_RATE, SYNTHETIC_RANGE = "5m", "1m", 300

# What each per-run query shows of that run at EVAL_AT, in either mode: {(panel, refId): (labels
# besides run, value)}. A sum of what every worker reports alike, or one group's part of what the
# groups add up to, shows a different value in one mode or both.
EXPECTED: dict[tuple[str, str], tuple[dict[str, str], float]] = {
    ("Step", "A"): ({}, 21),
    ("Tokens trained", "A"): ({}, 86016),
    ("Workers reporting / in groups / requested", "A"): ({}, 4),
    ("Workers reporting / in groups / requested", "B"): ({}, 4),
    ("Workers reporting / in groups / requested", "C"): ({}, 4),
    ("Mesh (replicate x shard)", "A"): ({}, 1),
    ("Mesh (replicate x shard)", "B"): ({}, 2),
    ("Restarts", "A"): ({}, 2),
    ("Last checkpoint step", "A"): ({}, 10),
    ("Loss (train and validation)", "A"): ({}, 2.75),
    ("Loss (train and validation)", "B"): ({}, 3.5),
    ("Loss (train and validation)", "C"): ({"source": "code"}, 3.25),
    ("Learning rate", "A"): ({}, 2**-10),
    ("Gradient norm", "A"): ({}, 0.5),
    ("Tokens/s (run total)", "A"): ({}, 4 * 1024 / 15),
    ("MFU", "A"): ({}, 0.4375),
    ("MFU", "B"): ({}, 0.25),
    ("MFU", "C"): ({}, 0.6875),
    ("Step time", "A"): ({}, 0.3125),  # every step in (0.125, 0.5]: interpolated
    ("Step time", "B"): ({}, 0.48125),
    ("Step time", "C"): ({}, 0.25),
    ("Checkpoint time", "A"): ({}, 0.25),
    ("Checkpoint time", "B"): ({}, 2),
    ("Checkpoint time", "C"): ({}, 1.5),
    ("Checkpoint size", "A"): ({}, 2**20),
    ("Checkpoints committed", "A"): ({}, 2),
    ("Skipped steps", "A"): ({}, 1),
    ("Rank compute slowdown (straggler = 1)", "B"): ({}, 1),
    ("Downstream scores (lm-evaluation-harness)", "A"): ({"task": "arc_easy", "metric": "acc"}, 0.5),
    ("Last downstream step", "A"): ({"task": "arc_easy"}, 10),
    ("Goodput (productive step time / wall time)", "A"): ({}, 0.75),
    ("Lost time by cause", "A"): ({"cause": "restarts"}, 8),
    ("Share of samples per source", "A"): ({"source": "code"}, 0.75),
    ("Data stage", "A"): ({"stage": "main"}, 1),
    ("Rollbacks and left-out samples", "A"): ({}, 1),
    ("Rollbacks and left-out samples", "B"): ({}, 8),
}


def synthetic_run(run: str, workers: list[tuple[str, int]]) -> list[dict[str, str]]:
    """promtool input series of ``run``'s workers (``(replica, rank)`` each) and driver."""
    series: list[dict[str, str]] = []

    def add(name: str, labels: dict[str, str], values: str) -> None:
        text = ",".join(f'{key}="{value}"' for key, value in labels.items())
        series.append({"series": f"{name}{{{text}}}", "values": values})

    def constant(value: float) -> str:
        return f"{value}x{SAMPLES - 1}"

    def stepped(at: int, value: float) -> str:
        """0 until sample ``at``, then ``value``."""
        return f"0x{at - 1} {value}x{SAMPLES - at - 1}"

    groups = {group for group, _ in workers}
    for index, (group, rank) in enumerate(workers):
        node = f"10.0.{index // 2}.1"
        worker = {"job": "meshtrain", "instance": f"{node}:{9800 + index % 2}", "run": run, "replica": group,
                  "rank": str(rank), "node": node}
        writer = index == 0  # the first group's rank 0 commits the run's checkpoints
        for name, values in {
            "meshtrain_step": f"1+1x{SAMPLES - 1}",
            "meshtrain_run_tokens": f"4096+4096x{SAMPLES - 1}",
            "meshtrain_loss": f"4-0.0625x{SAMPLES - 1}",
            "meshtrain_learning_rate": constant(2**-10),
            "meshtrain_grad_norm": constant(0.5),
            "meshtrain_workers": constant(len(workers) // len(groups)),
            "meshtrain_workers_requested": constant(len(workers)),
            "meshtrain_mesh_replicate_degree": constant(1),
            "meshtrain_mesh_shard_degree": constant(2),
            "meshtrain_run_restarts": constant(2 // len(groups)),
            "meshtrain_tokens_total": f"0+1024x{SAMPLES - 1}",
            "meshtrain_tokens_per_second": constant(1024 / 15),
            "meshtrain_mfu_ratio": constant(0.25 + index / 8),
            "meshtrain_mfu_full_attention_ratio": constant(0.5 + index / 8),
            "meshtrain_step_duration_seconds_sum": f"0+0.25x{SAMPLES - 1}",
            "meshtrain_step_duration_seconds_count": f"0+1x{SAMPLES - 1}",
            "meshtrain_data_wait_seconds_total": f"0+{index / 16}x{SAMPLES - 1}",
            "meshtrain_process_resident_memory_bytes": constant(2**30 + index),
            "meshtrain_checkpoint_load_duration_seconds": constant(1.5),
            "meshtrain_checkpoint_saves_total": f"0x4 1x5 2x{SAMPLES - 12}" if writer else constant(0),
            "meshtrain_skipped_steps_total": stepped(10, 1),
            "meshtrain_rank_slowdown_ratio": constant(1 + index / 8),
            "meshtrain_straggler": constant(int(index == 3)),
            "meshtrain_rollbacks_total": stepped(12, 1),
            "meshtrain_left_out_samples_total": stepped(12, 8),
        }.items():
            add(name, worker, values)
        for le, values in (("0.125", constant(0)), ("0.5", f"0+1x{SAMPLES - 1}"), ("+Inf", f"0+1x{SAMPLES - 1}")):
            add("meshtrain_step_duration_seconds_bucket", {**worker, "le": le}, values)
        for source, loss in (("all", 3.5), ("code", 3.25)):
            add("meshtrain_eval_loss", {**worker, "source": source}, constant(loss))
        if group == "0":  # the writer's group is held up by its saves; the other group never saves
            add("meshtrain_checkpoint_save_blocking_seconds", worker, constant(0.25))
        if writer:
            add("meshtrain_checkpoint_save_duration_seconds", worker, constant(2))
            add("meshtrain_checkpoint_size_bytes", worker, constant(2**20))
        if rank == 0:  # each group's first worker
            add("meshtrain_checkpoint_step", worker, constant(10))  # the step it loaded, or saved
            add("meshtrain_data_source_share", {**worker, "source": "code"}, constant(0.75))
            add("meshtrain_data_stage", {**worker, "stage": "main"}, constant(1))
    driver = {"job": "meshtrain", "instance": "10.0.9.1:40000", "run": run}
    add("meshtrain_goodput_ratio", driver, constant(0.75))
    add("meshtrain_lost_seconds", {**driver, "cause": "restarts"}, constant(8))
    add("meshtrain_downstream_score", {**driver, "task": "arc_easy", "metric": "acc"}, constant(0.5))
    add("meshtrain_downstream_step", {**driver, "task": "arc_easy"}, constant(10))
    return series


def test_every_dashboard_query_shows_the_same_run_in_either_fault_tolerance_mode(tmp_path: Path) -> None:
    """fault_tolerance.mode=replica: the replica groups' workers differ only by the replica label (each group
    has ranks 0..k-1). A query of a per-run value must neither add up what every group reports alike (step,
    tokens, loss) nor take one group's part of what the groups add up to (tokens/s, the world size, the
    restarts): every per-run query shows the same values of the same run trained either way. A per-worker
    panel has a series per worker, its legend naming the run, the replica group and the rank."""
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed: apt-get install -y prometheus (.ci/run does this)"
    dashboard = json.loads(DASHBOARD.read_text())
    targets = [(panel["title"], target) for panel in dashboard["panels"] for target in panel.get("targets", [])]
    per_worker = [(title, target) for title, target in targets if "{{rank}}" in target["legendFormat"]]
    assert {title for title, _ in per_worker} == {"Tokens/s per rank", "Data wait", "Memory per rank",
                                                  "Rank compute slowdown (straggler = 1)"}
    assert {(title, target["refId"]) for title, target in targets if (title, target) not in per_worker} == set(EXPECTED)
    checks: list[dict[str, Any]] = []
    for title, target in targets:
        for run in MODES:
            expr = grafana_substitute(target["expr"], SYNTHETIC_RANGE, run, SYNTHETIC_RATE)
            if (title, target) in per_worker:
                assert all(f"{{{{{label}}}}}" in target["legendFormat"] for label in ("run", "replica", "rank")), title
                # One series per worker, told apart by the labels of the legend.
                checks += [{"expr": f"count({expr})", "exp_samples": [{"labels": "{}", "value": 4}]},
                           {"expr": f"count(count by (run, replica, rank) ({expr}))", "exp_samples": [{"labels": "{}", "value": 4}]}]
            else:
                labels, value = EXPECTED[title, target["refId"]]
                text = ", ".join(f'{key}="{value}"' for key, value in {"run": run, **labels}.items())
                # In millionths: promtool compares floats exactly, and a quantile's interpolation rounds.
                checks.append({"expr": f"round(1e6 * ({expr}))",
                               "exp_samples": [{"labels": f"{{{text}}}", "value": round(1e6 * value)}]})
    tests = {"rule_files": [], "evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [series for run, workers in MODES.items() for series in synthetic_run(run, workers)],
        "promql_expr_test": [{**check, "eval_time": EVAL_AT} for check in checks],
    }]}
    path = tmp_path / "dashboard_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([binary, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout[-8000:] + result.stderr[-2000:]
