"""The `tokenyard` command: one entry point wiring the gateway, engine, bench, demo and router commands."""
