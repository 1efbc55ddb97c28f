"""deploy/kubernetes validated offline: every built-in resource against the Kubernetes OpenAPI schemas that
``kubernetes-validate`` ships (strict: an unknown field fails), for the oldest and the newest Kubernetes minor
version it supports; the NodeReadinessRule against its CRD's published openAPIV3Schema (kept in
tests/golden/kubernetes, with the CRD's CEL rules on the taint checked here, since jsonschema cannot run
CEL); a deliberately broken copy of each fails. Then what the manifests promise each other: the plugin
config is the one in deploy/node-problem-detector, the host paths are read-only but /var/lib/gputopo, the
conditions the gate waits on are those NPD sets, the metrics folder is the one node_exporter reads."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate")
from kubernetes_validate import utils as kv_utils  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "kubernetes"
NRR_SCHEMA = Path(__file__).parent / "golden" / "kubernetes" / "nodereadinessrule-v1alpha1.schema.json"
CRD_KINDS = {("readiness.node.x-k8s.io/v1alpha1", "NodeReadinessRule")}


def _minor(v: str) -> tuple[int, int]:
    major, minor = v.split(".")[:2]
    return int(major), int(minor)


VERSIONS = sorted({".".join(v.split(".")[:2]) for v in kv_utils.all_versions()}, key=_minor)
OLDEST_NEWEST = [VERSIONS[0], VERSIONS[-1]]


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def validate_builtin(doc: dict[str, Any], version: str) -> None:
    kv.validate(doc, version, strict=True)


def closed(schema: Any) -> Any:
    """A structural schema as the API server's strict field validation applies it (kubectl's default
    ``--validate=strict`` since 1.27): an object with ``properties`` takes no other field."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def validate_nrr(doc: dict[str, Any]) -> None:
    """The CRD's schema (closed, as strict field validation reads it), then its CEL rules on
    ``spec.taint`` (x-kubernetes-validations) in Python."""
    import jsonschema

    schema = json.loads(NRR_SCHEMA.read_text())
    schema.pop("$comment", None)
    jsonschema.validate(doc, closed(schema))
    taint = doc["spec"]["taint"]
    key = taint["key"]
    if not key.startswith("readiness.k8s.io/") or len(key) > 253 or key.count("/") != 1:
        raise jsonschema.ValidationError(f"taint key {key!r}: must be readiness.k8s.io/<name>")
    name = key.split("/")[1]
    if not 0 < len(name) <= 63 or not re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", name):
        raise jsonschema.ValidationError(f"taint key name {name!r}")
    if len(taint.get("value", "")) > 63 or taint["effect"] not in (
        "NoSchedule",
        "PreferNoSchedule",
        "NoExecute",
    ):
        raise jsonschema.ValidationError("taint value or effect")
    mode = doc["spec"]["enforcementMode"]
    if mode == "bootstrap-only" and any("defaultStatus" in c for c in doc["spec"]["conditions"]):
        raise jsonschema.ValidationError("defaultStatus is not allowed with bootstrap-only")


def test_kubernetes_validate_offers_an_old_and_a_new_version() -> None:
    assert len(VERSIONS) >= 2 and _minor(OLDEST_NEWEST[0]) < _minor(OLDEST_NEWEST[1])


@pytest.mark.parametrize("version", OLDEST_NEWEST)
def test_every_manifest_validates(version: str) -> None:
    docs = documents()
    kinds = {(d["apiVersion"], d["kind"]) for _, d in docs}
    assert {("apps/v1", "DaemonSet"), ("v1", "ConfigMap"), ("v1", "Service")} <= kinds
    for _name, doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            validate_nrr(doc)
        else:
            validate_builtin(doc, version)  # raises ValidationError naming the field


