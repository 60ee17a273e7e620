"""The issue's targets, evaluated on one run's measurements (reported, never asserted).

Every limit is computed from numbers measured in the same `make bench` run: offline
latencies from `bench.offline`, batch durations from the `compute` entry of the
`Server-Timing` header of the very requests being judged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.report import TargetRow

Results = dict[str, Any]


def _p(doc: dict | None, kind: str, q: str, field: str = "latency_ms") -> float | None:
    if doc is None:
        return None
    return doc["classes"].get(kind, {}).get(field, {}).get(q)


def _need(doc: dict, kind: str, q: str, field: str = "latency_ms") -> float:
    """A figure that a target is computed from; KeyError (the target reads "not measured") when absent."""
    value = _p(doc, kind, q, field)
    if value is None:
        raise KeyError(f"{kind} {field} {q}")
    return value


def _stages(doc: dict, kind: str, q: str = "p50") -> str:
    """Where the answered requests of a class spent their time, by the server's Server-Timing."""
    parts = [f"{stage} {_p(doc, kind, q, f'{stage}_ms')}" for stage in ("preprocess", "queue", "compute")]
    return f"{kind} {q} ms: " + ", ".join(parts) + f", outside the handler {_p(doc, kind, q, 'outside_server_ms')}"


def _na(key: str, name: str, why: str) -> TargetRow:
    return TargetRow(key, name, "-", "-", None, why)


def _guard(key: str, name: str, build: Callable[[], TargetRow]) -> TargetRow:
    try:
        return build()
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        return _na(key, name, f"not measured in this run ({type(exc).__name__}: {exc})")


def saturation_vs_offline(r: Results) -> TargetRow:
    """(1) served images/s at saturation >= 0.9 x offline limit (same runtime, same run)."""
    name = "resnet50 served img/s at saturation vs offline limit"

    def build() -> TargetRow:
        served = r["runs"][r["saturation"]["run"]]["throughput_rps"]
        offline = r["offline"]["resnet50"]
        limit = 0.9 * offline["limit_items_per_s"]
        pre = offline.get("preprocess_ms_per_image")
        runs = offline.get("limits_measured", [offline["limit_items_per_s"]])
        note = (f"offline best batch {offline['best_batch_size']} at {offline['limit_items_per_s']:.1f} img/s "
                f"({offline['threads']} threads; served as {r['settings'].get('served')}; "
                f"timed before and after the saturation run: "
                f"{', '.join(f'{x:.1f}' for x in runs)} img/s, the better one is the limit); "
                f"frontend decode+preprocess {pre} ms/img on one core")
        cpu = r["runs"][r["saturation"]["run"]].get("cpu_us_per_answer")
        if cpu:
            best_row = next(row for row in offline["batch_sizes"] if row["batch_size"] == offline["best_batch_size"])
            split = (f" (ingress {cpu['ingress'] / 1000:.1f} + engine {cpu['engine'] / 1000:.1f} + rest)"
                     if "ingress" in cpu else "")
            note += (f"; CPU ms per image: served frontend {cpu['frontend'] / 1000:.1f}{split} + worker "
                     f"{cpu['workers'] / 1000:.1f}, offline {best_row.get('cpu_ms_per_item')}; served max batch "
                     f"{r['settings'].get('served_max_batch_size')}, "
                     f"mean batch {r['runs'][r['saturation']['run']]['mean_batch_size']}")
        return TargetRow("1", name, f"{served:.1f} img/s ({served / offline['limit_items_per_s']:.2f}x)",
                         f">= {limit:.1f} (0.9 x {offline['limit_items_per_s']:.1f})", served >= limit, note)

    return _guard("1", name, build)


def mlp_vs_naive(r: Results) -> TargetRow:
    """(2) MLP requests/s >= 2 x the naive FastAPI server's, same load, same run."""
    name = "MLP req/s vs naive FastAPI (same closed-loop load)"

    def build() -> TargetRow:
        ours = [r["runs"][n]["throughput_rps"] for n in r["mlp_compare"]["servewell"]]
        naive = [r["runs"][n]["throughput_rps"] for n in r["mlp_compare"]["naive"]]
        a, b = sum(ours) / len(ours), sum(naive) / len(naive)
        note = f"{len(ours)} alternating runs each, {r['mlp_compare']['concurrency']} clients; per run " \
               f"servewell {[round(x) for x in ours]}, naive {[round(x) for x in naive]}"
        cpu = r["mlp_compare"].get("cpu_us_per_request")
        if cpu:
            ours_cpu, naive_cpu = cpu["servewell"], cpu["naive"]
            note += (f"; CPU us per request: servewell frontend {ours_cpu['frontend']} + worker "
                     f"{ours_cpu['workers']}, naive server {naive_cpu['naive']} (load generator "
                     f"{ours_cpu['loadgen']} / {naive_cpu['loadgen']})")
        return TargetRow("2", name, f"{a:.0f} vs {b:.0f} req/s ({a / b:.2f}x)", ">= 2.00x", a >= 2 * b, note)

    return _guard("2", name, build)


