"""Every engine the gateway can drive offers the same backend interface (tokenyard/engines/core/backend.py), with
the same parameter names, so admission and dispatch never need to know which one they hold."""
from __future__ import annotations

import inspect

import pytest

from tokenyard.engines.core.backend import EngineBackend
from tokenyard.engines.runtime.async_engine import AsyncEngine
from tokenyard.gateway.backends.remote_engine import RemoteEngine
from tokenyard.gateway.backends.replica_pool import ReplicaPool

MEMBERS = ["dead", "max_model_len", "num_in_flight", "start", "stop", "add_request", "abort", "stats"]


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


@pytest.mark.parametrize("cls", [AsyncEngine, RemoteEngine, ReplicaPool])
def test_backend_classes_match_the_protocol(cls) -> None:
    for name in MEMBERS:
        proto = inspect.getattr_static(EngineBackend, name)
        impl = inspect.getattr_static(cls, name, None)
        if isinstance(proto, property):
            # a property, or a plain attribute set in __init__ (AsyncEngine.dead)
            assert impl is None or isinstance(impl, property), f"{cls.__name__}.{name} should be readable"
            if impl is None:
                assert name in inspect.getsource(cls.__init__), f"{cls.__name__} lacks {name}"
            continue
        assert impl is not None, f"{cls.__name__} lacks {name}()"
        assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(proto), \
            f"{cls.__name__}.{name}: async-ness differs from the protocol"
        assert _params(impl) == _params(proto), f"{cls.__name__}.{name}{inspect.signature(impl)} differs"


def test_a_class_missing_a_member_is_caught() -> None:
    class Half:
        async def start(self) -> None: ...

    assert inspect.getattr_static(Half, "abort", None) is None
    assert not isinstance(Half(), EngineBackend)
