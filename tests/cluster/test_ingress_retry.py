"""The ingress's retry of a refused root pool creation, with stand-in replicas (no Ray cluster is
started; needs the cluster extra because the ingress module imports Ray)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve", reason="needs the cluster extra (Ray Serve): pip install -e '.[cluster]'")

from opencoti.cluster.hints import Hint  # noqa: E402
from opencoti.cluster.ingress import ClusterIngress, ReplicaError  # noqa: E402
from opencoti.cluster.policy import POLICY  # noqa: E402


class _Gen:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


def _head(status: int, tag: int) -> dict:
    return {"status": status, "headers": [("x-opencoti-replica", str(tag))]}


@pytest.fixture
def ingress():
    saved = dict(POLICY.live)
    POLICY.set_live({1: {}, 2: {}, 3: {}})
    ing = ClusterIngress.__new__(ClusterIngress)
    ing.affinity = True
    yield ing
    POLICY.set_live(saved)


def _replicas(ing, answers: dict):
    """Each replica's answer to a forwarded request: a status, or an exception it raises."""
    asked = []

    async def _open(req, hint):
        asked.append(hint.tag)
        a = answers[hint.tag]
        if isinstance(a, Exception):
            raise a
        return _head(a, hint.tag), _Gen()

    ing._open = _open
    return asked


def _create(ing, first: int):
    gen = _Gen()
    head, out = asyncio.run(ing._create_elsewhere({"method": "POST", "path": "/polykv/pools"}, Hint(),
                                                  _head(503, first), gen))
    return head, out, gen


def test_a_replica_that_fails_is_passed_over(ingress):
    # replica 1 refused (503); one of the others died since it was listed: the third creates the pool
    for answers in ({2: ReplicaError(503, "replica gone", "server_error"), 3: 200},
                    {2: 200, 3: ReplicaError(503, "replica gone", "server_error")}):
        asked = _replicas(ingress, answers)
        head, _, first_gen = _create(ingress, 1)
        ok = next(t for t, a in answers.items() if a == 200)
        assert head == _head(200, ok) and asked[-1] == ok and 1 not in asked
        assert first_gen.cancelled


def test_the_refusal_stands_when_no_other_replica_answers(ingress):
    asked = _replicas(ingress, {2: ReplicaError(503, "replica gone", "server_error"),
                                3: ReplicaError(500, "the replica sent no answer", "server_error")})
    head, gen, first_gen = _create(ingress, 1)
    assert sorted(asked) == [2, 3]
    assert head == _head(503, 1) and gen is first_gen and not first_gen.cancelled


def test_every_replica_refusing_answers_the_last_refusal(ingress):
    asked = _replicas(ingress, {2: 503, 3: 503})
    head, _, first_gen = _create(ingress, 1)
    assert sorted(asked) == [2, 3] and head["status"] == 503 and first_gen.cancelled
