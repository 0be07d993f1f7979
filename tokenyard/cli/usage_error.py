"""The one error a command raises for something the user can fix (bad flags, a bad deployment file).

tokenyard.cli.main prints it as "tokenyard: <message>" and exits with 2, never a traceback. Kept in a module
of its own, importing nothing, so `tokenyard --help` and the dispatch around every command stay cheap.
"""
from __future__ import annotations


class UsageError(Exception):
    """Bad flags or a bad deployment file: the message says what to fix; the command exits with 2."""
