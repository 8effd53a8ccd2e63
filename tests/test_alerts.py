"""The alert rules under promtool: they load, every alert has unit tests that fire and stay quiet
(deploy/prometheus/alerts_test.yaml), and those tests notice an alert that is broken."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.prometheus import PrometheusMissing, binary, write_rules

ROOT = Path(__file__).resolve().parents[1]
UNIT_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yaml"

# (alert, text in its rule, replacement): each makes a firing case quiet or a quiet case fire, so
# the unit tests must fail on it. They pin the boundaries the issue names (0.5 % vs 2 % 5xx, a queue
# at its bound vs below it, no healthy replica) and the `for` durations.
MUTATIONS = [
    ("EncoderHighErrorRatio", "> 0.01", "> 0.004"),  # 0.5 % would page
    ("EncoderHighErrorRatio", "> 0.01", "> 0.03"),  # 2 % would not
    ("EncoderHighErrorRatio", "for: 5m", "for: 30s"),
    ("EncoderP99LatencyHigh", ") > 2", ") > 5.5"),
    ("EncoderP99LatencyHigh", ") > 2", ") > 0.01"),
    ("EncoderP99LatencyHigh", "histogram_quantile(0.99,", "histogram_quantile(0.95,"),
    ("EncoderQueueSaturated", ">= 115", ">= 100"),  # 100 of 128 is below the bound
    ("EncoderQueueSaturated", ">= 58", ">= 40"),
    ("EncoderQueueSaturated", ">= 115", ">= 129"),
    ("EncoderQueueSaturated", "for: 5m", "for: 1m"),  # a 3-minute burst would page
    ("EncoderSheddingLoad", "> 0.01", "> 0.004"),
    ("EncoderSheddingLoad", '{reason="overloaded"}', ""),  # any failure would count as shedding
    ("EncoderNoReadyReplicas", " or vector(0)", ""),  # silent when the family is gone
    ("EncoderNoReadyReplicas", "< 1", "< 2"),
    ("EncoderNoReadyReplicas", "for: 2m", "for: 0s"),
    ("EncoderReplicaRestarting", "> 2.5", "> 1.5"),  # scaling up and down would page
    ("EncoderReplicaRestarting", "> 2.5", "> 3.5"),
    ("EncoderReplicaMemoryGrowing", "> 12.5e6", "> 5e6"),
    ("EncoderReplicaMemoryGrowing", "for: 2h", "for: 30m"),  # a replica added would look like a leak
    ("EncoderReplicaMemoryGrowing", 'Component=~"ray::ServeReplica:.*:Encoder|ray::ProxyActor"', 'Component=~".+"'),
    ("EncoderOnCPUDespiteGPU", 'and on (instance) (sum by (instance) (ray_resources{Name="GPU"}) > 0)', ""),
    ("EncoderOnCPUDespiteGPU", 'provider!="CUDAExecutionProvider"', 'provider=~".+"'),
    ("EncoderModelLoadFailing", 'outcome="failed"', 'outcome=~".+"'),  # every load would page
    ("EncoderModelLoadFailing", "[10m]", "[1m]"),  # a failure seen for a minute only
    ("EncoderModelThrashing", "for: 5m", "for: 0s"),  # one eviction and a load would page
    ("EncoderModelThrashing", 'reason="memory"', 'reason="idle"'),
    ("EncoderModelThrashing", "(sum by (application, model) (increase(ray_encoder_model_evictions_total{reason=\"memory\"}[1m])) > 0.5)\n  and on (application, model)\n", ""),
]


@pytest.fixture(scope="module")
def promtool() -> str:
    try:
        return binary("promtool")
    except PrometheusMissing as exc:
        pytest.fail(str(exc), pytrace=False)


def alerts() -> dict[str, dict]:
    groups = yaml.safe_load((ROOT / "deploy" / "prometheus-rules.yaml").read_text())["spec"]["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def run_unit_tests(promtool: str, directory: Path, rules: dict | None = None,
                   only: str | None = None) -> subprocess.CompletedProcess:
    """promtool test rules on alerts_test.yaml (or on its tests of the alert `only`) beside the given
    (or the real) rule groups."""
    directory.mkdir(parents=True, exist_ok=True)
    if rules is None:
        write_rules(directory)
    else:
        (directory / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False, width=1000))
    unit_tests = yaml.safe_load(UNIT_TESTS.read_text())
    if only is not None:
        unit_tests["tests"] = [t for t in unit_tests["tests"]
                               if any(c["alertname"] == only for c in t.get("alert_rule_test", []))]
    (directory / UNIT_TESTS.name).write_text(yaml.safe_dump(unit_tests, sort_keys=False, width=1000))
    return subprocess.run([promtool, "test", "rules", str(directory / UNIT_TESTS.name)],
                          capture_output=True, text=True, timeout=120)


def test_rules_pass_promtool_check(promtool, tmp_path):
    rules = write_rules(tmp_path)
    result = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_local_prometheus_config_is_valid(promtool, tmp_path):
    write_rules(tmp_path)
    shutil.copy(ROOT / "deploy" / "prometheus" / "prometheus-local.yml", tmp_path)
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus-local.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    cases = [c for t in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    for name in alerts():
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c.get("exp_alerts") for c in mine), f"{name}: no unit test in which it fires"
        assert any(not c.get("exp_alerts") for c in mine), f"{name}: no unit test in which it stays quiet"
    assert {c["alertname"] for c in cases} <= set(alerts()), "a unit test names an alert that does not exist"


def test_alert_unit_tests_pass(promtool, tmp_path):
    result = run_unit_tests(promtool, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def mutated(name: str, change) -> dict:
    groups = yaml.safe_load((ROOT / "deploy" / "prometheus-rules.yaml").read_text())["spec"]["groups"]
    for group in groups:
        for i, rule in enumerate(group["rules"]):
            if rule.get("alert") == name:
                group["rules"][i] = change(rule)
    return {"groups": groups}


def test_unit_tests_catch_an_alert_that_never_or_always_fires(promtool, tmp_path):
    for name in alerts():
        for expr in ("vector(0) > 1", "vector(1)"):
            result = run_unit_tests(promtool, tmp_path / f"{name}-{expr[-1]}",
                                    mutated(name, lambda r: {**r, "expr": expr}), only=name)
            assert result.returncode != 0, f"{name} with expr {expr!r} still passes its unit tests"


@pytest.mark.parametrize(("name", "old", "new"), MUTATIONS, ids=[f"{n}: {o} -> {w}" for n, o, w in MUTATIONS])
def test_unit_tests_pin_each_threshold_and_duration(promtool, tmp_path, name, old, new):
    def change(rule: dict) -> dict:
        if old.startswith("for: "):
            assert rule.get("for") == old.removeprefix("for: "), f"{name} no longer has {old!r}: update MUTATIONS"
            return {**rule, "for": new.removeprefix("for: ")}
        assert old in rule["expr"], f"{old!r} is no longer in {name}: update MUTATIONS"
        return {**rule, "expr": rule["expr"].replace(old, new)}

    result = run_unit_tests(promtool, tmp_path, mutated(name, change), only=name)
    assert result.returncode != 0, f"{name} with {old!r} -> {new!r} still passes its unit tests"
