"""Replica pool pieces without processes: the prefix hash chain, the LRU affinity index, the
replica score, the deployment keys, and a pool mixing an in-process and a remote replica."""
from __future__ import annotations

import pytest
from replica_helpers import ROOT, pool_deployment, start_replicas

from tokenyard.gateway.backends.prefix_affinity import AffinityIndex, prefix_hashes
from tokenyard.gateway.backends.remote_engine import empty_stats
from tokenyard.gateway.backends.replica_pool import Replica, ReplicaPool
from tokenyard.gateway.config.deployment import DeploymentError, parse_deployment
from tokenyard.gateway.config.replica_config import PoolConfig


def test_hash_chain_follows_shared_leading_blocks_and_salt():
    a = prefix_hashes(list(range(100)), 16, 32)
    b = prefix_hashes(list(range(64)) + [999] * 36, 16, 32)
    assert len(a) == 6 and a[:4] == b[:4] and a[4] != b[4]
    assert prefix_hashes(list(range(100)), 16, 32, salt="acme") != a        # tenants never share
    assert len(prefix_hashes(list(range(1000)), 16, 5)) == 5 and prefix_hashes([1, 2], 16, 5) == []


def test_affinity_index_matches_leading_blocks_and_is_lru_bounded():
    idx = AffinityIndex(capacity=8)
    h = prefix_hashes(list(range(96)), 16, 32)                             # 6 blocks
    idx.record(h)
    assert idx.match(h) == 6 and idx.match(prefix_hashes(list(range(40)), 16, 32)) == 2
    idx.record(prefix_hashes([7] * 64, 16, 32))                            # 4 more: 2 of the first evicted
    assert len(idx) == 8
    assert idx.match(h) == 4                      # the deepest blocks go first, the shared roots stay


class _FakeEngine:
    dead = None

    def __init__(self, in_flight=0, kv=0.0):
        self.num_in_flight = in_flight
        self._s = empty_stats(max_num_seqs=8)
        self._s.kv_usage = kv

    def stats(self):
        return self._s


def _pool(*engines, **cfg):
    c = PoolConfig(**cfg)
    return ReplicaPool("e", [Replica(f"r{i}", e, c, remote=False) for i, e in enumerate(engines)], c)


def test_score_prefers_the_prefix_holder_unless_it_is_much_busier():
    a, b = _FakeEngine(), _FakeEngine()
    pool = _pool(a, b)
    prompt = list(range(200))
    first = pool.choose(prompt, None)
    assert all(pool.choose(prompt, None) is first for _ in range(5))
    first.engine.num_in_flight = 12               # busier by 12 < affinity_weight 16: still there
    assert pool.choose(prompt, None) is first
    first.engine.num_in_flight = 20               # busier by 20: the load wins
    assert pool.choose(prompt, None) is not first
    b.num_in_flight = a.num_in_flight = 0
    seen = [pool.choose([k] * 64, None).label for k in range(10)]            # unseen prefixes alternate
    assert seen.count("r0") == seen.count("r1") == 5
    rr = _pool(_FakeEngine(), _FakeEngine(), policy="round_robin")
    assert [rr.choose(prompt, None).label for _ in range(4)] == ["r0", "r1", "r0", "r1"]


def test_deployment_replica_keys_are_checked_and_named():
    model = str(ROOT / "models" / "demo-small")
    dep = parse_deployment(pool_deployment(["http://10.0.0.1:9000/", "http://10.0.0.2:9000"], local=True,
                                           policy="round_robin", health_interval_s=2))
    spec = dep.engines["mock"].replicas
    assert [r.url for r in spec.replicas] == ["http://10.0.0.1:9000", "http://10.0.0.2:9000", None]
    assert spec.replicas[2].local and spec.pool.policy == "round_robin" and spec.pool.health_interval_s == 2.0
    bad = [({"replicas": []}, "engines.m.replicas must be"),
           ({"replicas": [{"url": "ftp://x"}]}, "engines.m.replicas[0].url"),
           ({"replicas": [{"url": "http://a:1"}, {"url": "http://a:1"}]}, "listed twice"),
           ({"replicas": [{"local": True}, {"local": True}]}, "at most one local"),
           ({"replicas": [{"url": "http://a:1"}], "replica_pool": {"policy": "random"}}, "replica_pool.policy"),
           ({"replicas": [{"url": "http://a:1"}], "replica_pool": {"bogus": 1}}, "engines.m.replica_pool.bogus"),
           ({"replicas": [{"url": "http://a:1"}], "replica_pool": {"max_attempts": 0}}, "max_attempts"),
           ({"replica_pool": {}}, "needs engines.m.replicas")]
    for extra, message in bad:
        with pytest.raises(DeploymentError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_deployment({"engines": {"m": {"type": "mock", "model": model, **extra}}})


def test_local_and_remote_replicas_mix_in_one_pool(tmp_path):
    from gateway_helpers import running_gateway
    reps = start_replicas(tmp_path, 1, output_len=3)
    try:
        with running_gateway(pool_deployment([reps[0].url], local=True, policy="round_robin")) as srv:
            pool = srv.engine()
            for i in range(4):
                status, _, body = srv.chat({"model": "mock", "messages": [{"role": "user", "content": str(i)}]})
                assert status == 200 and body["usage"]["completion_tokens"] > 0
            assert [r.chosen for r in pool.replicas] == [2, 2]
            assert pool.stats().max_num_seqs == 2 * 256 and pool.max_model_len == 4096
    finally:
        reps[0].stop()
