"""The Kubernetes examples in docs/k8s, validated against the API schemas that kubernetes-validate
ships (offline: its bundled JSON schemas, no cluster, no network), in strict mode (unknown fields
are errors), rather than parsed as YAML only."""
from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "docs" / "k8s"
VERSION = "1.30"    # the oldest Kubernetes the examples claim to run on (autoscaling/v2, apps/v1)
MANIFESTS = sorted(K8S.glob("*.yaml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def test_there_are_manifests():
    assert {p.name for p in MANIFESTS} >= {"autoscaling.yaml", "engine-large.yaml", "gateway.yaml"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_matches_the_kubernetes_schema(path: Path):
    docs = documents(path)
    assert docs, f"{path.name} has no resources"
    for doc in docs:
        # raises ValidationError (naming the field) or SchemaNotFoundError (an unknown kind)
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_engine_hpa_scales_on_desired_replicas():
    hpa = next(d for d in documents(K8S / "autoscaling.yaml")
               if d["kind"] == "HorizontalPodAutoscaler" and d["metadata"]["name"] == "engine-large")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == "tokenyard_desired_replicas"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert "max by (engine) (tokenyard_engine_desired_replicas" in (K8S / "autoscaling.yaml").read_text()


def test_the_validator_refuses_broken_manifests():
    """So a green run means something: a typo in a field name, a wrong type, a wrong kind."""
    hpa = next(d for d in documents(K8S / "autoscaling.yaml") if d["kind"] == "HorizontalPodAutoscaler")
    typo = copy.deepcopy(hpa)
    typo["spec"]["maxReplica"] = typo["spec"].pop("maxReplicas")
    wrong_type = copy.deepcopy(hpa)
    wrong_type["spec"]["minReplicas"] = "two"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, VERSION, strict=True)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate({**hpa, "kind": "HorizontalPodScaler"}, VERSION, strict=True)
