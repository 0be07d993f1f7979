"""A policy's fallback chain picks the first live engine it covers the failure for, skipping tried ones."""
from tokenyard.policies.schema import Fallback


def test_next_engine_in_chain_order_live_and_untried_only():
    chain = Fallback(engines=("a", "b", "c"), on=("error", "rate_limit"))
    assert chain.next_engine("error", lambda n: True) == "a"
    assert chain.next_engine("error", lambda n: n != "a") == "b"
    assert chain.next_engine("rate_limit", lambda n: True, tried=("a", "b")) == "c"
    assert chain.next_engine("context_length", lambda n: True) is None       # not a condition of this chain
    assert chain.next_engine("error", lambda n: False) is None
