"""The learned router: a runtime (features, scorer, artifact, calibration) that the gateway loads,
and the offline training and evaluation that produce its artifact."""
