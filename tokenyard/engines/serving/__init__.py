"""Serving an engine outside the gateway: the replica server, the mock engine, `tokenyard generate`."""
