"""deploy/k8s: the manifests against the published CRD schemas, and against each other.

InferencePool and InferenceObjective are validated with jsonschema against the Gateway API
Inference Extension's CRD schemas (vendored in deploy/k8s/schemas, source in each header), made
strict the way ``kubectl apply --validate=strict`` is (an unknown field is an error, not pruned
silently), plus the CRD's two CEL rules written out by hand. The built-in kinds are checked
structurally: selectors match the pod labels, named ports exist, the Service, pool, route and
scrape job point at what the Deployment runs, and the container's arguments parse with
``tailserve serve``'s own flags.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tailserve.cli import build_parser, engine_args_from, server_settings_from

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def one(kind: str) -> dict[str, Any]:
    found = [d for d in documents() if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} documents"
    return found[0]


def strict(schema: Any) -> Any:
    """The schema with unknown fields forbidden wherever it lists the known ones."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the strict openAPIV3Schema of every vendored CRD version."""
    out = {}
    for path in sorted((K8S / "schemas").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        assert crd["kind"] == "CustomResourceDefinition", path
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            out[(f"{group}/{version['name']}", kind)] = strict(
                version["schema"]["openAPIV3Schema"]
            )
    return out


def cel_rules(pool: dict[str, Any]) -> list[str]:
    """The InferencePool CRD's x-kubernetes-validations, which jsonschema does not run."""
    errors = []
    ref = pool["spec"]["endpointPickerRef"]
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        errors.append("port is required when kind is 'Service' or unspecified")
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    if len(set(numbers)) != len(numbers):
        errors.append("port number must be unique")
    return errors


def validate_custom(doc: dict[str, Any]) -> None:
    schema = crd_schemas()[(doc["apiVersion"], doc["kind"])]
    jsonschema.Draft202012Validator(schema).validate(doc)
    assert DNS_LABEL.match(doc["metadata"]["name"]), doc["metadata"]["name"]
    if doc["kind"] == "InferencePool":
        assert cel_rules(doc) == []


def test_every_custom_resource_has_its_published_schema() -> None:
    schemas = crd_schemas()
    custom = [d for d in documents() if "k8s.io/" in d["apiVersion"]
              and not d["apiVersion"].startswith("gateway.networking.k8s.io/")]
    assert {d["kind"] for d in custom} == {"InferencePool", "InferenceObjective"}
    for doc in custom:
        assert (doc["apiVersion"], doc["kind"]) in schemas, (doc["apiVersion"], doc["kind"])
        validate_custom(doc)


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p["spec"].pop("targetPorts"), "'targetPorts' is a required property"),
    (lambda p: p["spec"]["targetPorts"].append({"number": 70000}), "70000 is greater than"),
    (lambda p: p["spec"].update(targetPortNumber=8000), "Additional properties"),
    (lambda p: p["spec"]["endpointPickerRef"].update(failureMode="FailSoft"), "'FailSoft' is not"),
    (lambda p: p["spec"]["selector"].update(matchLabels={}), "should be non-empty"),
])
def test_the_schema_rejects_broken_pools(mutate: Any, message: str) -> None:
    pool = copy.deepcopy(one("InferencePool"))
    mutate(pool)
    with pytest.raises(jsonschema.ValidationError, match=message):
        validate_custom(pool)


def test_the_cel_rules_are_checked() -> None:
    pool = copy.deepcopy(one("InferencePool"))
    pool["spec"]["endpointPickerRef"].pop("port")
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    assert len(cel_rules(pool)) == 2


def container_port(container: dict[str, Any], name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert name in ports, f"no container port named {name!r}: {sorted(ports)}"
    return int(ports[name])


def test_the_objects_point_at_each_other() -> None:
    dep, svc = one("Deployment"), one("Service")
    pool, objective, route = one("InferencePool"), one("InferenceObjective"), one("HTTPRoute")
    assert dep["apiVersion"] == "apps/v1" and svc["apiVersion"] == "v1"
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    (container,) = pod["spec"]["containers"]
    http = container_port(container, "http")

    def selects(selector: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in selector.items())

    assert selects(dep["spec"]["selector"]["matchLabels"])
    assert selects(svc["spec"]["selector"])
    assert selects(pool["spec"]["selector"]["matchLabels"])
    (svc_port,) = svc["spec"]["ports"]
    assert container_port(container, svc_port["targetPort"]) == http
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [http]
    assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                         "name": pool["metadata"]["name"]}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and container_port(container, get["port"]) == http
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == http
    assert annotations["prometheus.io/path"] == "/metrics"
    # The drain (--shutdown-timeout, 30 s by default) fits the grace period.
    assert pod["spec"]["terminationGracePeriodSeconds"] > 30
    for doc in (dep, svc, route):
        assert DNS_LABEL.match(doc["metadata"]["name"])


def test_the_container_runs_tailserve_serve_as_configured() -> None:
    dep = one("Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    assert container["command"] == ["tailserve"]
    # Kubernetes expands $(POD_IP) in args from the container's env.
    args = [a.replace("$(POD_IP)", "10.0.0.7") for a in container["args"]]
    ns = build_parser().parse_args(args)
    engine, server = engine_args_from(ns), server_settings_from(ns)
    assert server.port == container_port(container, "http")
    assert server.host == "0.0.0.0"
    cfg = json.loads(str(engine.kv_events_config))
    assert cfg["enable_kv_cache_events"] is True
    # Bound on every interface, on the port the pod declares for the EPP to subscribe to.
    assert cfg["endpoint"] == f"tcp://*:{container_port(container, 'kv-events')}"
    assert cfg["topic"] == f"kv@10.0.0.7:{server.port}@{server.served_model_name}"


def test_the_scrape_job_keeps_the_pods() -> None:
    cm = one("ConfigMap")
    prom = yaml.safe_load(cm["data"]["prometheus.yml"])
    (job,) = prom["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    pod = one("Deployment")["spec"]["template"]["metadata"]
    meta = {
        "__meta_kubernetes_pod_label_app_kubernetes_io_name":
            pod["labels"]["app.kubernetes.io/name"],
        "__meta_kubernetes_pod_annotation_prometheus_io_scrape":
            pod["annotations"]["prometheus.io/scrape"],
    }
    keeps = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert len(keeps) == 2
    for rule in keeps:
        (label,) = rule["source_labels"]
        assert re.fullmatch(rule["regex"], meta[label]), (label, rule["regex"])
    # The address rewrite: the pod IP with the annotated port.
    (addr,) = [r for r in job["relabel_configs"] if r.get("target_label") == "__address__"]
    joined = "10.0.0.7:9999;" + pod["annotations"]["prometheus.io/port"]
    assert re.sub(f"^(?:{addr['regex']})$", addr["replacement"].replace("$", "\\"), joined) \
        == "10.0.0.7:8000"
