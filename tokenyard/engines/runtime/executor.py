"""One thread for all torch work in the process.

On a CPU, two engines stepping at once would fight over the same cores and both run slower than
taking turns; torch also parallelises each op across cores already. So every engine's step runs
on this single worker thread, and callers on an event loop await it.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def torch_executor() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenyard-torch")
        return _executor
