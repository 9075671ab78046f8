"""``PrefixCache``: automatic prefix sharing, in-flight waits and realignment (step thread only).

The object beside ``PolyKV`` (``state.py``) that EngineCore composes.

A request that names no pool finds the longest prefix of its prompt whose KV is resident —
pages of pools, of live sessions, or cache left by finished requests — through the prefix index
(kv/prefix_index.py) and shares those pages copy-free; only the rest is computed. Requests that
arrive together compute a shared prefix once: a waiting request whose next uncached page is
being computed by a running request waits for it (a step or two) instead of computing it too.

Memory (which idle caches and pools go when pages run short) is ``PolyKV.reclaim``.

Realignment: a conversation sent again as text carries the model's earlier answers, and the
tokenizer may spell an answer with other ids than the model generated (``"a" "b"`` generated,
``"ab"`` re-encoded), which would end the shared prefix inside the answer. Before a request is
planned, its prompt is realigned to the exact ids of recent finished requests of the same salt
(``realign``): where the prompt and such a request diverge, the longest span that spells the same
bytes in both (compared piece by piece and decoded, never across a special token) takes the
earlier request's ids. The prompt's text is unchanged, so is the rest of its ids; only the spelling
of text the model itself produced changes, and the KV shared afterwards is still matched token by
token by the index.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..kv.prefix_index import salt_root
from ..kv.tables import KVTables
from ..limits import Limits
from ..requests import Job, Session
from ..speculation import RecentOutputs
from .state import PolyKV

RECENT_REQUESTS = 64  # finished requests a prompt can be realigned to (per engine, all salts)
_MAX_SPLICES = 16  # realigned spans per prompt (one per earlier answer it repeats)
_SPLICE_TRIES = 4  # common boundaries tried per span when the last one does not decode cleanly
_MAX_SPAN = 8192  # ids of an earlier request looked at per span


class PrefixCache:
    def __init__(self, polykv: PolyKV, limits: Limits, tokenizer, counters: dict, recent_outputs: RecentOutputs):
        self.polykv = polykv
        self.tables: KVTables = polykv.tables
        self.page_size = polykv.page_size
        self.limits = limits
        self.tokenizer = tokenizer
        self.counters = counters
        self.recent_outputs = recent_outputs
        self._inflight: dict[bytes, Job] = {}  # page key -> the job computing (or queued to compute) that page
        # (salt root, ids) of recent finished requests, prompt + answer: what prompts are realigned to
        self.recent_requests: deque[tuple[bytes, np.ndarray]] = deque(maxlen=RECENT_REQUESTS)
        self._pieces = None  # token id -> its piece of text (the tokenizer's own spelling), made on first use
        self._specials = np.array(sorted(self.tokenizer.special_token_ids), dtype=np.int64)

    # ---- at commit ---------------------------------------------------------------------
    def plan_auto(self, job: Job, pooled: bool) -> int:
        """Prepare ``job`` for automatic sharing (within its sequence's ``salt_root``); returns the
        prompt tokens it is expected to reuse from the index (cached now, or computed by a request
        ahead of it, which it will wait for). What it reuses in the end is counted when it starts
        (``auto_start``)."""
        index = self.tables.index
        if index is None or pooled:
            return 0
        ps, tokens = self.page_size, job.seq.tokens
        limit = len(tokens) - 1
        keys = job.prompt_keys = index.keys_for(tokens, job.seq.salt_root, limit // ps)
        m = self.tables.match(tokens, job.seq.salt_root, limit, keys)  # None: a one-token prompt
        n = len(m.pages) if m is not None else 0
        tier, resident = self.tables.tier, n
        while tier is not None and n < len(keys) and tier.has(keys[n]):
            n += 1  # on disk: read back when it starts (KVTables.promote)
        if tier is not None:  # read ahead while it waits; it starts once they are read
            tail = tier.tail(keys[n - 1] if n else job.seq.salt_root, tokens[n * ps:limit])  # and the partial page
            job.tier_keys = keys[resident:n] + ([tail[0]] if tail is not None else [])
            if job.tier_keys:
                tier.prefetch(job.tier_keys, self.tables.kv)
        while n < len(keys) and self._owner(keys[n]) is not None:
            n += 1  # computed by a request ahead of this one (running or queued): it will wait for it
        for k in keys[n:]:  # pages this request computes: later arrivals expect them
            self._inflight.setdefault(k, job)
        return max(m.num_tokens(ps) if m is not None else 0, n * ps)

    # ---- realignment (at prepare: no side effect) ---------------------------------------
    def realign(self, prompt: list[int], salt: str | None, params, floor: int = 0) -> list[int]:
        """``prompt`` with each span that spells the same bytes as a recent finished request of
        the same salt (past the point where they diverge, at or after ``floor``) taken from that
        request's ids. Returns ``prompt`` itself when nothing changes, or when the realigned
        prompt would not fit the context."""
        root = salt_root(salt)
        cands = [t for r, t in self.recent_requests if r == root]
        if not cands:
            return prompt
        live = [(t, 0) for t in reversed(cands)]  # (ids, where to start comparing); the most recent wins ties
        out = np.asarray(prompt, dtype=np.int64)
        changed = False
        for _ in range(_MAX_SPLICES):
            best, d, scored = None, max(floor, 1) - 1, []
            for t, lo in live:
                n = _lcp(out, t, lo)
                scored.append((t, n))
                if n > d:
                    best, d = t, n
            if best is None or d >= len(out) or d >= len(best):
                break
            spliced = self._splice(out, best, d)
            if spliced is None:
                break
            out, changed = spliced, True
            live = [(t, d) for t, n in scored if n >= d]  # the others part from the prompt before d
        if not changed or not self.limits.fits(len(out), params.max_tokens):
            return prompt
        return out.tolist()

    def _splice(self, out: np.ndarray, ref: np.ndarray, d: int) -> np.ndarray | None:
        """``out`` with its span from ``d`` replaced by ``ref``'s ids for the longest same text
        (None: no such span). ``out[:d] == ref[:d]`` and ``out[d] != ref[d]``."""
        pieces = self._pieces or self._make_pieces()
        w = 32
        while True:  # windows of ref's ids from d, widened until the two spellings part inside them
            re_ids = _run(ref, d, self._specials, d + w)
            pe = _plain(pieces(re_ids))
            if not pe:
                return None
            se = "".join(pe)
            pf = _plain(pieces(_run(out, d, self._specials, d + len(se))))  # a token spells a character or more
            if not pf:
                return None
            sf = "".join(pf)
            common = _lcp_str(se, sf)
            if common < len(se) or len(pe) < w or w >= _MAX_SPAN:
                break
            w *= 4
        ends_f = {}  # text length -> tokens of out's span that spell it
        n = 0
        for j, x in enumerate(pf, 1):
            n += len(x)
            ends_f[n] = j
        ends_e = []
        n = 0
        for k, x in enumerate(pe, 1):
            n += len(x)
            if n > common:
                break
            if n in ends_f:
                ends_e.append((k, ends_f[n]))
        for k, j in reversed(ends_e[-_SPLICE_TRIES:]):
            if self._same_text(re_ids[:k], out[d:d + j].tolist()):
                return np.concatenate([out[:d], ref[d:d + k], out[d + j:]])
        return None

    def _make_pieces(self):
        hf = self.tokenizer.hf_tokenizer
        if hf is not None:
            def pieces(ids):
                return hf.convert_ids_to_tokens(ids)
        else:
            decode = self.tokenizer.decode

            def pieces(ids):
                return [decode([i], skip_special_tokens=False) for i in ids]
        self._pieces = pieces
        return pieces

    def _same_text(self, a, b) -> bool:
        """Both id runs decode to the same text (no cleanup of spaces, no replacement character)."""
        hf = self.tokenizer.hf_tokenizer
        if hf is not None:
            ta = hf.decode(list(a), skip_special_tokens=False, clean_up_tokenization_spaces=False)
            tb = hf.decode(list(b), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        else:
            ta = self.tokenizer.decode(list(a), skip_special_tokens=False)
            tb = self.tokenizer.decode(list(b), skip_special_tokens=False)
        return ta == tb and "\ufffd" not in ta

    # ---- at start ----------------------------------------------------------------------
    def auto_start(self, job: Job, p_other: int) -> bool | None:
        """Start ``job`` from the index when that reuses more than ``p_other`` tokens (its pool or
        its own cache). None: not from the index; False: no page for the partial copy yet."""
        seq = job.seq
        if job.prompt_keys and self.tables.tier is not None:  # pages on disk continuing the match come back first
            self.counters["tier_read_pages"] += self.tables.promote(seq.tokens, seq.salt_root, len(seq.tokens) - 1,
                                                                    job.prompt_keys)
        # also a prompt under a page: a finished request's partial last page is a tail under the root
        # (copied, not shared), so a short prompt sent again reuses all but its last token, as llama.cpp does
        # (not a pooled session's: its prefix is its pool's, and its own suffix comes back through
        # ``continue_pooled``, which keeps its pages its own)
        pooled = job.session is not None and job.session.pool_id is not None
        m = self.tables.match(seq.tokens, seq.salt_root, len(seq.tokens) - 1, job.prompt_keys) \
            if self.tables.index is not None and (job.prompt_keys or not pooled) else None
        p = m.num_tokens(self.page_size) if m is not None else 0
        if m is None or p <= p_other:
            if job.prompt_keys:
                self._mark_inflight(job, 0)
            if not job.num_preemptions:
                self._recount_cache_n(job, p_other)  # what it reuses, not what was expected at accept
            return None
        session = job.session
        assert session is not None  # a generation request always has its session
        old = session.seq
        if not self.tables.share_match(seq, m):
            return False
        if old is not seq:
            self.tables.drop(old)
        self.polykv.adopt_seq(session, seq, shared=0)
        if not job.num_preemptions:
            self._recount_cache_n(job, p)
        self.counters["auto_prefix_tokens"] += p
        self._mark_inflight(job, len(m.pages))
        return True

    def continue_from_tier(self, seq, limit: int) -> int:
        """A pooled session's request or a pool's materialization whose table holds its pool's (or
        parent's) prefix: the pages of the rest of ``seq.tokens[:limit]`` that the disk tier holds
        come back (``KVTables.promote``) and join its table with those the prefix cache holds
        (``KVTables.extend_from_index``). Only with a tier (without one such requests recompute
        past their pool, as before). Returns the tokens it no longer computes."""
        tables = self.tables
        if tables.tier is None or tables.index is None or limit <= seq.num_cached:
            return 0
        keys = tables.index.keys_for(seq.tokens, seq.salt_root, limit // self.page_size)
        self.counters["tier_read_pages"] += tables.promote(seq.tokens, seq.salt_root, limit, keys)
        return tables.extend_from_index(seq, limit, keys)

    def continue_pooled(self, job: Job) -> None:
        """``continue_from_tier`` for a pooled session's request (counted as reused prompt tokens)."""
        n = self.continue_from_tier(job.seq, len(job.seq.tokens) - 1)
        if n:
            self.counters["auto_prefix_tokens"] += n
            if not job.num_preemptions:
                self._recount_cache_n(job, job.seq.num_cached)

    def _recount_cache_n(self, job: Job, p: int) -> None:
        delta = p - job.timings.cache_n
        if delta:
            job.timings.cache_n = p
            if job.info is not None:  # (set when it was accepted)
                job.info.cached_prefix_tokens = p
            self.counters["cached_prompt_tokens"] += delta

    def _mark_inflight(self, job: Job, start: int) -> None:
        index = self.tables.index
        if index is None:
            return
        for k in job.prompt_keys[start:]:
            if k not in index.entries and self._computing(k) is None:
                self._inflight[k] = job

    def _owner(self, key: bytes) -> Job | None:
        """The live request that computes (or, queued, will compute) the page of ``key``."""
        j = self._inflight.get(key)
        if j is not None and j.finish_reason is not None:
            del self._inflight[key]
            j = None
        return j

    def _computing(self, key: bytes) -> Job | None:
        j = self._owner(key)
        return j if j is not None and j.started else None

    def waits_for_prefix(self, job) -> bool:
        """SchedulerHooks (scheduler.py): a waiting request whose next uncached prompt page a running request is
        computing, or whose pages on disk are still being read ahead (``DiskTier.prefetch``)."""
        tier_keys = getattr(job, "tier_keys", None)
        if tier_keys and not job.started:
            if self.tables.tier is not None and self.tables.tier.reading(tier_keys):
                return True  # its pages on disk are being read ahead
            job.tier_keys = []
        index = self.tables.index
        if index is None or not self._inflight or not getattr(job, "prompt_keys", None):
            return False
        k = index.pending_key(job.prompt_keys, 0)
        if k is None:
            return False
        r = self._computing(k)
        return r is not None and r is not job

    # ---- at finish ---------------------------------------------------------------------
    def on_request_end(self, session: Session, job: Job | None = None) -> None:
        """A request of ``session`` ended: its session's pages enter the index; the pages it was
        computing for others are no longer awaited; its ids are kept for realignment and drafts."""
        self.tables.cache_tail(session.seq)
        if job is None:
            return
        for k in job.prompt_keys:
            if self._inflight.get(k) is job:
                del self._inflight[k]
        if job.generated and job.seq is session.seq:
            self.recent_requests.append((job.seq.salt_root, np.asarray(job.seq.tokens, dtype=np.int64)))
            if job.draft_state is not None and self.tables.index is not None:
                self.recent_outputs.add(job.seq.salt_root, job.generated)  # drafts for later requests


def _lcp(a: np.ndarray, b: np.ndarray, lo: int = 0) -> int:
    """Length of the common prefix of two id arrays, known equal up to ``lo``."""
    n = min(len(a), len(b))
    if lo >= n:
        return n
    neq = a[lo:n] != b[lo:n]
    i = int(neq.argmax())
    return lo + i if neq[i] else n


def _lcp_str(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _run(ids: np.ndarray, start: int, specials: np.ndarray, limit: int) -> list[int]:
    """``ids[start:]`` up to the first special token (or ``limit``), as a list."""
    seg = ids[start:min(len(ids), limit)]
    hit = np.isin(seg, specials)
    end = int(hit.argmax()) if hit.any() else len(seg)
    return seg[:end].tolist()


def _plain(pieces: list) -> list[str]:
    """The pieces up to the first one that has no exact spelling (unknown id, partial character)."""
    out = []
    for x in pieces:
        if not x or "\ufffd" in x:
            break
        out.append(x)
    return out
