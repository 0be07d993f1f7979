"""Prometheus metrics and the access log (who may read /metrics: server/metrics_access.py)."""