def _broken(kind: str) -> dict[str, Any]:
    (doc,) = [copy.deepcopy(d) for _, d in documents() if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", OLDEST_NEWEST)
def test_a_broken_copy_fails(version: str) -> None:
    ds = _broken("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    pod["containers"][0]["volumeMounts"][0]["readOnly"] = "yes"  # a string where a boolean goes
    with pytest.raises(kv.ValidationError):
        validate_builtin(ds, version)
    ds = _broken("DaemonSet")
    ds["spec"]["template"]["spec"]["contianers"] = ds["spec"]["template"]["spec"].pop("containers")
    with pytest.raises(kv.ValidationError):  # strict: a misspelt field is an error, not ignored
        validate_builtin(ds, version)
    svc = _broken("Service")
    svc["spec"]["ports"][0]["port"] = "nine"
    with pytest.raises(kv.ValidationError):
        validate_builtin(svc, version)


def test_a_broken_node_readiness_rule_fails() -> None:
    import jsonschema

    for change in (
        lambda d: d["spec"]["taint"].update(key="gputopo.dev/accepted"),  # not the controller's prefix
        lambda d: d["spec"]["conditions"][0].update(requiredStatus="Maybe"),
        lambda d: d["spec"].update(enforcementMode="always"),
        lambda d: d["spec"].pop("conditions"),
        lambda d: d["spec"].update(taints=[]),  # unknown field: the CRD's schema is closed
    ):
        doc = _broken("NodeReadinessRule")
        change(doc)
        with pytest.raises(jsonschema.ValidationError):
            validate_nrr(doc)


# --- what the manifests promise each other --------------------------------------------------------------


def _one(kind: str) -> dict[str, Any]:
    (doc,) = [d for _, d in documents() if d["kind"] == kind]
    return doc


def plugin_config() -> dict[str, Any]:
    cm = _one("ConfigMap")
    return json.loads(cm["data"]["gputopo-check.json"])


def test_the_configmap_is_the_plugin_config_of_deploy_node_problem_detector() -> None:
    host = json.loads((REPO / "deploy" / "node-problem-detector" / "gputopo-check.json").read_text())
    assert plugin_config() == host


def test_host_paths_are_read_only_but_the_state_folder() -> None:
    pod = _one("DaemonSet")["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert set(host.values()) >= {"/dev/kmsg", "/var/lib/gputopo"}
    writable = set()
    for c in pod["containers"] + pod.get("initContainers", []):
        assert c["resources"]["limits"]["cpu"] and c["resources"]["limits"]["memory"], c["name"]
        for m in c.get("volumeMounts", []):
            if m["name"] in host and not m.get("readOnly"):
                writable.add(host[m["name"]])
    assert writable == {"/var/lib/gputopo"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert not any("nvidia.com/gpu" in c["resources"].get("limits", {}) for c in pod["containers"])


def test_the_gate_waits_on_conditions_npd_sets_and_npd_tolerates_its_taint() -> None:
    from gputopo.health.subsystems import ROLLUP_CONDITION, SUBSYSTEMS

    config = plugin_config()
    conditions = [c["type"] for c in config["conditions"]]
    assert conditions == [ROLLUP_CONDITION, *(s.condition for s in SUBSYSTEMS)]
    assert all(re.fullmatch(r"Gputopo[A-Z][A-Za-z]+", c) for c in conditions)  # NPD's style, our prefix
    rule = _one("NodeReadinessRule")
    assert {c["type"] for c in rule["spec"]["conditions"]} <= set(conditions)
    assert "GputopoNotAccepted" in {c["type"] for c in rule["spec"]["conditions"]}
    tolerated = {t["key"] for t in _one("DaemonSet")["spec"]["template"]["spec"]["tolerations"]}
    assert rule["spec"]["taint"]["key"] in tolerated


def test_the_plugin_rules_keep_npds_protocol_and_one_read_per_interval() -> None:
    config = plugin_config()
    glob = config["pluginConfig"]
    assert glob["concurrency"] == 1  # NPD runs the rules one at a time, in this order
    first, *others = config["rules"]
    assert "--subsystem" not in first["args"]  # the first rule reads the GPUs ...
    assert all("--subsystem" in r["args"] for r in others)  # ... the others answer from its record

    def arg(rule: dict[str, Any], name: str) -> str:
        return rule["args"][rule["args"].index(name) + 1]

    assert {arg(r, "--state") for r in config["rules"]} == {"/var/lib/gputopo/check-state.json"}
    assert all(int(arg(r, "--max-output-length")) == glob["max_output_length"] for r in config["rules"])
    seconds = [float(r["timeout"].rstrip("s")) for r in config["rules"]]
    assert float(arg(first, "--budget")) + 5 <= seconds[0]
    # The last rule still finds the record fresh when every rule before it ran to its timeout.
    assert all(float(arg(r, "--max-age")) >= sum(seconds) for r in others)
    interval_s = float(glob["invoke_interval"].rstrip("m")) * 60
    assert all(float(arg(r, "--max-age")) < interval_s for r in others)  # last interval's is stale
    # The metrics folder the first rule writes is the one node_exporter's textfile collector reads.
    exporter = next(
        c for c in _one("DaemonSet")["spec"]["template"]["spec"]["containers"] if c["name"] == "metrics"
    )
    assert f"--collector.textfile.directory={arg(first, '--textfile')}" in exporter["args"]
