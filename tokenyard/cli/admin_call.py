"""One admin HTTP call from the CLI (the gateway's admin API or a replica's own API): the reply printed as
JSON, a refusal or a failure on stderr with a non-zero status."""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request


def send(req: urllib.request.Request, what: str, timeout_s: float) -> int:
    """0 when answered (the JSON reply printed); 1 when refused (the status and body) or failed."""
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            print(json.dumps(json.loads(resp.read()), indent=2))
            return 0
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        print(f"tokenyard: {what} refused ({e.code}): {text}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"tokenyard: {what} failed: {e}", file=sys.stderr)
        return 1
