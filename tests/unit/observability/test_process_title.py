"""Process titles (observability/process_title.py): the 15-byte name `top` shows for each title."""

from __future__ import annotations

from servewell.observability.process_title import COMM_BYTES, short_name


def test_each_role_has_a_short_name_that_fits_the_kernels_15_bytes() -> None:
    assert short_name("servewell engine") == "sw-engine"
    assert short_name("servewell ingress 3") == "sw-ingress-3"
    assert short_name("servewell worker digits v1 #0") == "sw-digits#0"
    assert short_name("servewell spare worker") == "sw-spare-worker"
    long = short_name("servewell worker a-very-long-model-name v12 #11")
    assert long == "sw-a-very-lo#11" and len(long.encode()) <= COMM_BYTES  # the instance always shows
    assert short_name("python") == "python"
