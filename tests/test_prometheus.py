"""The dashboard against a real Prometheus scraping a real run.

Prometheus (Debian's package; .ci/run installs it) runs on loopback with cluster/prometheus.yml,
re-pointed at this test's run storage and scraping every second. A short job trains, loses a
worker to an injected SIGKILL and resumes. Afterwards every PromQL expression in
dashboards/meshtrain.json is evaluated over the job's time window as Grafana would, and must
return data; the values Prometheus holds must agree with metrics.jsonl.
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


def grafana_substitute(expr: str, window_s: float) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__range", f"{int(window_s)}s")
    expr = expr.replace("$run", re.escape(RUN))
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
