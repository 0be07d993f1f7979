"""The deployment keys of the spend ledger, dashboard and /metrics access: defaults, errors, docs."""
from __future__ import annotations

import pytest
from gateway_helpers import ROOT, mock_deployment

from tokenyard.gateway.config.deployment import DeploymentError, parse_deployment
from tokenyard.gateway.config.spend_settings import DashboardConfig, MetricsConfig, SpendConfig

DEPLOYMENT_PAGE = (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")
SPEND_PAGE = (ROOT / "docs" / "cost-analysts.md").read_text(encoding="utf-8")


def test_defaults_are_safe_and_documented():
    dep = parse_deployment(mock_deployment(), base_dir=ROOT)
    web = dep.web
    assert web.spend.enabled and web.spend.spool_fsync == "always" and web.spend.spool_dir.is_absolute()
    assert web.metrics.access == "loopback" and web.dashboard.cookie_secure == "auto"
    assert dep.baseline_engine == "mock"
    for section, cls in (("spend", SpendConfig), ("dashboard", DashboardConfig), ("metrics", MetricsConfig)):
        for key in cls.__slots__:
            assert f"`{section}.{key}`" in DEPLOYMENT_PAGE, f"deployment key {section}.{key} is not documented"
    for path in ("/v1/spend/report", "/v1/spend/requests", "/dashboard", "tokenyard spend report"):
        assert path in SPEND_PAGE


@pytest.mark.parametrize("patch, message", [
    ({"spend": {"bogus": 1}}, "unknown key(s) spend.bogus"),
    ({"spend": {"spool_fsync": "sometimes"}}, "spend.spool_fsync must be one of always, never"),
    ({"spend": {"baseline_engine": "nope"}}, "spend.baseline_engine names engine 'nope'"),
    ({"spend": {"stream_max_len": 0}}, "spend.stream_max_len must be a positive integer"),
    ({"spend": {"replay_interval_s": 0}}, "spend.replay_interval_s must be a number > 0"),
    ({"dashboard": {"cookie_secure": "yes"}}, "dashboard.cookie_secure must be one of auto, always, never"),
    ({"dashboard": {"session_ttl_s": "1h"}}, "dashboard.session_ttl_s must be an int"),
    ({"metrics": {"access": "everyone"}}, "metrics.access must be one of loopback, open, admin"),
])
def test_bad_keys_are_named(patch, message):
    with pytest.raises(DeploymentError) as e:
        parse_deployment({**mock_deployment(), **patch}, base_dir=ROOT)
    assert message in str(e.value)
