"""The one way a command loads its deployment: a problem the user can fix is a one-line message and
exit status 2, never a traceback.

    dep = load_or_exit(args.config)      # raises UsageError, which tokenyard.cli.main turns into "tokenyard: ..." + 2
"""
from __future__ import annotations

from pathlib import Path

from tokenyard.cli.usage_error import UsageError
from tokenyard.gateway.config.deployment import Deployment, DeploymentError, load_deployment

__all__ = ["UsageError", "load_or_exit"]


def load_or_exit(path: str | Path | None) -> Deployment:
    try:
        return load_deployment(path)
    except DeploymentError as e:
        raise UsageError(str(e)) from None
