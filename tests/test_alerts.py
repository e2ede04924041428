"""The Prometheus alerting rules (cluster/alerts.yml), offline.

- promtool (Debian's prometheus package, which .ci/run installs) accepts the rules and passes their
  unit tests, cluster/alerts_test.yml: synthetic series for every alert's fault and healthy cases.
- Every alert has a firing and a non-firing case in those tests, and the conventions operators
  rely on: a ``for:``, a severity, and a summary and description that name the run.
- Every metric the rules read is one meshtrain exports (docs/observability.md's metrics table, and
  observe/metrics.py), and cluster/prometheus.yml loads the rules.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
RULES = CLUSTER / "alerts.yml"
RULE_TESTS = CLUSTER / "alerts_test.yml"
PROMETHEUS_CONFIG = CLUSTER / "prometheus.yml"

HISTOGRAM_SUFFIXES = ("_sum", "_count", "_bucket")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict[str, Any]]:
    [group] = load_yaml(RULES)["groups"]
    assert group["name"] == "meshtrain"
    return [rule for rule in group["rules"] if "alert" in rule]


@pytest.fixture(scope="module")
def promtool() -> str:
    # The same convention as tests/test_prometheus.py: a missing binary fails, it does not skip.
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed: apt-get install -y prometheus (.ci/run does this)"
    return binary


def run_promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_promtool_accepts_the_rules(promtool: str) -> None:
    result = run_promtool(promtool, "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(load_yaml(RULES)['groups'][0]['rules'])} rules found" in result.stdout


def test_rule_unit_tests_pass(promtool: str) -> None:
    result = run_promtool(promtool, "test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and "FAILED" not in result.stdout


def test_every_alert_follows_the_conventions() -> None:
    rules = alert_rules()
    names = {rule["alert"] for rule in rules}
    assert names == {
        "MeshtrainTrainingStalled",
        "MeshtrainStepsSkipped",
        "MeshtrainLossNotFinite",
        "MeshtrainStraggler",
        "MeshtrainCheckpointStale",
        "MeshtrainWorkersMissing",
        "MeshtrainTargetDown",
    }
    for rule in rules:
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), name
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        for annotation in ("summary", "description"):
            assert "{{ $labels.run }}" in rule["annotations"][annotation], (name, annotation)
    # Two rules may share a name only if a label tells their alerts apart in Alertmanager.
    for name in names:
        label_sets = [tuple(sorted(r["labels"].items())) for r in rules if r["alert"] == name]
        assert len(set(label_sets)) == len(label_sets), name


def series_runs(test: dict[str, Any]) -> set[str]:
    """The run labels of a test's input series."""
    return {m for s in test["input_series"] for m in re.findall(r'\brun="([^"]*)"', s["series"])}


def test_every_alert_has_firing_and_quiet_cases() -> None:
    names = {rule["alert"] for rule in alert_rules()}
    tests = load_yaml(RULE_TESTS)["tests"]
    assert load_yaml(RULE_TESTS)["rule_files"] == ["alerts.yml"]
    fires, silent_at, silent_runs = set(), set(), set()
    for test in tests:
        runs = series_runs(test)
        evaluations = test.get("alert_rule_test", [])
        for name in {e["alertname"] for e in evaluations}:
            assert name in names, f"alerts_test.yml checks {name}, which alerts.yml does not define"
            expected = [a for e in evaluations if e["alertname"] == name for a in e["exp_alerts"] or []]
            if expected:
                fires.add(name)
            if any(not e["exp_alerts"] for e in evaluations if e["alertname"] == name):
                silent_at.add(name)  # an evaluation at which nothing fires
            # A run in the input series that no evaluation expects this alert for: a healthy case
            # that every evaluation of the test asserts to be quiet.
            if runs - {a["exp_labels"].get("run") for a in expected}:
                silent_runs.add(name)
    assert names - fires == set(), "alerts with no firing case"
    assert names - silent_at == set(), "alerts with no evaluation where nothing fires"
    assert names - silent_runs == set(), "alerts with no run that must not fire"


