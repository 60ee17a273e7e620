#!/usr/bin/env python3
"""Writes components/monitoring/prometheusrule.yaml from deploy/prometheus/alerts.yml.

    python3 deploy/kubernetes/prometheusrule.py          # rewrite the PrometheusRule
    python3 deploy/kubernetes/prometheusrule.py --check  # exit 1 if it differs from alerts.yml

alerts.yml is the one source of the rules (promtool tests it); the PrometheusRule carries the same
groups for prometheus-operator. tests/integration/deploy/test_kubernetes_manifests.py fails when
they disagree. Needs PyYAML only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1]
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
TARGET = DEPLOY / "kubernetes" / "components" / "monitoring" / "prometheusrule.yaml"
HEADER = """\
# GENERATED from deploy/prometheus/alerts.yml by deploy/kubernetes/prometheusrule.py: edit alerts.yml
# (and its promtool tests in alerts_test.yml), then run `python3 deploy/kubernetes/prometheusrule.py`.
"""


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the longer PromQL expressions) as literal blocks, as people write them."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


def render(alerts_text: str) -> str:
    """The PrometheusRule document (with its header comment) for the rule groups of `alerts_text`."""
    groups = yaml.safe_load(alerts_text)["groups"]
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "servewell"},
        "spec": {"groups": groups},
    }
    return HEADER + yaml.dump(doc, Dumper=_BlockDumper, sort_keys=False, width=100, allow_unicode=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when out of date")
    args = parser.parse_args(argv)
    text = render(ALERTS.read_text(encoding="utf-8"))
    if args.check:
        if not TARGET.is_file() or TARGET.read_text(encoding="utf-8") != text:
            print(f"{TARGET} is out of date: run python3 {Path(__file__).relative_to(DEPLOY.parent)}", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
