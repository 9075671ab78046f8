"""``OpencotiRouter``: a Ray Serve ``RequestRouter`` for the engine replicas.

Ray Serve calls a deployment's request router inside the process that holds the deployment
handle. HTTP traffic reaches the first deployment through Ray's proxy, which streams the body to
the replica, so a router in front of that deployment sees neither the body nor the pool id. The
cluster therefore has a thin ingress deployment (the same pattern as Ray Serve LLM's ingress in
front of ``PrefixCacheAffinityRouter``): it reads each request once, derives a routing hint
(hints.py) and calls the engine deployment through its handle with ``route=<hint>``; this router
reads the hint from the pending request and applies the routing policy (policy.py).

Each replica publishes its tag in ``record_replica_metadata``, which Ray hands to the router
with the replica itself, so a pool id resolves to its replica as soon as the replica is routable.
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import policy as _policy
from .hints import Hint

log = logging.getLogger("opencoti.cluster")


def replica_tag(replica: RunningReplica) -> int | None:
    t = replica.replica_metadata.get("tag")
    return t if isinstance(t, int) else None


class OpencotiRouter(RequestRouter):
    """Pool-, session- and prefix-affine routing (see policy.py); options via
    ``request_router_kwargs``: imbalance_threshold, match_threshold, chunk_chars."""

    def initialize_state(self, **kwargs) -> None:
        # the process-wide policy (shared with the ingress); referenced through its module because
        # Ray pickles this module by value
        self.policy = _policy.POLICY
        self.policy.configure(_policy.RoutingOptions(**kwargs))
        self._tag_of: dict[ReplicaID, int] = {}
        self._inflight: dict[str, int] = {}  # internal request id -> tag
        # internal request id -> (first choice, reason, hint, time): counted, not yet sent
        self._predicted: dict[str, tuple] = {}

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {}
        tags = {}
        for r in replicas:
            t = replica_tag(r)
            if t is not None:
                live[t] = {"replica_id": r.replica_id.unique_id, **r.replica_metadata}
                tags[r.replica_id] = t
        self._tag_of = tags
        self.policy.set_live(live)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        t = self._tag_of.pop(replica_id, None)
        if t is not None:
            live = {k: v for k, v in self.policy.live.items() if k != t}
            self.policy.set_live(live)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        by_tag = {}
        for r in candidate_replicas:
            t = self._tag_of.get(r.replica_id)
            if t is None:
                t = replica_tag(r)
            if t is not None:
                by_tag[t] = r
        if pending_request is None:
            ranked, _ = self.policy.rank(Hint(), list(by_tag))
            return [[by_tag[t]] for t in ranked]
        # without this, the base class retries a refusing replica in a busy loop
        pending_request.routing_context.should_backoff = True
        rid = pending_request.metadata.internal_request_id
        hint = Hint.from_dict(pending_request.kwargs.get("route"))
        prev = self._predicted.pop(rid, None)
        if prev is not None:  # routed again (the first choice refused it): forget the first guess
            self.policy.unroute(hint, prev[0], prev[1])
        ranked, reason = self.policy.rank(hint, list(by_tag))
        if ranked:
            # count the request on its first choice now, not once it is sent: requests that arrive
            # together are ranked before any of them is sent, and must see each other's load
            self.policy.routed(hint, ranked[0], reason)
            self._expire_predictions()
            self._predicted[rid] = (ranked[0], reason, hint, time.monotonic())
        return [[by_tag[t]] for t in ranked]

    def _expire_predictions(self, max_age_s: float = 120.0) -> None:
        """Requests cancelled before they were sent never reach on_request_routed: uncount them."""
        now = time.monotonic()
        if len(self._predicted) < 64 and not any(now - p[3] > max_age_s for p in self._predicted.values()):
            return
        for rid, (tag, reason, hint, ts) in list(self._predicted.items()):
            if now - ts > max_age_s:
                del self._predicted[rid]
                self.policy.unroute(hint, tag, reason)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        rid = pending_request.metadata.internal_request_id
        t = self._tag_of.get(replica_id)
        pred = self._predicted.pop(rid, None)
        if t is None:
            return
        if pred is None or pred[0] != t:
            hint = Hint.from_dict(pending_request.kwargs.get("route"))
            if pred is not None:
                self.policy.unroute(hint, pred[0], pred[1])
            self.policy.routed(hint, t, pred[1] if pred is not None else None)
        self._inflight[rid] = t

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        t = self._inflight.pop(internal_request_id, None)
        if t is not None:
            self.policy.completed(t)