def readme_metrics() -> set[str]:
    """Metric names in docs/observability.md's metrics table, brace alternatives expanded."""
    names = set()
    for line in (REPO / "docs" / "observability.md").read_text().splitlines():
        if not line.startswith("| `meshtrain_"):
            continue
        first_cell = line.split("|")[1]
        for code in re.findall(r"`([^`]+)`", first_cell):
            braces = re.fullmatch(r"([a-z_]+)\{([a-z_,]+)\}([a-z_]*)", code)
            if braces and "," in braces[2]:  # meshtrain_cuda_memory_{allocated,reserved}_bytes
                names |= {braces[1] + part + braces[3] for part in braces[2].split(",")}
            elif braces and not braces[3]:  # meshtrain_eval_loss{source}: a label
                names.add(braces[1])
            else:
                names.add(code)
    return names


def test_rules_read_only_exported_metrics() -> None:
    documented = readme_metrics()
    assert {"meshtrain_step", "meshtrain_loss", "meshtrain_cuda_memory_reserved_bytes", "meshtrain_eval_loss"} <= documented
    used = set()
    for rule in alert_rules():
        text = " ".join([rule["expr"], *rule["annotations"].values()])
        for name in re.findall(r"meshtrain_[a-z_]+", text):
            for suffix in HISTOGRAM_SUFFIXES:
                if name.endswith(suffix) and name.removesuffix(suffix) in documented:
                    name = name.removesuffix(suffix)
            used.add(name)
    assert {"meshtrain_step", "meshtrain_step_duration_seconds", "meshtrain_loss", "meshtrain_straggler"} <= used
    undocumented = sorted(used - documented)
    assert not undocumented, f"alerts.yml reads metrics docs/observability.md's table does not list: {undocumented}"
    # ... and that the workers export: every name appears in the metrics module (counters without _total).
    source = (REPO / "platform" / "meshtrain" / "observe" / "metrics.py").read_text()
    unexported = sorted(name for name in used if f'"{name.removesuffix("_total")}"' not in source)
    assert not unexported, f"alerts.yml reads metrics that observe/metrics.py does not export: {unexported}"


def test_prometheus_config_loads_the_rules() -> None:
    config = load_yaml(PROMETHEUS_CONFIG)
    assert "alerts.yml" in config["rule_files"]
    for path in config["rule_files"]:
        assert (PROMETHEUS_CONFIG.parent / path).is_file(), path  # relative to the config file
    # MeshtrainTargetDown names the run of a down target: the run label of up comes from the
    # targets file's name, <run.name>.json, and a replica group's replica label too,
    # <run.name>.replica<N>.json (Prometheus anchors relabelling regexes at both ends, and a
    # replacement that comes out empty removes the label).
    [job] = [job for job in config["scrape_configs"] if job["job_name"] == "meshtrain"]
    relabels = job["relabel_configs"]
    assert [r["target_label"] for r in relabels] == ["run", "replica"]

    def target_labels(path: str) -> dict[str, str]:
        labels = {}
        for relabel in relabels:
            assert relabel["source_labels"] == ["__meta_filepath"] and relabel.get("action", "replace") == "replace"
            match = re.fullmatch(relabel["regex"], path)
            value = match.expand(re.sub(r"\$(\d)", r"\\g<\1>", relabel.get("replacement", "$1"))) if match else ""
            if value:
                labels[relabel["target_label"]] = value
        return labels

    folder = "/mnt/shared/meshtrain-runs/prometheus"
    assert target_labels(f"{folder}/llama3.8b-run.json") == {"run": "llama3.8b-run"}
    assert target_labels(f"{folder}/driver/llama3.8b-run.json") == {"run": "llama3.8b-run"}
    assert target_labels(f"{folder}/llama3.8b-run.replica12.json") == {"run": "llama3.8b-run", "replica": "12"}
    assert job["honor_labels"] is True  # the workers' own labels stay "run", "replica", not "exported_run"
