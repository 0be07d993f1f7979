"""The router artifact: one JSON file, no pickle, checked before it is used.

    {"format": "tokenyard-router", "format_version": 1,
     "feature_spec": {...FeatureSpec...},
     "model": {"kind": "logistic_regression", "positive": "small_enough", "intercept": b,
               "indices": [...], "values": [...]},          # the non-zero weights, sparse
     "threshold": {"value": t, "method": "large_share" | "quality" | "manual", "target": x},
     "calibration": {"prompts": n, "quantiles": [...]},     # score quantiles of the calibration
                                                            # split, share i/(k-1) below q[i]
     "training": {...provenance, not used to score...},
     "checksum": "sha256:<hex of the canonical JSON of everything else>"}

Scores are P(small is enough); a request goes to the large engine when its score is below the
threshold. Floats are written by `json` as shortest round-trip reprs, so the loaded weights are
bit-identical to the trained ones. `load` refuses, with an `ArtifactError` naming the file and
the problem: a file that is not JSON, another format, another format_version, a feature spec this
code cannot compute, weights out of range, or a checksum mismatch (an edited or corrupted file).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenyard.router_models.runtime.features import FeatureSpec

FORMAT = "tokenyard-router"
FORMAT_VERSION = 1
MODEL_KIND = "logistic_regression"
_KEYS = {"format", "format_version", "feature_spec", "model", "threshold", "calibration", "training", "checksum"}


class ArtifactError(ValueError):
    """A router artifact that cannot be used; the message names the file and the reason."""


@dataclass(slots=True)
class Artifact:
    spec: FeatureSpec
    intercept: float
    indices: list[int]
    values: list[float]
    threshold: float
    threshold_method: str
    threshold_target: float | None
    quantiles: list[float]          # calibration score quantiles, evenly spaced shares 0..1
    calibration_prompts: int
    training: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        body = {"format": FORMAT, "format_version": FORMAT_VERSION, "feature_spec": self.spec.to_dict(),
                "model": {"kind": MODEL_KIND, "positive": "small_enough", "intercept": self.intercept,
                          "indices": list(self.indices), "values": list(self.values)},
                "threshold": {"value": self.threshold, "method": self.threshold_method,
                              "target": self.threshold_target},
                "calibration": {"prompts": self.calibration_prompts, "quantiles": list(self.quantiles)},
                "training": self.training}
        body["checksum"] = checksum(body)
        return body


def with_threshold(artifact: Artifact, threshold: float | None = None,
                   target_large_share: float | None = None) -> Artifact:
    """A copy with the threshold overridden: a raw score threshold ("manual"), or the threshold
    for a target share of large calls read off the calibration quantiles ("large_share").
    (At serving time `Scorer.set_threshold` does the same without writing a file.)"""
    from tokenyard.router_models.runtime.calibration import threshold_from_quantiles

    if threshold is not None and target_large_share is None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must lie in [0, 1], got {threshold!r}")
        return replace(artifact, threshold=float(threshold), threshold_method="manual", threshold_target=None)
    if threshold is not None or target_large_share is None:
        raise ValueError("give exactly one of threshold and target_large_share")
    value = threshold_from_quantiles(artifact.quantiles, target_large_share)
    return replace(artifact, threshold=min(max(value, 0.0), 1.0), threshold_method="large_share",
                   threshold_target=float(target_large_share))


def checksum(body: dict[str, Any]) -> str:
    canonical = json.dumps({k: v for k, v in body.items() if k != "checksum"}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


def save(artifact: Artifact, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(artifact.to_json(), indent=None, separators=(",", ":"), allow_nan=False) + "\n",
                    encoding="utf-8")


def load(path: str | Path) -> Artifact:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ArtifactError(f"router artifact {path}: cannot read it ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise ArtifactError(f"router artifact {path}: not UTF-8 text") from e
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ArtifactError(f"router artifact {path}: not valid JSON ({e.msg} at line {e.lineno})") from e
    try:
        return from_json(body)
    except ArtifactError as e:
        raise ArtifactError(f"router artifact {path}: {e}") from e


def checked_spec(body: dict[str, Any], keys: set[str] | frozenset[str]) -> FeatureSpec:
    """What every artifact format checks first: exactly these keys, the checksum over the content,
    and a valid feature spec (returned)."""
    missing, extra = keys - set(body), set(body) - keys
    if missing:
        raise ArtifactError(f"missing keys: {', '.join(sorted(missing))}")
    if extra:
        raise ArtifactError(f"unknown keys: {', '.join(sorted(extra))}")
    try:
        expected = checksum(body)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"cannot compute the checksum ({e})") from e
    if body["checksum"] != expected:
        raise ArtifactError(f"checksum mismatch (file says {body['checksum']!r}, content hashes to {expected!r}): "
                            "the file was edited or corrupted after training; retrain or restore it")
    try:
        spec = FeatureSpec.from_dict(body["feature_spec"])
        spec.validate()
    except (TypeError, ValueError, KeyError) as e:
        raise ArtifactError(f"feature spec: {e}") from e
    return spec


def from_json(body: Any) -> Artifact:
    if not isinstance(body, dict):
        raise ArtifactError("expected a JSON object")
    if body.get("format") != FORMAT:
        raise ArtifactError(f"format is {body.get('format')!r}, expected {FORMAT!r}")
    version = body.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"format_version {version!r} is not supported (this code reads version "
                            f"{FORMAT_VERSION}); retrain it with `tokenyard router train`")
    spec = checked_spec(body, _KEYS)
    model, thr, cal = body["model"], body["threshold"], body["calibration"]
    try:
        if model["kind"] != MODEL_KIND:
            raise ArtifactError(f"model kind {model['kind']!r} is not supported (expected {MODEL_KIND!r})")
        indices = [int(i) for i in model["indices"]]
        values = [float(v) for v in model["values"]]
        intercept = float(model["intercept"])
        threshold = float(thr["value"])
        quantiles = [float(q) for q in cal["quantiles"]]
        art = Artifact(spec, intercept, indices, values, threshold, str(thr["method"]),
                       None if thr["target"] is None else float(thr["target"]), quantiles,
                       int(cal["prompts"]), dict(body["training"]))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ArtifactError):
            raise
        raise ArtifactError(f"malformed model/threshold/calibration section ({type(e).__name__}: {e})") from e
    if len(indices) != len(values) or len(set(indices)) != len(indices):
        raise ArtifactError("model indices and values must be equally long, indices unique")
    if any(not 0 <= i < spec.dim for i in indices):
        raise ArtifactError(f"model indices must lie in [0, {spec.dim}) for this feature spec")
    if not all(math.isfinite(v) for v in [*values, intercept, *quantiles]):
        raise ArtifactError("weights and quantiles must be finite numbers")
    if not 0.0 <= threshold <= 1.0 or not math.isfinite(threshold):
        raise ArtifactError(f"threshold {threshold!r} must lie in [0, 1]")
    if len(quantiles) < 2 or any(b < a for a, b in zip(quantiles, quantiles[1:])):
        raise ArtifactError("calibration quantiles must be at least two non-decreasing numbers")
    return art
