"""Hostile case of tenants' isolation (issue 45, H2), with a server of its own.

- `tenants_apart`: a server with API keys for two tenants (acme with two keys, bravo with one) and
  an operator key, and no admin token, so a loopback client is trusted: the setting where tenant b's
  key read tenant a's recent requests, every key id and every tenant's quotas and counts from
  `/console/api/state` (and `?tenant=a` filtered to a on request), and anyone read every tenant's
  series from `/metrics`. acme sends requests over HTTP and gRPC with request ids it chose
  (successes, a refused input, an unknown model), all recorded (`--slow-request-ms 1`). Then bravo,
  from loopback, calls every route of `/openapi.json` (each method, its key as `X-API-Key` and as a
  bearer token, the console's state with `?tenant=` of acme, of nobody and of the keyless) and every
  gRPC call it can make, and each answer is searched for acme's request ids, key ids and tenant name
  (the figures of a tenant carry its name) and the operator key's id. The control: the operator key
  sees acme's request ids in the console and acme's series in /metrics, so the search would have
  found them. Bound: no answer to bravo holds any of them; bravo still sees its own requests.

    python -m bench.hostile --attacks "" --cases tenants_apart
"""

from __future__ import annotations

import re
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from tritonclient.grpc import InferenceServerClient, InferenceServerException, InferInput

from bench.hostile_cases import CaseResult, case
from bench.processes import HOST, ServerProcess, free_port

SECRETS = {"acme-1": "acme-one-secret-0123456789", "acme-2": "acme-two-secret-0123456789",
           "bravo-1": "bravo-one-secret-0123456789", "ops": "operator-secret-0123456789ab"}
KEYS_FILE = (f"acme-1:{SECRETS['acme-1']} tenant=acme weight=3 concurrency=7\n"
             f"acme-2:{SECRETS['acme-2']} tenant=acme\n"
             f"bravo-1:{SECRETS['bravo-1']} tenant=bravo\n"
             f"ops:{SECRETS['ops']} role=operator\n")
MODEL_SOURCE = textwrap.dedent('''
    class Doubler:
        def setup(self, config):
            pass

        def execute(self, inputs):
            return {"y": inputs["x"] * 2.0}
''')
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}
#: What acme's data looks like in any answer: its request ids and tenant name ("acme"), its key ids
#: (acme-1, acme-2), and the operator key's id as a key id or a label value.
LEAK = re.compile(r"acme|\bops\b")
#: Path parameters filled in for the routes of /openapi.json.
PATH_VALUES = {"name": "echo", "version": "1", "tenant": "acme"}


def write_repository(root: Path) -> Path:
    """The one python model `echo` (x [2] -> y = 2 x)."""
    directory = root / "echo"
    directory.mkdir(parents=True)
    (directory / "doubler.py").write_text(MODEL_SOURCE)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "doubler.py", "max_batch_size": 4,
        "python": {"entry": "doubler:Doubler"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}]}))
    return root


def acme_traffic(url: str, grpc_url: str) -> list[str]:
    """acme's requests, each with a request id it chose; the ids."""
    ids = []
    with httpx.Client(base_url=url, timeout=30) as http:
        for n, (key, path, body) in enumerate((
                ("acme-1", "/v2/models/echo/infer", BODY), ("acme-2", "/v2/models/echo/infer", BODY),
                ("acme-1", "/v2/models/echo/infer", {"inputs": []}),  # 422: a failure it caused
                ("acme-2", "/v2/models/nothing-here/infer", BODY))):  # 404: a refusal
            request_id = f"acme-private-request-{n}"
            http.post(path, json=body, headers={"X-API-Key": SECRETS[key], "X-Request-ID": request_id})
            ids.append(request_id)
    x = InferInput("x", [1, 2], "FP32")
    x.set_data_from_numpy(np.array([[1.0, 2.0]], dtype=np.float32))
    with InferenceServerClient(grpc_url) as client:
        for n, model in enumerate(("echo", "nothing-here")):
            request_id = f"acme-private-grpc-{n}"
            try:
                client.infer(model, [x], headers={"x-api-key": SECRETS["acme-1"], "x-request-id": request_id})
            except InferenceServerException:
                pass  # the unknown model: a refusal, recorded all the same
            ids.append(request_id)
    return ids


def http_probes(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, str]]]:
    """(method, path with query, params) of every route in the server's OpenAPI document, and the
    console's state with `?tenant=` of another tenant, of none and of the keyless."""
    probes: list[tuple[str, str, dict[str, str]]] = []
    for template, operations in spec["paths"].items():
        path = re.sub(r"\{(\w+)\}", lambda m: PATH_VALUES[m.group(1)], template)
        probes.extend((method.upper(), path, {}) for method in operations)
    probes.extend(("GET", "/console/api/state", {"recent": "200", "tenant": tenant})
                  for tenant in ("acme", "nobody", "-", "bravo"))
    probes.extend([("GET", "/console/api/state", {"recent": "200", "model": "echo"}), ("GET", "/", {})])
    return probes