def urgent_shared(r: Results) -> TargetRow:
    """(3a) urgent p99 <= p99 running batch + 2 x batch-1 latency + 10 ms (one shared instance)."""
    name = "mixed 90%: urgent p99, shared instance"

    def build() -> TargetRow:
        run = r["runs"][r["mixed"]["shared"]]
        urgent = _need(run, "urgent", "p99")
        batch_p99 = _need(run, "normal", "p99", "compute_ms")
        b1 = r["offline"]["resnet50"]["batch1_latency_ms"]
        limit = batch_p99 + 2 * b1 + 10
        n = run["classes"]["urgent"]["latency_ms"]["n"]
        return TargetRow("3a", name, f"{urgent:.1f} ms (n={n})",
                         f"<= {limit:.1f} ({batch_p99:.1f} + 2x{b1:.1f} + 10)", urgent <= limit,
                         "running batch p99 = Server-Timing compute p99 of the normal requests in the same run; "
                         f"batch-1 latency from the offline run; {_stages(run, 'urgent', 'p99')}")

    return _guard("3a", name, build)


def urgent_reserved(r: Results) -> TargetRow:
    """(3b) with an instance reserved for urgent requests: urgent p99 <= 2 x batch-1 latency + 10 ms."""
    name = "mixed 90%: urgent p99, reserved instance"

    def build() -> TargetRow:
        run = r["runs"][r["mixed"]["reserved"]]
        urgent = _need(run, "urgent", "p99")
        b1 = r["offline"]["resnet50"]["batch1_latency_ms"]
        limit = 2 * b1 + 10
        n = run["classes"]["urgent"]["latency_ms"]["n"]
        b1_served = _p(run, "urgent", "p50", "compute_ms")
        return TargetRow("3b", name, f"{urgent:.1f} ms (n={n})", f"<= {limit:.1f} (2x{b1:.1f} + 10)",
                         urgent <= limit, f"instances 2 x {r['settings']['resnet50_threads']} threads, reserve on; "
                         f"urgent compute p50 while the other instance runs: {b1_served} ms; "
                         f"{_stages(run, 'urgent', 'p99')}")

    return _guard("3b", name, build)


def normal_unharmed(key: str, variant: str) -> Callable[[Results], TargetRow]:
    """(3c/3d) normal p99 with 5% urgent <= 1.1 x normal p99 without urgent traffic."""

    def target(r: Results) -> TargetRow:
        name = f"mixed 90%: normal p99 vs no urgent, {variant} instance"

        def build() -> TargetRow:
            mixed = _need(r["runs"][r["mixed"][variant]], "normal", "p99")
            base = _need(r["runs"][r["mixed"][f"{variant}_baseline"]], "normal", "p99")
            return TargetRow(key, name, f"{mixed:.1f} vs {base:.1f} ms ({mixed / base:.2f}x)", "<= 1.10x",
                             mixed <= 1.1 * base)

        return _guard(key, name, build)

    return target


def window_bound(r: Results) -> TargetRow:
    """(4a) open loop at 50%: window p99 <= max_wait + 2 x batch latency."""
    name = "open 50%: window p99"

    def build() -> TargetRow:
        run = r["runs"][r["half_load"]["window"]]
        p99 = _need(run, "normal", "p99")
        batch = _need(run, "normal", "p99", "compute_ms")
        wait = r["settings"]["max_wait_ms"]
        limit = wait + 2 * batch
        return TargetRow("4a", name, f"{p99:.1f} ms", f"<= {limit:.1f} ({wait:g} + 2x{batch:.1f})", p99 <= limit,
                         "batch latency = Server-Timing compute p99 in the same run")

    return _guard("4a", name, build)


