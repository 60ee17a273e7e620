"""The Kubernetes and KServe manifests in deploy/kubernetes, rendered by `kubectl kustomize` (offline)
and validated: core objects against the Kubernetes API schema (the `kubernetes-validate` package,
strict: unknown fields are errors), KServe, KEDA and prometheus-operator objects against those
projects' published CRD schemas (tests/data/crds, also strict). Then what a schema cannot say: the
objects agree with each other, with deploy/prometheus/alerts.yml and with the image.

kubectl comes with Debian's `kubectl` package; without it these tests fail rather than skip.
"""

from __future__ import annotations

import copy
import gzip
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
KUBE = ROOT / "deploy" / "kubernetes"
CRDS = ROOT / "tests" / "data" / "crds"
DOCKERFILE = ROOT / "deploy" / "container" / "Dockerfile"
#: The oldest Kubernetes the manifests are for (the preStop `sleep` action is on by default from
#: 1.30) and the newest whose schema kubernetes-validate ships.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
CRD_FILES = {
    ("serving.kserve.io", "ServingRuntime"): "kserve/serving.kserve.io_servingruntimes.yaml.gz",
    ("serving.kserve.io", "ClusterServingRuntime"): "kserve/serving.kserve.io_clusterservingruntimes.yaml.gz",
    ("serving.kserve.io", "InferenceService"): "kserve/serving.kserve.io_inferenceservices.yaml.gz",
    ("keda.sh", "ScaledObject"): "keda/keda.sh_scaledobjects.yaml.gz",
    ("monitoring.coreos.com", "ServiceMonitor"): "prometheus-operator/monitoring.coreos.com_servicemonitors.yaml.gz",
    ("monitoring.coreos.com", "PodMonitor"): "prometheus-operator/monitoring.coreos.com_podmonitors.yaml.gz",
    ("monitoring.coreos.com", "PrometheusRule"): "prometheus-operator/monitoring.coreos.com_prometheusrules.yaml.gz",
}
#: Trigger metadata KEDA's prometheus scaler reads (pkg/scalers/prometheus_scaler.go, v2.20).
KEDA_PROMETHEUS_KEYS = {
    "serverAddress",
    "query",
    "queryParameters",
    "threshold",
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "unsafeSsl",
    "awsRegion",
    "timeout",
    "identityOwner",
}
#: The drain bound the manifests set, and the margin after it: the shutdown delay (5 s by default)
#: and the workers' exit (about 3 s), with room to spare.
DRAIN_S, WORKER_EXIT_S = 30, 10
OVERLAYS = ("cpu", "gpu")
VARIANTS = list(itertools.product(OVERLAYS, ("hpa", "keda"), ("pvc", "url")))


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is not installed: .ci/run installs it (Debian package `kubectl`); "
            "locally: sudo apt-get install kubectl"
        )
    return path


