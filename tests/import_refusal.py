"""Code that a test's child interpreter runs first so that some modules cannot be imported there: the
probes of tests/packaging check which dependencies a part of tokenyard really needs."""
from __future__ import annotations

_REFUSE = """
import sys
BLOCKED = {blocked!r}

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"blocked for this test: {{name}}")
        return None

sys.meta_path.insert(0, Refuse())
"""


def refusing(blocked: tuple[str, ...] | list[str]) -> str:
    """The prelude that refuses `blocked` (and their submodules) in the interpreter that runs it."""
    return _REFUSE.format(blocked=tuple(blocked))