def lower_than_window(key: str, policy: str) -> Callable[[Results], TargetRow]:
    """(4b/4c) open loop at 50%: idle and adaptive p99 below window's."""

    def target(r: Results) -> TargetRow:
        name = f"open 50%: {policy} p99 below window p99"

        def build() -> TargetRow:
            mine = _need(r["runs"][r["half_load"][policy]], "normal", "p99")
            window = _need(r["runs"][r["half_load"]["window"]], "normal", "p99")
            return TargetRow(key, name, f"{mine:.1f} ms", f"< {window:.1f} (window)", mine < window)

        return _guard(key, name, build)

    return target


def overload_targets(r: Results) -> list[TargetRow]:
    """(5) overload at 3x saturation: no crash, no 500, fast refusals, deadlines kept, RSS flat."""
    names = ["overload 3x: no crash, no 500", "overload 3x: refusal p99", "overload 3x: admitted within deadline",
             "overload 3x: RSS flat (frontend + workers)"]
    try:
        o = r["overload"]
        run = r["runs"][o["run"]]
    except (KeyError, TypeError):
        return [_na(f"5{c}", n, "not measured in this run") for c, n in zip("abcd", names, strict=True)]
    statuses = run["status_counts"]
    server_errors = sum(v for k, v in statuses.items() if k.startswith("5") and k != "503")
    client_errors = statuses.get("client", 0)  # no HTTP answer (reset, refused connection)
    crash_ok = o["alive_after"] and o["healthz_after"] == 200 and server_errors == 0 and o["worker_restarts"] == 0
    rows = [TargetRow(
        "5a", names[0], f"alive={o['alive_after']}, healthz={o['healthz_after']}, 5xx(non-503)={server_errors}, "
        f"restarts={o['worker_restarts']}", "alive, 200, 0, 0", crash_ok,
        f"{o['duration_s']:g} s at {run['offered_rps']:.0f} req/s offered (issue: 30 s; shortened to fit 10 min); "
        f"statuses {statuses}; connection errors {client_errors}; client_saturated {run['client_saturated']}",
    )]
    refusal = _p(run, "normal", "p99", "refusal_latency_ms")
    n_refused = run["classes"]["normal"]["refusal_latency_ms"]["n"]
    rows.append(TargetRow("5b", names[1], "-" if refusal is None else f"{refusal:.1f} ms (n={n_refused})",
                          "<= 5.0", None if refusal is None else refusal <= 5.0,
                          "from scheduled arrival to the 503 'overloaded' answer (issue 46's goal); the model is "
                          "named in the URL (/predict?model=), so a request its full lane refuses is answered "
                          f"before its body is read (admitted requests: preprocess p50/p99 "
                          f"{_p(run, 'normal', 'p50', 'preprocess_ms')}/"
                          f"{_p(run, 'normal', 'p99', 'preprocess_ms')} ms)"))
    over = run["classes"]["normal"].get("ok_over_deadline")
    ok = run["classes"]["normal"]["ok"]
    expired = run["error_codes"].get("deadline_exceeded", 0)
    rows.append(TargetRow("5c", names[2], f"{over} of {ok} ok over {o['deadline_ms']:g} ms; max "
                          f"{_p(run, 'normal', 'max')} ms", "0 over", over == 0,
                          f"{expired} answered 503 deadline_exceeded; max_queue_size {o['max_queue_size']}; "
                          + _stages(run, "normal", "p99")))
    before, after = o["rss_before"], o["rss_after"]
    growth = (after - before) / before if before else None
    rows.append(TargetRow("5d", names[3], f"{before / 2**20:.0f} -> {after / 2**20:.0f} MiB "
                          f"({growth * 100:+.1f}%)" if growth is not None else "-", "<= +10%",
                          None if growth is None else growth <= 0.10,
                          f"frontend {o['frontend_rss_before'] / 2**20:.0f} -> "
                          f"{o['frontend_rss_after'] / 2**20:.0f} MiB"))
    return rows


def evaluate(r: Results) -> list[TargetRow]:
    """Every target row, in the issue's order."""
    rows = [saturation_vs_offline(r), mlp_vs_naive(r), urgent_shared(r), urgent_reserved(r),
            normal_unharmed("3c", "shared")(r), normal_unharmed("3d", "reserved")(r), window_bound(r),
            lower_than_window("4b", "idle")(r), lower_than_window("4c", "adaptive")(r)]
    return rows + overload_targets(r)
