"""Tensor parallelism: sharded layers, the rank-0 runner and the worker processes."""
