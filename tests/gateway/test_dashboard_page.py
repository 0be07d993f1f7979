"""The dashboard in headless Chromium (Debian's /usr/bin/chromium driven by playwright; no browser
download): sign in with a key, the page renders the ledger's data, the live-stats script runs under
the CSP, the CSV downloads, the session cookie is HttpOnly + SameSite=Strict, and sign-out works.

A screenshot is kept in tests/artifacts/ (gitignored). Without chromium or playwright the test
skips with the reason, except under CI=true, where it fails: `make test` installs chromium there.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import redis
from gateway_helpers import ROOT, SHARED_REDIS, delete_prefix, mock_deployment, running_gateway, unique_prefix, wait_ledger

from tokenyard.gateway.auth.api_keys import KeyStore

CHROMIUM = os.environ.get("TOKENYARD_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = ROOT / "tests" / "artifacts"


def _browser_or_skip():
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("the playwright package (pip install -e '.[dev]')")
        sync_playwright = None
    if not (Path(CHROMIUM).exists() or shutil.which("chromium")):
        missing.append(f"chromium at {CHROMIUM} (apt-get install -y chromium; `make test` does it as root or "
                       f"with CI=true)")
    if missing:
        message = "dashboard page tests need " + " and ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return sync_playwright


def _sign_in(context, base: str, key: str):
    page = context.new_page()
    page.goto(base + "/dashboard")
    assert page.url.endswith("/dashboard/login")
    page.fill("#api_key", key)
    page.click("#sign-in")
    page.wait_for_url(base + "/dashboard")
    return page


def test_dashboard_in_chromium():
    sync_playwright = _browser_or_skip()
    prefix = unique_prefix("page")
    client = redis.Redis.from_url(SHARED_REDIS)
    store = KeyStore(client, prefix)
    acme = store.create("acme", name="acme-ci")[0]
    globex = store.create("globex")[0]
    admin = store.create("ops", role="admin", name="ops")[0]
    doc = {**mock_deployment(ttft_ms=2, token_ms=1, prices={"input": 100_000, "output": 400_000}),
           "redis_url": SHARED_REDIS, "redis_prefix": prefix}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        with running_gateway(doc) as srv:
            for key, n in ((acme, 4), (globex, 2)):
                for i in range(n):
                    team = {"team": "<b>growth</b>"} if i % 2 else {}
                    assert srv.chat({"model": "mock", "messages": [{"role": "user", "content": f"x{i}"}],
                                     "metadata": team}, {"Authorization": f"Bearer {key}"})[0] == 200
            wait_ledger(srv)
            base = srv.base_url
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM if Path(CHROMIUM).exists()
                                            else shutil.which("chromium"), headless=True, args=["--no-sandbox"])
                try:
                    context = browser.new_context(accept_downloads=True)
                    problems: list[str] = []
                    context.on("page", lambda pg: pg.on("console", lambda m: problems.append(m.text)
                                                        if m.type == "error" else None))
                    page = _sign_in(context, base, admin)
                    page.on("pageerror", lambda e: problems.append(str(e)))
                    assert page.inner_text("#total-requests") == "6"
                    assert "mock" in page.inner_text("#by-model")
                    assert page.locator("#spend-chart rect.bar").count() >= 1
                    assert page.locator("#tenant option").all_inner_texts() == ["all tenants", "acme", "globex"]
                    assert page.locator("#latency tbody tr").count() == 1
                    # dashboard.js (from 'self') ran under the CSP and refreshed the live table.
                    page.wait_for_function("document.getElementById('live-updated').textContent.length > 0",
                                           timeout=5000)
                    assert page.evaluate("document.cookie") == ""            # HttpOnly: invisible to scripts
                    cookie = next(c for c in context.cookies() if c["name"] == "ty_session")
                    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
                    # Spend by key, then by a tag whose value is HTML: shown as text, never as markup.
                    assert page.locator("#breakdown tbody tr").count() == 2          # two keys made requests
                    page.select_option("#by", "tag")
                    page.fill("#tag", "team")
                    page.click("#breakdown-form button")
                    page.wait_for_url("**by=tag**")
                    cells = page.locator("#breakdown tbody td:first-child").all_inner_texts()
                    assert sorted(cells) == ["(none)", "<b>growth</b>"], cells
                    assert page.locator("#breakdown b").count() == 0
                    assert page.locator("#breakdown tbody td:nth-child(2)").all_inner_texts() == ["3", "3"]
                    # The live table's load columns were filled by dashboard.js.
                    page.wait_for_function(
                        "document.querySelector('#live td[data-k=\"tokens_per_s\"]').textContent !== '-'",
                        timeout=12000)
                    assert float(page.inner_text('#live td[data-k="busy_pct"]')) >= 0
                    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
                    with page.expect_download() as dl:
                        page.click("#csv")
                    lines = Path(dl.value.path()).read_text().splitlines()
                    assert lines[0].startswith("day,model,requests,") and len(lines) >= 2
                    assert not [m for m in problems if "Content Security Policy" in m or "Refused" in m], problems
                    page.click("#sign-out")
                    page.wait_for_url(base + "/dashboard/login")
                    page.goto(base + "/dashboard")
                    assert page.url.endswith("/dashboard/login")
                    # A tenant's key: its own numbers only, no tenant picker.
                    tenant_ctx = browser.new_context()
                    tpage = _sign_in(tenant_ctx, base, acme)
                    assert tpage.inner_text("#total-requests") == "4"
                    assert tpage.locator("#tenant").count() == 0 and "globex" not in tpage.content()
                    tpage.goto(base + "/dashboard?tenant=globex")
                    assert "tenant_forbidden" in tpage.content()
                    tpage.screenshot(path=str(ARTIFACTS / "dashboard-tenant.png"), full_page=True)
                finally:
                    browser.close()
    finally:
        client.close()
        delete_prefix(SHARED_REDIS, prefix)
