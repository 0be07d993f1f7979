"""Peer benchmarks: other engines on the same weights and requests as Tokenyard (issue 26)."""
