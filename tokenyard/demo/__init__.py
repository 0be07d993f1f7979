"""Demo workloads for Tokenyard: a checkable chat task suite and the tiny models trained on it."""
