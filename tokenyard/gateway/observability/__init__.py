"""Prometheus metrics, who may read them, and the access log."""
