"""The bare Prometheus rule groups of deploy/prometheus-rules.yaml (a PrometheusRule manifest), for a
Prometheus without the Operator and for promtool, which read `groups:` only.

    python deploy/prometheus/rules.py DIR   # writes DIR/rules.yaml (what alerts_test.yaml names)
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

MANIFEST = Path(__file__).resolve().parents[1] / "prometheus-rules.yaml"


def rule_groups(manifest: Path = MANIFEST) -> dict:
    """{"groups": [...]} from the manifest's spec."""
    return {"groups": yaml.safe_load(manifest.read_text())["spec"]["groups"]}


def write_rules(directory: Path, manifest: Path = MANIFEST) -> Path:
    """Write DIR/rules.yaml and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump(rule_groups(manifest), sort_keys=False, width=1000))
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(write_rules(Path(sys.argv[1])))
