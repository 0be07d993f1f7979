"""Offline only: training, evaluation (APGR, CPT) and the `tokenyard router` commands."""
