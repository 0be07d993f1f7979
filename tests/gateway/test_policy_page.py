"""The operator page in headless Chromium (Debian's /usr/bin/chromium through playwright): sign in
with an admin key, edit a rule in the textarea, see the simulation's comparison table, apply it
(version 2, live on the gateway), roll back to version 1 (version 3, the exact hash of 1); a
tenant key is refused at sign-in; the page runs under a CSP that allows no script at all."""
from __future__ import annotations

import shutil
from pathlib import Path

from gateway_helpers import SHARED_REDIS, delete_prefix, running_gateway, unique_prefix, wait_ledger
from policy_gateway_helpers import BASE_POLICY, chat, make_keys, put_policy, two_engine_deployment

from tests.gateway.test_dashboard_page import ARTIFACTS, CHROMIUM, _browser_or_skip

POLICY = BASE_POLICY + """\
rules:
  - name: acme-pin
    match: {tenants: [acme]}
    action: {pin: large}
"""


def test_policy_page_edit_simulate_apply_rollback():
    sync_playwright = _browser_or_skip()
    prefix = unique_prefix("polpage")
    keys = make_keys(prefix, "acme")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        with running_gateway(two_engine_deployment(prefix)) as srv:
            v1 = put_policy(srv, keys["admin"], POLICY)[1]
            for content in ("Add 1 and 2.", "Reverse: a b", "Sort: 3 1 2"):
                assert chat(srv, keys["acme"], content)[1]["x-tokenyard-engine"] == "large"
            wait_ledger(srv)
            base = srv.base_url
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM if Path(CHROMIUM).exists()
                                            else shutil.which("chromium"), headless=True, args=["--no-sandbox"])
                try:
                    context = browser.new_context()
                    errors: list[str] = []
                    context.on("page", lambda pg: pg.on("console", lambda m: errors.append(m.text)
                                                        if m.type == "error" else None))
                    page = context.new_page()
                    # A tenant key cannot sign in here.
                    page.goto(base + "/admin")
                    assert page.url.endswith("/admin/login")
                    page.fill("#api_key", keys["acme"])
                    page.click("#sign-in")
                    assert "admin key" in page.text_content("#login-error")
                    page.fill("#api_key", keys["admin"])
                    page.click("#sign-in")
                    page.wait_for_url(base + "/admin")
                    assert page.text_content("#current-version") == "version 1"
                    assert page.text_content("#current-hash") == v1["hash"]
                    # Edit the rule: acme now goes to the small engine. Then simulate it.
                    text = page.input_value("#document")
                    assert "pin: large" in text
                    page.fill("#document", text.replace("pin: large", "pin: small"))
                    page.click("#simulate")
                    page.wait_for_selector("#comparison")
                    def row(name: str) -> list[str]:
                        return page.locator(f'#comparison tr[data-row="{name}"] td').all_text_contents()
                    assert row("served") == ["served", "3", "3", "+0"]
                    assert row("large_calls") == ["large_calls", "3", "0", "-3"]
                    assert row("spend[small]")[1] == "0" and row("spend[large]")[2] == "0"
                    assert "pin: small" in page.input_value("#document")    # the edit is kept
                    page.screenshot(path=str(ARTIFACTS / "policy_page_simulation.png"), full_page=True)
                    # A broken edit shows precise problems and changes nothing.
                    page.fill("#document", page.input_value("#document").replace("pin: small", "pin: nope"))
                    page.click("#validate")
                    assert "rules[0].action.pin" in page.text_content("#problems")
                    page.fill("#document", page.input_value("#document").replace("pin: nope", "pin: small"))
                    page.click("#apply")
                    page.wait_for_url(base + "/admin?applied=2")
                    assert page.text_content("#current-version") == "version 2"
                    assert srv.gateway.policy.number == 2
                    assert chat(srv, keys["acme"])[1]["x-tokenyard-engine"] == "small"
                    assert page.locator('#history tr[data-version="2"] details pre').text_content().count("pin: small") == 1
                    # Roll back to version 1.
                    page.click("#rollback-1")
                    page.wait_for_url(base + "/admin?applied=3")
                    assert page.text_content("#current-version") == "version 3"
                    assert page.text_content("#current-hash") == v1["hash"]
                    assert srv.gateway.policy.version.document == POLICY
                    assert chat(srv, keys["acme"])[1]["x-tokenyard-engine"] == "large"
                    page.screenshot(path=str(ARTIFACTS / "policy_page.png"), full_page=True)
                    resp = page.request.get(base + "/admin")
                    assert "script-src 'none'" in resp.headers["content-security-policy"]
                    cookie = next(c for c in context.cookies() if c["name"] == "ty_session")
                    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
                    # A form without the CSRF token is refused.
                    resp = page.request.post(base + "/admin/rollback", form={"version": "2"})
                    assert resp.status == 403
                    page.click("#sign-out")
                    page.wait_for_url(base + "/admin/login")
                    # Only the statuses shown on purpose (403 tenant sign-in, 422 invalid edit);
                    # no CSP violation or script error.
                    assert [e for e in errors if not e.startswith("Failed to load resource")] == []
                finally:
                    browser.close()
    finally:
        delete_prefix(SHARED_REDIS, prefix)
