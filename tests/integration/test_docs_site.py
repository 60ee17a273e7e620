"""The documentation site builds strictly (no broken link or anchor, no page outside the nav), its
generated reference holds every setting, field, error code and metric, and the hand-written pages
name only flags, error codes and metrics that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from servewell.config.model import ModelConfig
from servewell.config.server import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import docs_reference  # noqa: E402 (scripts/ is not a package: the site's build loads it as a hook)


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return docs_reference.pages()


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    for page in ("reference/server-settings/index.html", "reference/errors/index.html", "changelog/index.html",
                 "how-to/rollouts/index.html", "search/search_index.json"):
        assert (tmp_path / "site" / page).is_file(), page
    changelog = (tmp_path / "site" / "changelog" / "index.html").read_text()
    assert "Unreleased" in changelog  # the CHANGELOG itself, included, not a link to it


def test_every_server_setting_and_model_field_is_on_its_reference_page(pages: dict[str, str]) -> None:
    settings = pages["reference/server-settings.md"]
    for row in docs_reference.walk_settings(ServerConfig):
        assert f"### `{row.path}`" in settings, row.path
    flags = docs_reference.serve_flags()
    for name in ServerConfig.model_fields:
        if name in flags:
            assert f"`{flags[name]}`" in settings, flags[name]
        assert f"`SERVEWELL_{name.upper()}`" in settings or name in ("alerting", "payload_log"), name
    fields = pages["reference/model-yaml.md"]
    for row in docs_reference.walk_settings(ModelConfig):
        assert f"### `{row.path}`" in fields, row.path


def test_every_error_code_is_on_the_errors_page(pages: dict[str, str]) -> None:
    errors = pages["reference/errors.md"]
    codes = {cls.code for cls in docs_reference.serve_errors()} | set(docs_reference.protocol_codes())
    assert {"load_failed", "model_loading", "engine_unavailable", "request_timeout"} <= codes
    for code in codes:
        assert f"`{code}`" in errors, code
    unexplained = set(docs_reference.protocol_codes()) - set(docs_reference.PROTOCOL_CODES)
    assert not unexplained, f"codes the HTTP layer answers without a line in PROTOCOL_CODES: {unexplained}"


def test_every_extra_is_explained(pages: dict[str, str]) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not set(extras) - set(docs_reference.EXTRA_PURPOSES), "an extra without its line in EXTRA_PURPOSES"
    for extra in extras:
        assert f"`servewell[{extra}]`" in pages["reference/extras.md"]


def test_the_metrics_page_lists_the_families_with_their_labels(pages: dict[str, str]) -> None:
    families = {family.name: family for family in docs_reference.metric_families()}
    assert families["servewell_requests_total"].labels == ("model", "lane", "outcome")
    assert families["servewell_queue_depth"].kind == "gauge"
    assert "servewell_process_restarts_total" in families and "servewell_payload_log_records_total" in families
    for name in families:
        assert f"`{name}`" in pages["reference/metrics.md"], name


def hand_written_pages() -> list[Path]:
    return [path for path in sorted((ROOT / "docs").rglob("*.md"))
            if not path.read_text().startswith("--8<--")] + [ROOT / "README.md"]


def test_the_hand_written_pages_name_only_flags_codes_and_metrics_that_exist(pages: dict[str, str]) -> None:
    # A renamed setting, code or metric leaves the prose behind: each name a page mentions must exist.
    flags = {option for sub in docs_reference.subcommands().values()
             for action in sub._actions for option in action.option_strings}  # noqa: SLF001
    flags |= {"--help", "--version", "--strict", "--find-links", "--extra-index-url", "--dev-addr", "--site-dir",
              "--outdir", "--build-context", "--network", "--stop-timeout", "--rm", "--runtime", "--out",
              "--attacks", "--cases", "--rounds", "--seconds", "--clients", "--minutes", "--scrape-every-s",
              "--tensors", "--ingress-processes", "--other-src", "--shadow-only", "--worker-nice",
                  "--step-ms"}
    metrics = {family.name for family in docs_reference.metric_families()}
    problems = []
    for page in hand_written_pages():
        text = page.read_text()
        for flag in set(re.findall(r"`(--[a-z][a-z0-9-]+)", text)) - flags:
            problems.append(f"{page.relative_to(ROOT)}: flag {flag}")
        for metric in set(re.findall(r"`(servewell_[a-z0-9_]+)", text)) - metrics:
            if not any(m.startswith(metric) for m in metrics):  # a family named by its prefix (`servewell_gpu_...`)
                problems.append(f"{page.relative_to(ROOT)}: metric {metric}")
    assert not problems, "\n".join(sorted(problems))