def grpc_probes(grpc_url: str, credentials: dict[str, str]) -> list[tuple[str, str]]:
    """Every gRPC call bravo can make: (call, what it answered as text)."""
    answers = []
    with InferenceServerClient(grpc_url) as client:
        calls = {
            "ServerMetadata": lambda: client.get_server_metadata(headers=credentials, as_json=True),
            "ModelMetadata": lambda: client.get_model_metadata("echo", headers=credentials, as_json=True),
            "ModelConfig": lambda: client.get_model_config("echo", headers=credentials, as_json=True),
            "RepositoryIndex": lambda: client.get_model_repository_index(headers=credentials, as_json=True),
            "ModelStatistics": lambda: client.get_inference_statistics("echo", headers=credentials, as_json=True),
            "RepositoryModelUnload": lambda: client.unload_model("nothing-here", headers=credentials),
        }
        for name, call in calls.items():
            try:
                answers.append((name, f"OK {call()}"))
            except InferenceServerException as exc:
                answers.append((name, f"{exc.status()} {exc.message()}"))
    return answers


@case("tenants_apart")
def tenants_apart(workdir: Path) -> CaseResult:
    """H2: tenant b's key reads nothing of tenant a through any HTTP route or gRPC call."""
    repository = write_repository(workdir / "repository")
    (workdir / "keys.txt").write_text(KEYS_FILE)
    port, grpc_port = free_port(), free_port()
    server = ServerProcess("servewell-hostile-tenants", [
        sys.executable, "-m", "servewell", "serve", "--host", HOST, "--port", str(port),
        "--grpc-port", str(grpc_port), "--model-repository", str(repository),
        "--api-keys-file", str(workdir / "keys.txt"), "--slow-request-ms", "1",
        "--cache-dir", str(workdir / "cache")], port, workdir / "server.log")
    server.start()
    leaks: list[dict[str, Any]] = []
    statuses: Counter[str] = Counter()
    try:
        server.wait_ready(180)
        grpc_url = f"{HOST}:{grpc_port}"
        acme_ids = acme_traffic(server.url, grpc_url)
        bravo = {"X-API-Key": SECRETS["bravo-1"], "X-Request-ID": "bravo-own-request"}
        httpx.post(server.url + "/v2/models/echo/infer", json=BODY, headers=bravo, timeout=30)
        operator = {"Authorization": f"Bearer {SECRETS['ops']}"}
        with httpx.Client(base_url=server.url, timeout=30) as http:
            # The control: the operator sees acme's ids (the engine's view pulls the ingress processes').
            deadline = time.monotonic() + 20
            recorded: set[str] = set()
            while not set(acme_ids) <= recorded and time.monotonic() < deadline:
                seen = http.get("/console/api/state", params={"recent": "200"}, headers=operator).json()
                recorded = {r["request_id"] for r in seen["recent"] + seen["refusals"]["recent"]}
                time.sleep(0.2)
            operator_sees = sorted(set(acme_ids) & recorded)
            operator_metrics = 'tenant="acme"' in http.get("/metrics", headers=operator).text
            spec = http.get("/openapi.json").json()
            probes = http_probes(spec)
            for form in ({"X-API-Key": SECRETS["bravo-1"]}, {"Authorization": f"Bearer {SECRETS['bravo-1']}"}):
                for method, path, params in probes:
                    answer = http.request(method, path, params=params, headers=form,
                                          json={} if method in ("POST", "PATCH") else None)
                    statuses[f"{method} {path} {answer.status_code}"] += 1
                    found = sorted(set(LEAK.findall(answer.text)))
                    if found:
                        leaks.append({"call": f"{method} {path}", "params": params, "status": answer.status_code,
                                      "found": found})
            own = http.get("/console/api/state", params={"recent": "200"}, headers={"X-API-Key": SECRETS["bravo-1"]})
            sees_own = "bravo-own-request" in {r["request_id"] for r in (own.json().get("recent") or [])}
        for form in ({"x-api-key": SECRETS["bravo-1"]}, {"authorization": f"Bearer {SECRETS['bravo-1']}"}):
            for call, text in grpc_probes(grpc_url, form):
                statuses[f"grpc {call} {text.split(' ', 1)[0]}"] += 1
                found = sorted(set(LEAK.findall(text)))
                if found:
                    leaks.append({"call": f"grpc {call}", "status": text[:80], "found": found})
    finally:
        server.stop()
    controls_hold = len(operator_sees) == len(acme_ids) and operator_metrics
    return CaseResult(
        "tenants_apart",
        "tenant bravo's key (from loopback, no admin token configured) reads none of tenant acme's request ids, "
        "key ids, tenant name or figures, nor the operator key's id, through any route of /openapi.json (every "
        "method, key as X-API-Key and as bearer, the console with ?tenant= of acme) or gRPC call; bravo sees its "
        "own requests, and the operator key sees acme's (the search would have found them)",
        passed=not leaks and sees_own and controls_hold,
        figures={"leaks": leaks, "bravo_sees_own_requests": sees_own,
                 "control": {"operator_sees_acme_ids": operator_sees, "operator_metrics_name_acme": operator_metrics},
                 "acme_request_ids": acme_ids, "http_calls": sum(v for k, v in statuses.items() if k[0] != "g"),
                 "answers": dict(sorted(statuses.items()))})
