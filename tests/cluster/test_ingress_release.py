"""``DELETE /polykv/pools/{id}`` through the cluster ingress carries its query to every holder:
``?cascade=sessions`` (and ``immediate``) reach the pool's own replica (the forwarded query string)
and each replica holding a copy (``drop_copy``), whose ended sessions join the answer. Stand-in
replicas, no Ray cluster (the module needs the cluster extra because the ingress imports Ray)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray.serve", reason="needs the cluster extra (Ray Serve): pip install -e '.[cluster]'")

from fastapi.testclient import TestClient  # noqa: E402

from opencoti.cluster import routes  # noqa: E402
from opencoti.cluster.ids import id_base  # noqa: E402
from opencoti.cluster.ingress import ClusterIngress, ingress_app  # noqa: E402
from opencoti.cluster.policy import POLICY  # noqa: E402
from opencoti.cluster.replica import EngineReplica  # noqa: E402
from opencoti.engine import SamplingParams  # noqa: E402

ROOT = list(range(10, 42))


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Registry:
    def __init__(self):
        self.dropped = []

        async def drop(pid):
            self.dropped.append(pid)
        self.drop_pool = _Remote(drop)


class _Ingress:
    """What the pool route asks of ClusterIngress: the primary's answer to the forwarded request
    (its query string recorded) and the copies' drop_copy calls."""

    replica_request = staticmethod(ClusterIngress.replica_request)

    def __init__(self, primary_answer: dict):
        self.registry = _Registry()
        self.forwarded: list[dict] = []
        self.calls: list[tuple] = []
        self.answer = primary_answer

    async def sync_copies(self, max_age_s: float = 0.5):
        return None

    async def collect(self, req, hint):
        self.forwarded.append({**req, "tag": hint.tag})
        return 200, {}, json.dumps(self.answer).encode()

    def call(self, method, hint, *args):
        async def run():
            self.calls.append((method, hint.tag, *args))
            return ["copy-session"] if args[2] else []
        return run()


@pytest.fixture
def two_holders(monkeypatch):
    pid = id_base(1) + 1  # a pool of replica 1, copied to replica 2
    saved_live, saved_copies = dict(POLICY.live), {k: dict(v) for k, v in POLICY.copies.items()}
    POLICY.set_live({1: {}, 2: {}})
    POLICY.set_copies({pid: {2: id_base(2) + 7}})
    ing = _Ingress({"pool_id": pid, "released": True, "release_in_s": None, "ended_sessions": ["own"]})
    monkeypatch.setattr(routes, "_ingress", lambda: ing)
    yield pid, ing
    POLICY.set_live(saved_live)
    POLICY.set_copies(saved_copies)


def test_delete_cascade_sessions_reaches_the_pool_and_every_copy(two_holders):
    pid, ing = two_holders
    with TestClient(ingress_app) as c:
        r = c.delete(f"/polykv/pools/{pid}?cascade=sessions&immediate=true")
    assert r.status_code == 200, r.text
    assert [(f["tag"], f["method"], f["query"]) for f in ing.forwarded] == [
        (1, "DELETE", "cascade=sessions&immediate=true")]
    assert ing.calls == [("drop_copy", 2, pid, True, True)]  # before: ("drop_copy", 2, pid, True), no cascade
    out = r.json()
    assert out["ended_sessions"] == ["own", "copy-session"] and out["replica"] == 1
    assert ing.registry.dropped == [pid] and pid not in POLICY.copies


def test_delete_without_cascade_ends_no_copy_session_and_a_bad_cascade_drops_nothing(two_holders):
    pid, ing = two_holders
    with TestClient(ingress_app) as c:
        bad = c.delete(f"/polykv/pools/{pid}?cascade=everything")
        assert bad.status_code == 400 and "cascade" in bad.json()["error"]["message"]
        assert ing.forwarded == [] and ing.calls == [] and pid in POLICY.copies  # refused before anything
        r = c.delete(f"/polykv/pools/{pid}")
    assert r.status_code == 200 and ing.calls == [("drop_copy", 2, pid, False, False)]


def test_a_replicas_drop_copy_ends_the_sessions_of_its_copy(make_engine):
    eng = make_engine(session_ttl_s=300.0)
    rep = EngineReplica.__new__(EngineReplica)  # the replica's methods over a local engine
    rep.engine = eng
    local = eng.create_pool(tokens=ROOT).pool_id
    eng.generate(ROOT + [3], params=SamplingParams.greedy(2), pool_id=local, session_id="reader")
    rep.aliases = {123: local}
    assert rep.drop_copy(123, True, True, route={}) == ["reader"]
    assert "reader" not in eng.core.polykv.sessions and eng.pools()["pools"] == []
    assert rep.drop_copy(123, True, True, route={}) is None  # no copy here any more
