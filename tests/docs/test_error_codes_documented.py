"""Every error `code` the gateway sets is listed on the API reference page (issue 47.5)."""
from __future__ import annotations

import re

from gateway_helpers import ROOT

# code="x" (OpenAIError and friends) or "code": "x" (literal bodies) anywhere under tokenyard/gateway.
CODE = re.compile(r"""(?:\bcode\s*=\s*|["']code["']\s*:\s*)["']([a-z][a-z0-9_]+)["']""")


def test_every_gateway_error_code_is_on_the_api_page():
    api = (ROOT / "docs" / "api.md").read_text()
    codes = {m.group(1) for path in (ROOT / "tokenyard" / "gateway").rglob("*.py") for m in CODE.finditer(path.read_text())}
    codes.discard("file")   # a batch error line's "param", not a code
    assert len(codes) > 40, sorted(codes)
    missing = sorted(c for c in codes if f"`{c}`" not in api)
    assert not missing, f"error codes not documented in docs/api.md: {missing}"
