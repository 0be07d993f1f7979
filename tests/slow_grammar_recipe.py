"""An engine recipe for engine-process tests whose grammars are slow to compile, deterministically.

Monkeypatching does not cross into the engine's child process, so the slowness travels in the
recipe: it is pickled by reference (this module, importable in the child when the test puts tests/
on PYTHONPATH) and its build(), which runs in the child, makes the first compile of each json_schema
there sleep `delay_s` first. A sleep leaves the GIL, as xgrammar's compiler does.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SlowGrammarRecipe:
    model: str
    options: dict[str, Any] = field(default_factory=dict)
    delay_s: float = 2.0

    def build(self) -> Any:
        from tokenyard.engines.core.structured_output import Grammars
        from tokenyard.engines.runtime.engine import Engine

        real, seen, delay = Grammars.compile, set(), self.delay_s

        def slow_compile(grammars: Grammars, fmt: dict) -> Any:
            text = json.dumps(fmt, sort_keys=True)
            if fmt.get("type") == "json_schema" and text not in seen:
                seen.add(text)
                time.sleep(delay)
            return real(grammars, fmt)

        Grammars.compile = slow_compile     # this process is the engine's own child
        return Engine(self.model, **{"progress": False, **self.options})
