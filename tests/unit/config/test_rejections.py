"""Rejected configuration files as /healthz and the admin report show them."""

from __future__ import annotations

from pathlib import Path

from servewell.config.rejections import PRIVATE_REASON, RejectedFiles


def test_a_private_files_reasons_reach_the_admin_report_only() -> None:
    # Issue 45: a refused keys file's reason names key ids and tenants, and /healthz is open to anyone.
    rejected = RejectedFiles(clock=lambda: 100.0)
    rejected.reject(Path("/etc/sw/keys.txt"), "keys.txt", [("", "keys.txt: entry 3: the same key as keys.txt: "
                                                            "entry 2 (ids 'acme-1' and 'bravo-1')")], private=True)
    rejected.reject(Path("/srv/m/model.yaml"), "m/model.yaml", [("max_batch_size", "must be at least 1")])
    public = rejected.status()
    assert public["status"] == "degraded"
    assert [(r["file"], r["reason"]) for r in public["rejected"]] == [
        ("keys.txt", PRIVATE_REASON), ("m/model.yaml", "must be at least 1")]
    assert "acme" not in str(public) and "/etc/sw" not in str(public)
    admin = rejected.status(full_paths=True)
    assert "ids 'acme-1' and 'bravo-1'" in admin["rejected"][0]["reason"] and admin["rejected"][0]["path"]
