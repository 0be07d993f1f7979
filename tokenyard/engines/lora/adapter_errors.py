"""What loading or unloading an adapter at run time can go wrong with, and how it crosses a process.

    engine.load_adapter("sql", "/adapters/sql")    # AdapterError (400), AdapterConflict (409), ...
    kind, message = error_kind(e)                 # ("invalid", "...") for a message between processes
    raise error_of(kind, message)                 # the same exception type again on the other side

Kinds and the HTTP status the gateway answers with (tokenyard/gateway/routes/adapter_admin.py):
    invalid      400  the adapter cannot be served on this base (AdapterError: names the file, key or
                      tensor), or a bad name
    unsupported  400  the engine serves no adapters (started without lora_modules, or a mock
                      or upstream that has none)
    not_found    404  no adapter of that name
    conflict     409  the name is taken, or requests are still running with the adapter
Torch-free: the gateway imports it.
"""
from __future__ import annotations

import re

from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.lora.adapter_config import AdapterError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")    # an adapter's name (ENGINE:NAME in the gateway)


class AdapterUnsupported(RequestError):
    """The engine has no adapter pool to load into."""


class AdapterNotFound(RequestError):
    """No adapter of that name is registered."""


class AdapterConflict(RequestError):
    """The name is already registered, or requests still run with the adapter being unloaded."""


KINDS: dict[str, type[Exception]] = {"invalid": AdapterError, "unsupported": AdapterUnsupported,
                                     "not_found": AdapterNotFound, "conflict": AdapterConflict}
STATUS = {"invalid": 400, "unsupported": 400, "not_found": 404, "conflict": 409}


def check_adapter_name(name: object) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise AdapterError(f"adapter name must be 1-64 of A-Z a-z 0-9 . _ - (starting with a letter or digit), "
                           f"got {name!r}")
    return name


def error_kind(e: BaseException) -> tuple[str, str] | None:
    """(kind, message) for an adapter error; None for any other exception."""
    for kind, cls in KINDS.items():
        if isinstance(e, cls):
            return kind, str(e)
    return None


def error_of(kind: str, message: str) -> Exception:
    return KINDS.get(kind, AdapterError)(message)
