"""Small C sources built on the machine that runs them (see nativelib/build.py)."""