def render(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize directory` as a list of objects (a fresh copy each call)."""
    return copy.deepcopy(_render(directory))


@cache
def _render(directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [kubectl(), "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def variant(tmp_path: Path, overlay: str, autoscaler: str, models: str) -> Path:
    """A kustomization like overlays/<overlay> with the autoscaling component swapped for
    `autoscaler` and, for models "url", components/models-from-url added."""
    source = KUBE / "overlays" / overlay
    spec = yaml.safe_load((source / "kustomization.yaml").read_text())
    components = [c for c in spec["components"] if Path(c).name not in ("hpa", "keda")]
    components.append(f"../../components/{autoscaler}")
    if models == "url":
        components.append("../../components/models-from-url")
    directory = tmp_path / f"{overlay}-{autoscaler}-{models}"
    directory.mkdir()

    def moved(path: str) -> str:
        return os.path.relpath(source / path, directory)

    spec["resources"] = [moved(r) for r in spec["resources"]]
    spec["components"] = [moved(c) for c in components]
    for patch in spec.get("patches", []):
        if "path" in patch:
            patch["path"] = moved(patch["path"])
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return directory


@cache
def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    group, version = api_version.split("/")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 2 s instead of 12 for InferenceService's
    crd = yaml.load(gzip.decompress((CRDS / CRD_FILES[(group, kind)]).read_bytes()), Loader=loader)
    assert crd["spec"]["names"]["kind"] == kind
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    assert version in served, f"{kind}: {api_version} is not served by the CRD (served: {sorted(served)})"
    return strict(served[version]["schema"]["openAPIV3Schema"])


def strict(schema: Any) -> Any:
    """The schema with unknown fields forbidden wherever the CRD lists the fields, as the API server's
    strict field validation (kubectl's default since 1.27) treats them."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def validate(doc: dict[str, Any]) -> None:
    """Validate one object against its schema; fail with every problem found."""
    where = f"{doc['kind']} {doc['metadata'].get('name')}"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), where
    group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
    if (group, doc["kind"]) in CRD_FILES:
        validator = jsonschema.Draft7Validator(crd_schema(doc["apiVersion"], doc["kind"]))
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, f"{where}:\n" + "\n".join(errors)
        return
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} against Kubernetes {version}: {'/'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{where}: no Kubernetes {version} schema for {doc['apiVersion']} {doc['kind']}")


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def quantity(value: str | int) -> float:
    """A Kubernetes quantity (2Gi, 512Mi, 250m, 3) as a number."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value))
    assert match, value
    return float(match[1]) * units.get(match[2], 1) if match[2] else float(match[1])


def container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]
    return next(c for c in spec["containers"] if c["name"] == name)


def kserve_file(name: str) -> dict[str, Any]:
    return yaml.safe_load((KUBE / "kserve" / name).read_text())


# --- rendering and schemas ----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_what_a_deployment_needs(overlay: str):
    docs = render(KUBE / "overlays" / overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "Namespace",
            "ServiceAccount",
            "PersistentVolumeClaim",
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "HorizontalPodAutoscaler",
            "ServiceMonitor",
            "PrometheusRule",
        ]
    )
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"servewell"}


@pytest.mark.parametrize(("overlay", "autoscaler", "models"), VARIANTS, ids=["-".join(v) for v in VARIANTS])
def test_every_variant_validates_against_its_schemas(tmp_path: Path, overlay: str, autoscaler: str, models: str):
    docs = render(variant(tmp_path, overlay, autoscaler, models))
    for doc in docs:
        validate(doc)
    assert len(by_kind(docs, "HorizontalPodAutoscaler")) == (autoscaler == "hpa")
    assert len(by_kind(docs, "ScaledObject")) == (autoscaler == "keda")
    assert len(by_kind(docs, "PersistentVolumeClaim")) == (models == "pvc")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    for volume in pod["volumes"]:  # a schema cannot say "exactly one source"
        assert len(set(volume) - {"name"}) == 1, volume
    names = {v["name"] for v in pod["volumes"]}
    for c in pod["containers"] + pod.get("initContainers", []):
        assert {m["name"] for m in c.get("volumeMounts", [])} <= names, c["name"]
    if models == "url":
        assert [c["name"] for c in pod["initContainers"]] == ["fetch-models"]
        assert next(v for v in pod["volumes"] if v["name"] == "models") == {
            "name": "models",
            "emptyDir": {"sizeLimit": "10Gi"},
        }


def test_kserve_objects_validate_against_the_kserve_and_prometheus_operator_schemas():
    docs = render(KUBE / "kserve") + [kserve_file("clusterservingruntime.yaml")]
    assert sorted(d["kind"] for d in docs) == [
        "ClusterServingRuntime",
        "InferenceService",
        "PodMonitor",
        "ServingRuntime",
    ]
    for doc in docs:
        validate(doc)


def test_the_crd_schemas_catch_a_misspelt_field():
    """The CRD validation can fail: a typo one level deep in a ServingRuntime is refused."""
    runtime = kserve_file("servingruntime.yaml")
    runtime["spec"]["protocolVersion"] = ["v2"]  # the field is protocolVersions
    with pytest.raises(AssertionError, match="protocolVersion"):
        validate(runtime)


# --- the Deployment ---------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_drains_within_its_grace_period(overlay: str):
    deployment = one(render(KUBE / "overlays" / overlay), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    server = container(deployment, "servewell")
    pre_stop_s = server["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop_s >= 5
    env = {e["name"]: e.get("value") for e in server["env"]}
    drain_s = int(env.get("SERVEWELL_SHUTDOWN_TIMEOUT_S", DRAIN_S))  # [issue 12]
    assert drain_s >= DRAIN_S or "SERVEWELL_SHUTDOWN_TIMEOUT_S" in env
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + drain_s + WORKER_EXIT_S
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_liveness_never_waits_for_models_and_startup_allows_loading(overlay: str):
    server = container(one(render(KUBE / "overlays" / overlay), "Deployment"), "servewell")
    assert server["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert server["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert server["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # minutes for model loading
    liveness = server["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"]["port"] in ports


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_admin_needs_a_token_from_a_secret_and_loopback_is_not_trusted(overlay: str):
    # A sidecar or mesh proxy in the pod forwards from 127.0.0.1 (issue 19.5): admin must need the token.
    server = container(one(render(KUBE / "overlays" / overlay), "Deployment"), "servewell")
    env = {e["name"]: e for e in server["env"]}
    assert env["SERVEWELL_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "servewell-admin", "key": "token"}
    assert env["SERVEWELL_TRUST_LOOPBACK_ADMIN"]["value"] == "false"
    assert not any("admin-token" in arg for arg in server["args"])  # never on the command line (ps shows it)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_match_the_memory_budget(overlay: str):
    server = container(one(render(KUBE / "overlays" / overlay), "Deployment"), "servewell")
    requests, limits = server["resources"]["requests"], server["resources"]["limits"]
    assert requests == limits  # Guaranteed QoS
    assert quantity(limits["cpu"]) >= 2 and quantity(limits["cpu"]).is_integer()  # frontend + a worker, whole cores
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert int(env["SERVEWELL_MEMORY_BUDGET_BYTES"]) == quantity(limits["memory"]) - 512 * 2**20
    shm = next(
        v
        for v in one(render(KUBE / "overlays" / overlay), "Deployment")["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "dshm"
    )
    assert shm["emptyDir"]["medium"] == "Memory" and quantity(shm["emptyDir"]["sizeLimit"]) <= 512 * 2**20


def test_gpu_overlay_asks_for_one_gpu_and_the_cuda_image():
    server = container(one(render(KUBE / "overlays" / "gpu"), "Deployment"), "servewell")
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert server["image"].endswith("-cuda")
    assert not container(one(render(KUBE / "overlays" / "cpu"), "Deployment"), "servewell")["resources"]["limits"].get(
        "nvidia.com/gpu"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_pdb_autoscaler_and_monitor_select_the_deployment(overlay: str):
    docs = render(KUBE / "overlays" / overlay)
    deployment = one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    target = one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= set(ports)
    assert ports["http"]["targetPort"] in {p["name"] for p in container(deployment, "servewell")["ports"]}
    # alerts.yml's ServewellTargetDown matches job="servewell": the job comes from this Service label.
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "servewell"
    # With API keys, /metrics is an operator's (issue 45): the scrape presents the pod's admin token.
    admin = {e["name"]: e for e in container(deployment, "servewell")["env"]}["SERVEWELL_ADMIN_TOKEN"]
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["authorization"] == {"type": "Bearer", "credentials": admin["valueFrom"]["secretKeyRef"]}


def test_prometheus_rule_is_generated_from_alerts_yml():
    sys.path.insert(0, str(KUBE))
    try:
        import prometheusrule
    finally:
        sys.path.remove(str(KUBE))
    committed = (KUBE / "components" / "monitoring" / "prometheusrule.yaml").read_text()
    alerts = (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text()
    assert committed == prometheusrule.render(alerts), "run: python3 deploy/kubernetes/prometheusrule.py"
    assert yaml.safe_load(committed)["spec"]["groups"] == yaml.safe_load(alerts)["groups"]


# --- autoscaling --------------------------------------------------------------------------------


def one_metric(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The only entry of an autoscaling metrics list (the InferenceService scales on queue depth alone)."""
    assert len(metrics) == 1, metrics
    return metrics[0]


def autoscaling_targets(tmp_path: Path) -> dict[str, dict[str, float]]:
    hpa = one(render(variant(tmp_path, "cpu", "hpa", "pvc")), "HorizontalPodAutoscaler")
    keda = one(render(variant(tmp_path, "cpu", "keda", "pvc")), "ScaledObject")
    isvc = kserve_file("inferenceservice.yaml")
    return {
        "hpa": {
            m["pods"]["metric"]["name"]: quantity(m["pods"]["target"]["averageValue"]) for m in hpa["spec"]["metrics"]
        },
        "keda": {t["name"]: float(t["metadata"]["threshold"]) for t in keda["spec"]["triggers"]},
        "isvc": {"queue_depth": quantity(one_metric(isvc["spec"]["predictor"]["autoScaling"]["metrics"])
                                         ["external"]["target"]["averageValue"])},
    }


def test_hpa_keda_and_inferenceservice_scale_on_the_same_targets(tmp_path: Path):
    targets = autoscaling_targets(tmp_path)
    depth, wait = targets["hpa"]["servewell_queue_depth"], targets["hpa"]["servewell_queue_wait_seconds_mean"]
    assert targets["keda"] == {"queue-depth": depth, "queue-wait": wait}
    assert targets["isvc"] == {"queue_depth": depth}
    # the values bench.fleet derived from the fleet simulation (deploy/README.md, "Autoscaling")
    derived = json.loads((ROOT / "bench" / "data" / "fleet-targets.json").read_text())
    assert depth == pytest.approx(derived["queue_depth"]) and wait == pytest.approx(derived["queue_wait_s"])


def test_keda_triggers_use_only_options_its_prometheus_scaler_reads(tmp_path: Path):
    keda = one(render(variant(tmp_path, "cpu", "keda", "pvc")), "ScaledObject")
    for trigger in keda["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        assert set(trigger["metadata"]) <= KEDA_PROMETHEUS_KEYS, trigger["name"]
        assert trigger["metadata"]["query"].count("(") == trigger["metadata"]["query"].count(")")


def test_prometheus_adapter_serves_the_metrics_the_hpa_asks_for(tmp_path: Path):
    hpa = one(render(variant(tmp_path, "cpu", "hpa", "pvc")), "HorizontalPodAutoscaler")
    rules = yaml.safe_load((KUBE / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    served = {rule["name"]["as"] for rule in rules}
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} == served
    for rule in rules:
        assert {"namespace", "pod"} <= set(rule["resources"]["overrides"])


# --- KServe -------------------------------------------------------------------------------------


def test_serving_runtime_speaks_oip_v2_for_servewells_formats():
    runtime = kserve_file("servingruntime.yaml")
    assert runtime["spec"]["protocolVersions"] == ["v2"]
    assert {f["name"] for f in runtime["spec"]["supportedModelFormats"]} == {"onnx", "pytorch", "torchscript"}
    assert [c["name"] for c in runtime["spec"]["containers"]] == ["kserve-container"]
    assert kserve_file("clusterservingruntime.yaml")["spec"] == runtime["spec"]


def test_serving_runtime_container_matches_the_deployment():
    deployment = one(render(KUBE / "overlays" / "cpu"), "Deployment")
    server = container(deployment, "servewell")
    runtime = kserve_file("servingruntime.yaml")
    kserve = container(runtime, "kserve-container")
    for field in ("args", "env", "resources", "lifecycle"):
        assert kserve[field] == server[field], field
    for probe in ("readinessProbe", "livenessProbe"):
        assert kserve[probe]["httpGet"]["path"] == server[probe]["httpGet"]["path"]
        assert kserve[probe]["httpGet"]["port"] == kserve["ports"][0]["containerPort"]
    assert kserve["ports"][0]["containerPort"] == next(
        p["containerPort"] for p in server["ports"] if p["name"] == "http"
    )
    assert (
        kserve["securityContext"]["runAsUser"] == deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    )
    assert {m["mountPath"] for m in kserve["volumeMounts"]} == {"/tmp", "/dev/shm"}  # KServe mounts /mnt/models


def test_inference_service_uses_the_runtime_and_drains_like_the_deployment():
    isvc = kserve_file("inferenceservice.yaml")
    runtime = kserve_file("servingruntime.yaml")
    predictor = isvc["spec"]["predictor"]
    assert predictor["model"]["runtime"] == runtime["metadata"]["name"]
    assert predictor["model"]["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert predictor["model"]["protocolVersion"] in runtime["spec"]["protocolVersions"]
    pre_stop_s = container(runtime, "kserve-container")["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert predictor["terminationGracePeriodSeconds"] >= pre_stop_s + DRAIN_S + WORKER_EXIT_S
    monitor = render(KUBE / "kserve")
    podmonitor = one(monitor, "PodMonitor")
    assert podmonitor["spec"]["selector"]["matchLabels"].items() <= runtime["spec"]["labels"].items()
    assert runtime["spec"]["labels"][podmonitor["spec"]["jobLabel"]] == "servewell"
    assert {e["port"] for e in podmonitor["spec"]["podMetricsEndpoints"]} == {
        p["name"] for p in container(runtime, "kserve-container")["ports"]
    }
    admin = {e["name"]: e for e in container(runtime, "kserve-container")["env"]}["SERVEWELL_ADMIN_TOKEN"]
    for endpoint in podmonitor["spec"]["podMetricsEndpoints"]:  # /metrics with keys: an operator's (issue 45)
        assert endpoint["authorization"] == {"type": "Bearer", "credentials": admin["valueFrom"]["secretKeyRef"]}


# --- the image ------------------------------------------------------------------------------------


def test_image_defaults_agree_with_the_manifests():
    text = DOCKERFILE.read_text()
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    assert cmd and entrypoint
    assert yaml.safe_load(entrypoint[1])[-2:] == ["servewell", "serve"]
    assert yaml.safe_load(entrypoint[1])[0] == "tini"
    image_args = yaml.safe_load(cmd[1])
    server = container(one(render(KUBE / "overlays" / "cpu"), "Deployment"), "servewell")
    as_flags = dict(zip(image_args[::2], image_args[1::2], strict=True))
    assert {f"{k}={v}" for k, v in as_flags.items()} == set(server["args"])
    assert re.search(r"^EXPOSE 8080 8001$", text, re.M) and re.search(r"^STOPSIGNAL SIGTERM$", text, re.M)
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    assert user and int(user[1]) == 10001 != 0
