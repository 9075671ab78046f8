"""The routing policy of the cluster, free of Ray (the RequestRouter in router.py applies it).

Replicas are known by their *tag* (see ids.py). For each request the policy ranks live tags:

1. an explicit ``tag`` (the ingress's own per-replica calls): that replica only;
2. a known ``session_id``: the replica holding the session (when the request also names a pool,
   only if that replica holds a copy of the pool);
3. a ``pool_id``: the replicas holding the pool or a copy of it; several copies: least loaded
   first, so attaches spread across copies;
4. otherwise the prompt's canonical prefix: the replica with the longest cached prefix for it
   (the router's prefix view: what it routed where), unless that replica's load exceeds the
   least loaded one's by more than ``imbalance_threshold`` in-flight requests, or the match is
   shorter than ``match_threshold`` of the prompt, in which case the least loaded replica.

Loads are the requests this router has in flight on each replica. Ties go to the replica with
the least prefix text in the view (as Ray Serve LLM's router prefers its smallest tenant), then
to the one chosen least often, so new prefixes and pools created one after another spread evenly.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

from .hints import Hint
from .ids import tag_of


@dataclass
class RoutingOptions:
    imbalance_threshold: float = 4.0  # in-flight requests
    match_threshold: float = 0.1  # share of the prompt that must match to follow the prefix
    chunk_chars: int = 16  # prefix view granularity
    max_prefix_entries: int = 200_000
    max_sessions: int = 100_000

    def __post_init__(self) -> None:
        if not (self.imbalance_threshold >= 0):
            raise ValueError(f"imbalance_threshold must be >= 0, got {self.imbalance_threshold!r}")
        if not (0 <= self.match_threshold <= 1):
            raise ValueError(f"match_threshold must be in [0, 1], got {self.match_threshold!r}")
        if not (isinstance(self.chunk_chars, int) and self.chunk_chars >= 1):
            raise ValueError(f"chunk_chars must be a positive integer, got {self.chunk_chars!r}")


class PrefixIndex:
    """Which replica has seen which prompt prefix, at ``chunk`` character granularity.

    Each full chunk of a prompt is keyed by a chained hash (the key of chunk i covers the whole
    text before its end), so equal keys mean equal prefixes. Entries are evicted LRU.
    """

    def __init__(self, chunk: int = 16, max_entries: int = 200_000):
        self.chunk = chunk
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, dict[int, None]] = OrderedDict()
        self.size: dict[int, int] = {}  # tag -> chunks held (the "tenant size")

    def keys(self, text: str) -> list[bytes]:
        data = text.encode("utf-8", "surrogatepass")
        h = hashlib.blake2b(digest_size=12)
        out = []
        for i in range(0, len(data) - self.chunk + 1, self.chunk):
            h.update(data[i:i + self.chunk])
            out.append(h.copy().digest())
        return out

    def match(self, text: str, tags) -> dict[int, int]:
        """Matched length (bytes of the prompt) per tag in ``tags``."""
        want = set(tags)
        out = {t: 0 for t in want}
        alive = set(want)
        for i, k in enumerate(self.keys(text)):
            holders = self._entries.get(k)
            if not holders:
                break
            alive &= holders.keys()
            if not alive:
                break
            for t in alive:
                out[t] = (i + 1) * self.chunk
        return out

    def insert(self, text: str, tag: int) -> None:
        for k in self.keys(text):
            holders = self._entries.get(k)
            if holders is None:
                holders = self._entries[k] = {}
            else:
                self._entries.move_to_end(k)
            if tag not in holders:
                holders[tag] = None
                self.size[tag] = self.size.get(tag, 0) + 1
        while len(self._entries) > self.max_entries:
            _, gone = self._entries.popitem(last=False)
            for t in gone:
                self.size[t] -= 1

    def drop_tag(self, tag: int) -> None:
        self.size.pop(tag, None)
        for k in [k for k, v in self._entries.items() if tag in v]:
            v = self._entries[k]
            v.pop(tag, None)
            if not v:
                del self._entries[k]

    def __len__(self) -> int:
        return len(self._entries)


class RoutingPolicy:
    """Routing state shared by the router and the ingress of one process (thread-safe)."""

    def __init__(self, options: RoutingOptions | None = None):
        self.options = options or RoutingOptions()
        self._lock = threading.RLock()
        self.index = PrefixIndex(self.options.chunk_chars, self.options.max_prefix_entries)
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.copies: dict[int, dict[int, int]] = {}  # logical pool id -> {tag: local pool id}
        self.live: dict[int, dict] = {}  # tag -> replica metadata
        self.load: dict[int, int] = {}  # tag -> requests in flight from this router
        self.chosen: dict[int, int] = {}  # tag -> times chosen
        self.attaches: dict[tuple[int, int], int] = {}  # (pool id, tag) -> requests sent to that copy
        self.decisions: dict[str, int] = {}  # reason -> count (for /metrics)

    def configure(self, options: RoutingOptions) -> None:
        with self._lock:
            self.options = options
            if options.chunk_chars != self.index.chunk:
                self.index = PrefixIndex(options.chunk_chars, options.max_prefix_entries)
            self.index.max_entries = options.max_prefix_entries

    # ------------------------------------------------------------------ replica set
    def set_live(self, live: dict[int, dict]) -> None:
        with self._lock:
            gone = set(self.live) - set(live)
            self.live = dict(live)
            for t in gone:
                self.index.drop_tag(t)
                self.load.pop(t, None)
            for sid in [s for s, t in self.sessions.items() if t in gone]:
                del self.sessions[sid]

    def live_tags(self) -> list[int]:
        with self._lock:
            return sorted(self.live)

    # ------------------------------------------------------------------ pools and sessions
    def holders(self, pool_id: int) -> dict[int, int]:
        """{tag: local pool id} of the live replicas holding ``pool_id`` or a copy of it."""
        with self._lock:
            out = {}
            primary = tag_of(pool_id)
            if primary is not None and primary in self.live:
                out[primary] = pool_id
            for t, local in self.copies.get(pool_id, {}).items():
                if t in self.live:
                    out[t] = local
            return out

    def set_copies(self, copies: dict[int, dict[int, int]]) -> None:
        with self._lock:
            self.copies = {int(k): {int(t): int(p) for t, p in v.items()} for k, v in copies.items()}

    def add_copy(self, pool_id: int, tag: int, local_id: int) -> None:
        with self._lock:
            self.copies.setdefault(pool_id, {})[tag] = local_id

    def drop_pool(self, pool_id: int) -> None:
        with self._lock:
            self.copies.pop(pool_id, None)
            for key in [k for k in self.attaches if k[0] == pool_id]:
                del self.attaches[key]

    def remember_session(self, session_id: str, tag: int) -> None:
        with self._lock:
            self.sessions[session_id] = tag
            self.sessions.move_to_end(session_id)
            while len(self.sessions) > self.options.max_sessions:
                self.sessions.popitem(last=False)

    # ------------------------------------------------------------------ the decision
    def _by_load(self, tags) -> list[int]:
        # ties: the replica with the least cached prefix text, then the one chosen least often
        return sorted(tags, key=lambda t: (self.load.get(t, 0), self.index.size.get(t, 0), self.chosen.get(t, 0), t))

    def rank(self, hint: Hint, candidates=None) -> tuple[list[int], str]:
        """(tags in order of preference, reason). Only the first is used unless it refuses the
        request; for pool and session affinity the list has the affine replicas only."""
        with self._lock:
            live = [t for t in (candidates if candidates is not None else self.live) if t in self.live]
            if not live:
                return [], "no_replica"
            if hint.tag is not None:
                return ([hint.tag], "explicit") if hint.tag in live else ([], "explicit_gone")
            holders = self.holders(hint.pool_id) if hint.pool_id is not None else None
            if hint.session_id is not None:
                t = self.sessions.get(hint.session_id)
                if t in live and (holders is None or t in holders):
                    return [t], "session"
            if holders is not None:
                if holders:
                    # least loaded copy first; between equally loaded copies the one that got fewer
                    # of this pool's requests, so attaches spread across copies
                    pid = hint.pool_id
                    return sorted(holders, key=lambda t: (self.load.get(t, 0), self.attaches.get((pid, t), 0), t)), \
                        "pool"
                # the pool's replica is gone (or the id is not a pool of this cluster): the
                # replica that gets it answers 410 / 404
                return self._by_load(live)[:1], "pool_gone"
            ranked = self._by_load(live)
            if hint.prefix:
                loads = [self.load.get(t, 0) for t in live]
                if max(loads) - min(loads) > self.options.imbalance_threshold:
                    return ranked, "imbalanced"
                matched = self.index.match(hint.prefix, live)
                best = max(live, key=lambda t: (matched[t], -ranked.index(t)))
                n = len(hint.prefix.encode("utf-8", "surrogatepass"))
                if matched[best] > 0 and matched[best] >= self.options.match_threshold * n:
                    return [best] + [t for t in ranked if t != best], "prefix"
                return ranked, "least_loaded"
            return ranked, "least_loaded"

    def routed(self, hint: Hint, tag: int, reason: str | None = None) -> None:
        """Bookkeeping once a request went to ``tag``."""
        with self._lock:
            self.load[tag] = self.load.get(tag, 0) + 1
            if hint.tag is None:  # the ingress's own per-replica calls do not count as choices
                self.chosen[tag] = self.chosen.get(tag, 0) + 1
            if reason:
                self.decisions[reason] = self.decisions.get(reason, 0) + 1
            if hint.session_id is not None and hint.tag is None:
                self.remember_session(hint.session_id, tag)
            if hint.prefix and hint.tag is None:
                self.index.insert(hint.prefix, tag)
            if hint.pool_id is not None and hint.tag is None:
                key = (hint.pool_id, tag)
                self.attaches[key] = self.attaches.get(key, 0) + 1

    def learn_prefix(self, prefix: str, tag: int) -> None:
        """``tag`` holds ``prefix`` now (a request the ingress placed there itself, e.g. a pool that
        another replica refused to create)."""
        with self._lock:
            self.index.insert(prefix, tag)

    def unroute(self, hint: Hint, tag: int, reason: str | None = None) -> None:
        """Undo the counts of ``routed`` (a request that went elsewhere than first chosen)."""
        with self._lock:
            if self.load.get(tag, 0) > 0:
                self.load[tag] -= 1
            if hint.tag is None and self.chosen.get(tag, 0) > 0:
                self.chosen[tag] -= 1
            if reason and self.decisions.get(reason, 0) > 0:
                self.decisions[reason] -= 1
            key = (hint.pool_id, tag)
            if hint.pool_id is not None and hint.tag is None and self.attaches.get(key, 0) > 0:
                self.attaches[key] -= 1

    def completed(self, tag: int) -> None:
        with self._lock:
            if self.load.get(tag, 0) > 0:
                self.load[tag] -= 1


# one policy per process: the ingress and the router of its engine handle share it
POLICY = RoutingPolicy()
