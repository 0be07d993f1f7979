"""Small C sources built on the machine that runs them (see tokenyard/nativelib/build.py)."""
