"""Every key the deployment parser accepts is documented in docs/deployment.md.

The accepted keys come from the parser's own data (deployment.KNOWN_KEYS: the sets its unknown-key checks
use, most of them a settings dataclass's fields), never from a list kept here, so a key added to the
parser fails this test until the reference table has a row for it. An engine's remaining keys go to
EngineConfig (documented in docs/engine.md, which deployment.md points to) or MockConfig (deployment.md's
"Mock engine keys").
"""
from __future__ import annotations

import re
from dataclasses import fields

from gateway_helpers import ROOT

from tokenyard.engines.core.config import EngineConfig
from tokenyard.engines.serving.mock_engine import MockConfig
from tokenyard.gateway.config.deployment import KNOWN_KEYS

DEPLOYMENT_PAGE = (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")
ENGINE_PAGE = (ROOT / "docs" / "engine.md").read_text(encoding="utf-8")


def table_keys(page: str) -> set[str]:
    """The keys named in the first cell of a reference table's rows. A cell may name several
    (`spend.alerts.backoff_s` / `max_backoff_s`): a name without a dot shares the first one's parent."""
    keys: set[str] = set()
    for line in page.splitlines():
        cells = line.split("|")
        if len(cells) < 3 or not line.startswith("|"):
            continue
        names = re.findall(r"`([^`]+)`", cells[1])
        if names:
            parent = names[0].rpartition(".")[0]
            keys.update(n if "." in n or not parent else f"{parent}.{n}" for n in names)
    return keys


def accepted_keys() -> set[str]:
    """Every key path the parser accepts; a mapping with its own entry in KNOWN_KEYS counts through its keys."""
    out = set()
    for section, keys in KNOWN_KEYS.items():
        for key in keys:
            path = f"{section}.{key}" if section else key
            if path not in KNOWN_KEYS:
                out.add(path)
    return out


def undocumented(accepted: set[str], documented: set[str]) -> list[str]:
    """Keys without a row; a row for a sub-key (`pools.bulk.ENGINE`) documents the key above it."""
    return sorted(k for k in accepted if k not in documented and not any(d.startswith(k + ".") for d in documented))


def test_every_deployment_key_has_a_row_in_docs_deployment():
    accepted = accepted_keys()
    # the parser's sets reach every section: a sample of keys from each source of them
    assert {"server.keep_alive_s", "batch.poll_s", "router.cost_cap", "spend.alerts.max_attempts",
            "engines.NAME.replica_pool.max_model_len", "engines.NAME.prices.cached_input", "redis_url"} <= accepted
    missing = undocumented(accepted, table_keys(DEPLOYMENT_PAGE))
    assert not missing, f"deployment keys without a row in docs/deployment.md: {', '.join(missing)}"


def test_a_key_without_a_row_is_caught():
    """The check itself: a key the table lacks is reported, a documented sub-key covers its parent."""
    documented = table_keys("| key | default | meaning |\n| `pools.bulk.ENGINE` | none | x |\n"
                            "| `spend.alerts.backoff_s` / `max_backoff_s` | 1 / 300 | y |\n")
    assert documented == {"pools.bulk.ENGINE", "spend.alerts.backoff_s", "spend.alerts.max_backoff_s"}
    assert undocumented({"pools.bulk", "spend.alerts.max_backoff_s", "server.new_key"}, documented) == ["server.new_key"]


def test_every_engine_option_is_documented():
    """A torch engine's other keys are EngineConfig's fields (the option table in docs/engine.md); a mock
    engine's are MockConfig's, listed in docs/deployment.md."""
    engine_rows = table_keys(ENGINE_PAGE)
    missing = sorted(f.name for f in fields(EngineConfig) if f.name not in engine_rows)
    assert not missing, f"EngineConfig keys without a row in docs/engine.md: {', '.join(missing)}"
    mock_text = DEPLOYMENT_PAGE.partition("Mock engine keys:")[2]
    missing = sorted(f.name for f in fields(MockConfig) if f"`{f.name}`" not in mock_text)
    assert not missing, f"mock engine keys not in docs/deployment.md's 'Mock engine keys': {', '.join(missing)}"
