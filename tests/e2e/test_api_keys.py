"""API keys for inference, over HTTP and gRPC, as an operator sets them up and a client uses them."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from error_bodies import error_code, error_of
from servewell.tenancy.keys import key_digest

TEAM_A = "team-a-secret-0123456789abcdef"
TEAM_B = "team-b-secret-0123456789abcdef"  # stored hashed, limited to 2 requests/s
ENV_KEY = "env-secret-0123456789abcdef"
NEW_KEY = "rotated-in-secret-0123456789"
ADMIN = "admin-token-is-not-an-api-key"
IMAGE = (Path(__file__).parents[2] / "src/servewell/examples/images/digit-3-200px.jpg").read_bytes()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, start_module_server, servewell_cache):
    keys_file = tmp_path_factory.mktemp("keys") / "api-keys.txt"
    keys_file.write_text(f"# servewell keys\nteam-a:{TEAM_A}\nteam-b:{key_digest(TEAM_B)} rate=2\n")
    server = start_module_server(["--cache-dir", str(servewell_cache), "--api-keys-file", str(keys_file),
                           "--admin-token", ADMIN, "--config-poll-s", "0.3"],
                          env={"SERVEWELL_API_KEYS": f"from-env:{ENV_KEY}"})
    server.wait_ready()
    server.keys_file = keys_file
    return server


def predict(server, headers: dict[str, str]) -> httpx.Response:
    import base64

    return httpx.post(server.url + "/predict", json={"image_base64": base64.b64encode(IMAGE).decode()},
                      headers=headers, timeout=30)


def test_inference_needs_a_key(keyed):
    for response in (predict(keyed, {}), httpx.get(keyed.url + "/v2/models/digits"),
                     httpx.post(keyed.url + "/v2/models/digits/infer", json={"inputs": []})):
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == 'Bearer realm="servewell"'
        assert error_code(response) == "unauthorized" and error_of(response)["request_id"]
    wrong = predict(keyed, {"Authorization": "Bearer not-a-valid-key-at-all"})
    assert wrong.status_code == 401 and 'error="invalid_token"' in wrong.headers["www-authenticate"]


def test_a_key_opens_inference_by_bearer_or_header(keyed):
    assert predict(keyed, {"Authorization": f"Bearer {TEAM_A}"}).json()["result"]["label"] == "3"
    assert predict(keyed, {"X-API-Key": TEAM_A}).status_code == 200
    assert predict(keyed, {"X-API-Key": ENV_KEY}).status_code == 200  # from SERVEWELL_API_KEYS
    assert httpx.get(keyed.url + "/v2/models/digits", headers={"X-API-Key": TEAM_A}).status_code == 200


def test_probes_stay_open_and_metrics_are_an_operators(keyed):
    for path in ("/healthz", "/v2/health/live", "/v2/health/ready", "/openapi.json"):
        assert httpx.get(keyed.url + path).status_code == 200, path
    # /metrics names every key and tenant with its counts: with keys, the admin token (or an operator key).
    assert httpx.get(keyed.url + "/metrics").status_code == 401
    refused = httpx.get(keyed.url + "/metrics", headers={"Authorization": f"Bearer {TEAM_A}"})
    assert refused.status_code == 403 and "operator key" in error_of(refused)["message"]
    assert httpx.get(keyed.url + "/metrics", headers={"X-API-Key": TEAM_A}).status_code == 403
    assert httpx.get(keyed.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200


def test_an_api_key_never_opens_admin_and_the_admin_token_never_opens_inference(keyed):
    assert httpx.get(keyed.url + "/admin/config", headers={"Authorization": f"Bearer {TEAM_A}"}).status_code == 403
    assert httpx.get(keyed.url + "/admin/config").status_code == 401
    assert httpx.get(keyed.url + "/admin/config", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert predict(keyed, {"Authorization": f"Bearer {ADMIN}"}).status_code == 401


def test_a_key_over_its_rate_gets_429_over_quota_with_retry_after(keyed):
    # A key's rate= is its tenant's (its own here): one bucket for the whole server, one 429 code.
    answers = [predict(keyed, {"X-API-Key": TEAM_B}) for _ in range(6)]
    codes = [r.status_code for r in answers]
    assert 200 in codes and 429 in codes, codes
    limited = next(r for r in answers if r.status_code == 429)
    assert error_code(limited) == "over_quota" and int(limited.headers["retry-after"]) >= 1
    assert "over its rate of 2 requests per second" in limited.json()["error"]["message"]
    assert predict(keyed, {"X-API-Key": TEAM_A}).status_code == 200  # other keys are not affected
    metrics = httpx.get(keyed.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    assert 'servewell_tenant_requests_total{result="over_rate",tenant="team-b"}' in metrics


def test_keys_never_reach_the_log_but_their_ids_do(keyed):
    predict(keyed, {"X-API-Key": TEAM_A})
    predict(keyed, {"X-API-Key": "not-a-valid-key-but-long-enough"})
    bad = httpx.post(keyed.url + "/predict", json={"image_base64": "not base64!"}, headers={"X-API-Key": TEAM_A})
    assert bad.status_code == 400  # logged once, with the caller's key id
    log = keyed.log()
    for secret in (TEAM_A, TEAM_B, ENV_KEY, ADMIN, "not-a-valid-key-but-long-enough"):
        assert secret not in log
    assert '"client":"team-a"' in log.replace(" ", "")


def test_grpc_uses_the_same_keys(keyed):
    x = np.zeros((1, 1, 8, 8), dtype=np.float32)
    tensor = triton_grpc.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    with triton_grpc.InferenceServerClient(keyed.grpc_url) as client:
        assert client.is_server_live()  # probes stay open
        with pytest.raises(InferenceServerException) as refused:
            client.infer("digits", [tensor])
        assert str(refused.value.status()) == "StatusCode.UNAUTHENTICATED"
        result = client.infer("digits", [tensor], headers={"authorization": f"Bearer {TEAM_A}"})
        assert result.as_numpy("logits").shape == (1, 10)


def test_keys_rotate_and_revoke_without_a_restart(keyed):
    pid = keyed.proc.pid
    keyed.keys_file.write_text(f"new:{NEW_KEY}\nteam-b:{key_digest(TEAM_B)} rate=2\n")  # team-a revoked
    deadline = time.monotonic() + 10
    while predict(keyed, {"X-API-Key": NEW_KEY}).status_code != 200:
        assert time.monotonic() < deadline, keyed.log()[-2000:]
        time.sleep(0.2)
    assert predict(keyed, {"X-API-Key": TEAM_A}).status_code == 401
    assert keyed.proc.pid == pid and keyed.proc.poll() is None
    report = httpx.get(keyed.url + "/admin/config", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert sorted(report["api_keys"]["ids"]) == ["from-env", "new", "team-b"]
    # A broken keys file is refused: the keys in force stay.
    keyed.keys_file.write_text("way-too-short\n")
    time.sleep(1.0)
    assert predict(keyed, {"X-API-Key": NEW_KEY}).status_code == 200
    assert "keys file rejected" in keyed.log()
