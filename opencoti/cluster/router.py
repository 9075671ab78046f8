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
        self._reasons: dict[str, str] = {}  # internal request id -> why it went there

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
        if pending_request is not None:
            # without this, the base class retries a refusing replica in a busy loop
            pending_request.routing_context.should_backoff = True
        hint = Hint.from_dict(pending_request.kwargs.get("route") if pending_request is not None else None)
        ranked, reason = self.policy.rank(hint, list(by_tag))
        if pending_request is not None:
            if len(self._reasons) > 10_000:  # requests cancelled before routing leave entries behind
                self._reasons.clear()
            self._reasons[pending_request.metadata.internal_request_id] = reason
        return [[by_tag[t]] for t in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        rid = pending_request.metadata.internal_request_id
        reason = self._reasons.pop(rid, None)
        t = self._tag_of.get(replica_id)
        if t is None:
            return
        self.policy.routed(Hint.from_dict(pending_request.kwargs.get("route")), t, reason)
        self._inflight[rid] = t

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        t = self._inflight.pop(internal_request_id, None)
        if t is not None:
            self.policy.completed(t)
