"""KVTables: the one owner of page tables and page refcounts.

Every change to a page table goes through this object: sharing a prefix (full pages by
refcount, the partial last page copied, so a page is never written by two holders), extending a
table to cover more tokens, truncating it in place, moving a cache to a new sequence, dropping a
table, and the integrity check. The rest of the engine decides *what* to share or drop; this
class is the only code that touches ``PagePool.incref/decref/allocate/copy_page`` or assigns a
``SeqState.page_table``.

Ownership: a sequence owns ``page_table[num_borrowed_pages:]`` (pages it allocated itself) and
only reads the leading borrowed pages. Pages that are in use but owned by no pool or session are
attributed to the prefix cache.

With the prefix cache on, full pages are listed in a ``PrefixIndex`` as soon as they are
computed (the index holds a reference of its own), so a later request with the same prefix
shares them copy-free, and pages nobody holds any more stay resident as evictable cache.

When no page is free, the tables ask the one dependency they are given at construction, a
``Reclaimer`` (the engine's memory policy: which idle caches and pools to evict), to free some;
they call nothing else outside this package.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence as Seq, cast

import torch

from ..requests import SeqView, SeqState, Session
from .pages import PagePool
from .prefix_index import Entry, Match, PrefixIndex, Tail


class Reclaimer(Protocol):
    """Frees pages when the tables run short (PolyKV.reclaim: cache pages, then idle sessions'
    KV, then idle pools). It may call back into the tables (evict cache, drop tables)."""

    def __call__(self, num_pages: int, keep: Session | None = None) -> int:
        """Free at least ``num_pages`` pages if it can, never those of ``keep``; the pages freed."""
        ...


class Tier(Protocol):
    """A second tier for the KV of evicted cache pages (``persist/tier.py``: the disk). Pages leave
    through ``spill`` as they are evicted and come back through ``fetch`` before a match."""

    def spill(self, kv: PagePool, chains: list[list[Entry]]) -> None:
        """Keep the KV of these evicted pages (runs of index entries, each the parent of the next);
        called before their pages are freed. Must not block (it may drop them instead)."""
        ...

    def spill_tails(self, kv: PagePool, tails: list[Tail]) -> None:
        """Keep the KV of these evicted tails (partial last pages, valid for their ``tokens``)."""
        ...

    def has(self, key: bytes) -> bool:
        """Whether the tier holds the page of this chained key."""
        ...

    def tail(self, parent_key: bytes, rest: Seq[int]) -> tuple[bytes, int] | None:
        """The key of the tail it holds under the page ``parent_key`` that shares the most leading
        tokens with ``rest``, and how many; None: none."""
        ...

    def fetch_tail(self, key: bytes, kv: PagePool):
        """``(k, v, tokens)`` of the tail ``key`` (``[L, len(tokens), H, D]`` each), checked; None: cannot."""
        ...

    def prefetch(self, keys: Seq[bytes], kv: PagePool) -> int:
        """Start reading the pages of ``keys`` ahead (a queued request will ``fetch`` them)."""
        ...

    def reading(self, keys: Seq[bytes]) -> bool:
        """Whether a read ahead of some of ``keys`` is still in flight."""
        ...

    def fetch(self, keys: Seq[bytes], page_tokens: Seq[tuple], parent_key: bytes, kv: PagePool) -> list:
        """The longest checked run of ``keys`` it can deliver (maybe fewer than asked; empty: none), as
        parts ``(k, v)``, ``[L, n, page_size, H, D]`` each."""
        ...

    def status(self) -> dict:
        """The tier's bytes and pages (``/props``, ``/metrics``, the dashboard)."""
        ...


def no_reclaim(num_pages: int, keep: Session | None = None) -> int:
    """The ``Reclaimer`` of tables with no memory policy: frees nothing (only free pages are used)."""
    return 0


class KVTables:
    def __init__(self, kv: PagePool, *, reclaim: Reclaimer = no_reclaim, prefix_cache: bool = False):
        """``reclaim``: asked to free pages when an allocation finds too few free (see ``Reclaimer``)."""
        self.kv = kv
        self.page_size = kv.page_size
        self.reclaim = reclaim
        self.index: PrefixIndex | None = PrefixIndex(kv.page_size) if prefix_cache else None
        self.evicted_pages = 0  # cache pages evicted (lifetime)
        # the disk tier (persist/tier.py) evicted pages go to and come back from; None: they are dropped
        self.tier: Tier | None = None
        self.promoted_pages = 0  # pages read back from the tier (lifetime)

    # ---- capacity ----------------------------------------------------------------------
    def _reserve(self, n: int, keep: Session | None = None) -> bool:
        """True when ``n`` pages can be allocated now, after asking the ``Reclaimer`` when too few
        are free (it may evict idle sessions' KV and pools, never ``keep``'s)."""
        if self.kv.can_allocate(n):
            return True
        self.reclaim(n - self.kv.num_free, keep=keep)
        return self.kv.can_allocate(n)

    # ---- building tables ---------------------------------------------------------------
    def share(self, src: Seq[int], n_tokens: int, keep=None) -> list[int] | None:
        """A new page table holding ``[0, n_tokens)`` of ``src``: full pages by refcount, the
        partial last page copied. None (nothing changed) when no page is free for the copy.
        ``keep``: a session whose pages are the source and must survive a reclaim."""
        full, part = divmod(n_tokens, self.page_size)
        return self._build(list(src[:full]), src[full] if part else None, keep)

    def _build(self, full_pages: list[int], copy_from: int | None, keep=None) -> list[int] | None:
        # hold the sources first: a reclaim for the copy may evict cache-only pages
        held = full_pages + ([copy_from] if copy_from is not None else [])
        self.kv.incref(held)
        if copy_from is None:
            return full_pages
        if not self._reserve(1, keep):
            self.kv.decref(held)
            return None
        page = self.kv.allocate(1)[0]
        self.kv.copy_page(copy_from, page)
        self.kv.decref([copy_from])
        return full_pages + [page]

    def share_into(self, seq: SeqState, src: Seq[int], n_tokens: int, borrowed: int, keep=None) -> bool:
        """Give an empty ``seq`` the KV of ``[0, n_tokens)`` of ``src`` (its first ``borrowed``
        pages read-only). False (nothing changed) when the partial page cannot be copied."""
        assert not seq.page_table, "share_into needs a sequence without pages"
        table = self.share(src, n_tokens, keep)
        if table is None:
            return False
        seq.page_table = table
        seq.num_cached = n_tokens
        seq.num_borrowed_pages = borrowed
        return True

    def share_match(self, seq: SeqState, match: Match) -> bool:
        """Give an empty ``seq`` the KV of an index match (full pages by refcount, the partial page
        copied); its pages are borrowed from the cache. False (nothing changed) when no page is free."""
        assert not seq.page_table, "share_match needs a sequence without pages"
        table = self._build(list(match.pages), match.partial_page if match.partial_tokens else None)
        if table is None:
            return False
        seq.page_table = table
        seq.num_cached = match.num_tokens(self.page_size)
        seq.num_borrowed_pages = len(match.pages)
        return True

    def continue_from(self, old: SeqState, new: SeqState, n_tokens: int, borrowed: int) -> bool:
        """``new`` takes over ``old``'s KV of ``[0, n_tokens)``; ``old`` is emptied. In place (no
        copy, no new page) when the partial page is ``old``'s own and nobody else holds it."""
        full, part = divmod(n_tokens, self.page_size)
        src = old.page_table
        if part and full >= old.num_borrowed_pages and full < len(src) and self.kv.refcount[src[full]] == 1:
            self.kv.decref(src[full + 1:])
            new.page_table, old.page_table = src[:full + 1], []
        else:
            table = self.share(src, n_tokens)
            if table is None:
                return False
            self.kv.decref(src)
            new.page_table, old.page_table = table, []
        old.num_cached = 0
        old.num_borrowed_pages = 0
        old.page_keys, old.index_node = [], None
        new.num_cached = n_tokens
        new.num_borrowed_pages = borrowed
        return True

    def extend_reclaiming(self, seq: SeqState, num_tokens: int) -> bool:
        """Make ``seq``'s table cover ``num_tokens`` (check-then-commit). When too few pages are free
        it asks its ``Reclaimer`` first, which may evict cache pages, idle sessions' KV and idle
        pools (``PolyKV.reclaim``): the scheduler's planning evicts through this call."""
        need = self.kv.pages_for(num_tokens) - len(seq.page_table)
        if need <= 0:
            return True
        if not self._reserve(need):
            return False
        seq.page_table.extend(self.kv.allocate(need))
        return True

    def extend_free(self, seq: SeqState, num_tokens: int, from_cache: bool = False) -> bool:
        """``extend`` from free pages only (no reclaim): for work that is worth doing only when it
        displaces no one's KV. ``from_cache``: pages only the prefix cache holds count as free too
        (its least recently used leaves, as a decoding sequence's own growth takes them; never a
        session's or a pool's): speculative draft rows, since under a long-running engine the prefix
        cache fills every page no one holds and free pages alone left drafts nothing
        (``test_drafts_go_on_once_the_prefix_cache_fills_the_free_pages``)."""
        need = self.kv.pages_for(num_tokens) - len(seq.page_table)
        if need <= 0:
            return True
        if from_cache and self.kv.num_free < need:
            self.evict_cache(need - self.kv.num_free)
        if self.kv.num_free < need:
            return False
        seq.page_table.extend(self.kv.allocate(need))
        return True

    def trim(self, seq: SeqState, num_tokens: int) -> None:
        """Release ``seq``'s own pages past those covering ``num_tokens`` (rolled-back draft rows).
        Borrowed pages and pages holding computed KV stay."""
        keep = max(self.kv.pages_for(num_tokens), seq.num_borrowed_pages, self.kv.pages_for(seq.num_cached))
        extra = seq.page_table[keep:]
        if extra:
            del seq.page_table[keep:]
            self.kv.decref(extra)

    def reserve_partial_copy(self, n_tokens: int, keep: Session | None = None) -> bool:
        """Make sure (before committing) that sharing ``n_tokens`` can copy its partial last page:
        True when it has none, or a page is free, or one was freed by reclaiming (which may evict
        idle sessions' KV and pools, never ``keep``'s pages). False: no page can be had."""
        return not n_tokens % self.page_size or self._reserve(1, keep)

    def advance(self, seq: SeqState, n_tokens: int) -> None:
        """``n_tokens`` more of ``seq``'s tokens now have KV in its pages (computed this step); full
        pages enter the prefix index."""
        seq.num_cached += n_tokens
        if self.index is not None and seq.cacheable and len(seq.page_keys) < seq.num_cached // self.page_size:
            self._register(seq)

    def _register(self, seq: SeqState) -> None:
        index, ps = self.index, self.page_size
        assert index is not None
        node = cast("Entry | None", seq.index_node)  # (only these tables set it, to an Entry)
        if seq.page_keys and (node is None or node.page is None or index.by_page.get(node.page) is not node):
            seq.page_keys, node = [], None  # its last entry was evicted meanwhile: walk again
        if node is None:
            node = index.root(seq.salt_root)
        key = seq.page_keys[-1] if seq.page_keys else seq.salt_root
        for i in range(len(seq.page_keys), seq.num_cached // ps):
            toks = tuple(seq.tokens[i * ps:(i + 1) * ps])
            key = index.key_fn(key, toks)
            e = index.lookup_entry(key, node, toks)
            if e is None:
                page = seq.page_table[i]
                old = index.by_page.get(page)
                if isinstance(old, Tail):  # the page was a finished request's tail; now it is full
                    index.remove(old)
                    self.kv.decref([page])
                e = index.add(key, node, page, toks)
                if e is None:  # the key names another prefix (a collision) or the page is listed elsewhere
                    seq.cacheable = False
                    return
                self.kv.incref([page])
            seq.page_keys.append(key)
            seq.index_node = node = e

    def cache_tail(self, seq: SeqState) -> None:
        """List ``seq``'s partial last page as a tail (valid for its computed slots), so the next
        request continuing this text copies it instead of recomputing it."""
        if self.index is None or not seq.cacheable:
            return
        full, part = divmod(seq.num_cached, self.page_size)
        if not part or len(seq.page_keys) != full or len(seq.page_table) <= full:
            return
        page = seq.page_table[full]
        node = cast("Entry | None", seq.index_node) if full else self.index.root(seq.salt_root)
        if node is None or (full and (node.page is None or self.index.by_page.get(node.page) is not node)):
            return
        old = self.index.by_page.get(page)
        if isinstance(old, Tail):
            if len(old.tokens) >= part:
                return
            self.index.remove(old)
            self.kv.decref([page])
        elif old is not None:
            return
        if self.index.add_tail(node, page, tuple(seq.tokens[full * self.page_size:seq.num_cached])):
            self.kv.incref([page])

    def match(self, tokens, salt_root: bytes, limit: int, keys: list | None = None) -> Match | None:
        if self.index is None or limit <= 0:
            return None
        return self.index.match(tokens, salt_root, limit, keys)

    def evict_cache(self, num_pages: int) -> int:
        """Free up to ``num_pages`` cache-only pages, least recently used leaves first."""
        if self.index is None or num_pages <= 0:
            return 0
        freed: list[int] = []
        chains: list[list[Entry]] = []
        tails: list[Tail] = []  # partial last pages: kept too (a session's next turn continues its tail)
        ends: dict[int, list[Entry]] = {}  # id(an entry) -> the chain waiting for it as its head's parent
        for item in self.index.eviction_order(self.kv.refcount):
            self.index.remove(item)
            if self.tier is None:
                pass
            elif isinstance(item, Tail):
                tails.append(item)
            else:  # leaves first: a chain grows at its head
                chain = ends.pop(id(item), None)
                if chain is None:
                    chain = []
                    chains.append(chain)
                chain.insert(0, item)
                ends[id(item.parent)] = chain
            assert item.page is not None  # (the order holds pages, never a root)
            freed.append(item.page)
            if len(freed) >= num_pages:
                break
        if self.tier is not None:  # before the pages are freed (it copies them)
            if chains:
                self.tier.spill(self.kv, chains)
            if tails:
                self.tier.spill_tails(self.kv, tails)
        self.kv.decref(freed)
        self.evicted_pages += len(freed)
        return len(freed)

    def promote(self, tokens: Seq[int], salt_root: bytes, limit: int, keys: list[bytes]) -> int:
        """Bring back from the tier the pages that continue the resident match of ``tokens[:limit]``
        (``keys``: their chained page keys), as cache pages listed in the index, so the match that
        follows shares them. Only as many as pages can be had for (reclaiming others); a page the
        tier cannot deliver checked is computed instead. Returns the pages brought back."""
        tier, index, ps = self.tier, self.index, self.page_size
        if tier is None or index is None or not keys:
            return 0
        m = index.match(tokens, salt_root, min(limit, len(keys) * ps), keys)
        i = len(m.pages)
        j = i
        while j < len(keys) and (j + 1) * ps <= limit and keys[j] not in index.entries and tier.has(keys[j]):
            j += 1
        node = index.entries[keys[i - 1]] if i else index.root(salt_root)
        held = list(m.pages)  # the match stays resident while pages are reclaimed for what follows it
        added = 0
        if j > i:
            parts = tier.fetch(keys[i:j], [tuple(tokens[x * ps:(x + 1) * ps]) for x in range(i, j)], node.key, self.kv)
            pages = self._allocate_held(sum(k.shape[1] for k, _ in parts), held)
            at, dev = 0, self.kv.k_cache.device
            for k, v in parts:  # each file's part straight into its pages (no copy into one tensor first)
                n = min(k.shape[1], len(pages) - at)
                if n > 0:
                    idx = torch.tensor(pages[at:at + n], dtype=torch.long, device=dev)
                    self.kv.k_cache.index_copy_(1, idx, k[:, :n].to(dev))
                    self.kv.v_cache.index_copy_(1, idx, v[:, :n].to(dev))
                at += n
            for x, page in enumerate(pages):
                e = index.add(keys[i + x], node, page, tuple(tokens[(i + x) * ps:(i + x + 1) * ps]))
                if e is None:  # (a collision: cannot happen for keys the index does not list) the rest goes
                    self.kv.decref(pages[x:])
                    break
                node = e  # the index holds the page's one reference: a cache page
                held.append(page)
                added += 1
            if added < j - i:
                self.promoted_pages += added
                return added
        added += self._promote_tail(node, tokens[(i + added) * ps:limit], held)
        self.promoted_pages += added
        return added

    def _allocate_held(self, n: int, held: list[int]) -> list[int]:
        """Up to ``n`` pages (reclaiming others, never ``held``'s pages)."""
        self.kv.incref(held)
        try:
            if not self._reserve(n):
                n = min(n, self.kv.num_free)
            return self.kv.allocate(n) if n > 0 else []
        finally:
            self.kv.decref(held)

    def _promote_tail(self, node: Entry, rest: Seq[int], held: list[int]) -> int:
        """The tail under ``node`` the tier holds, when it continues ``rest`` further than what the
        index holds there, comes back as a tail (copied by the match that follows). 1: it did."""
        assert self.tier is not None and self.index is not None
        found = self.tier.tail(node.key, rest) if rest else None
        if found is None or found[1] <= self.index.best_partial(node, rest)[1]:
            return 0
        got = self.tier.fetch_tail(found[0], self.kv)
        if got is None:
            return 0
        k, v, tail_tokens = got
        pages = self._allocate_held(1, held)
        if not pages:
            return 0
        t = len(tail_tokens)
        self.kv.k_cache[:, pages[0], :t] = k.to(self.kv.k_cache.device)
        self.kv.v_cache[:, pages[0], :t] = v.to(self.kv.v_cache.device)
        if not self.index.add_tail(node, pages[0], tuple(tail_tokens)):
            self.kv.decref(pages)
            return 0
        return 1

    def kv_location(self, seq: SeqView, spilled_keys: Seq[bytes] = ()) -> dict:
        """Where a session's KV lives: ``kv_location`` "ram" (its own pages, or its pages all in the
        prefix cache), "disk" (some of it only in the tier) or "none" (recomputed when it comes back),
        and the tokens of each (``kv_ram_tokens``, ``kv_disk_tokens``). ``spilled_keys``: the page
        keys of the KV it had before memory pressure took its pages (``Session.spilled_keys``)."""
        if seq.num_cached:
            return {"kv_location": "ram", "kv_ram_tokens": seq.num_cached, "kv_disk_tokens": 0}
        ram = disk = 0
        entries = self.index.entries if self.index is not None else {}
        for key in spilled_keys:  # a prefix: the pages after a missing one cannot be used
            if key in entries:
                ram += 1
            elif self.tier is not None and self.tier.has(key):
                disk += 1
            else:
                break
        where = "disk" if disk else "ram" if ram else "none"
        return {"kv_location": where, "kv_ram_tokens": ram * self.page_size, "kv_disk_tokens": disk * self.page_size}

    def extend_from_index(self, seq: SeqState, limit: int, keys: list[bytes]) -> int:
        """``seq`` holds the KV of its first ``num_cached`` tokens (a pool's prefix shared into it):
        continue it with the index's pages that hold the next of ``tokens[:limit]`` (``keys``: their
        chained page keys) and that only the cache holds, as its own pages (so each page keeps one
        owner; a page another table holds ends the run). A partial last page copied from the pool
        is replaced by the index's full page. Returns the tokens added (0: nothing changed)."""
        index, ps = self.index, self.page_size
        if index is None or not keys:
            return 0
        full = seq.num_cached // ps
        if len(seq.page_table) != self.kv.pages_for(seq.num_cached):
            return 0
        m = index.match(seq.tokens, seq.salt_root, min(limit, len(keys) * ps), keys)
        take: list[int] = []
        for page in m.pages[full:]:
            if self.kv.refcount[page] != 1:
                break
            take.append(page)
        if not take:
            return 0
        self.kv.incref(take)
        self.kv.decref(seq.page_table[full:])  # the partial page copied from the pool, if any
        seq.page_table = seq.page_table[:full] + take
        added = (full + len(take)) * ps - seq.num_cached
        seq.num_cached += added
        return added

    def num_cache_only(self) -> int:
        """Pages only the index holds (all of them can be evicted, leaves first)."""
        if self.index is None:
            return 0
        rc = self.kv.refcount
        return sum(1 for p in self.index.by_page if rc[p] == 1)

    def keep_out_of_index(self, seq: SeqState) -> None:
        """``seq``'s pages are not listed in the prefix index (a session's KV loaded from its file:
        its next request moves them into a sequence that indexes them)."""
        seq.cacheable = False

    def hand_over(self, seq: SeqState, n_pages: int) -> None:
        """``seq``'s first ``n_pages`` pages are now owned by another table (a pool adopted them);
        ``seq`` keeps reading them."""
        assert n_pages <= len(seq.page_table)
        seq.num_borrowed_pages = n_pages

    def drop(self, seq: SeqState) -> None:
        """Release every page of ``seq``'s table; its tokens stay (they can be recomputed). Pages
        the prefix index lists stay resident as cache."""
        self.kv.decref(seq.page_table)
        seq.page_table = []
        seq.num_cached = 0
        seq.num_borrowed_pages = 0
        seq.page_keys, seq.index_node = [], None

    # ---- checks ------------------------------------------------------------------------
    def check_integrity(self, holders: Iterable[SeqState]) -> int:
        """Refcount == number of tables holding each page (+1 when the index lists it); every
        owned page has one owner. Returns the number of cache pages (in use, owned by no table)."""
        seqs = list(holders)
        cached = [[p] for p in self.index.by_page] if self.index is not None else []
        self.kv.check_integrity([s.page_table for s in seqs] + cached)
        owned: list[int] = []
        for s in seqs:
            assert 0 <= s.num_borrowed_pages <= len(s.page_table), "borrowed pages beyond the table"
            assert s.num_cached <= len(s.page_table) * self.page_size, "cached tokens without pages"
            owned += s.owned_pages
        assert len(owned) == len(set(owned)), "a page has two owners"
        if self.index is None:
            assert len(owned) == self.kv.num_used, f"ownership: {len(owned)} owned pages != {self.kv.num_used} in use"
        else:
            self._check_index()
        return self.kv.num_used - len(owned)

    def _check_index(self) -> None:
        index = self.index
        assert index is not None
        for key, e in index.entries.items():
            assert e.page is not None and e.key == key and index.by_page.get(e.page) is e, \
                "index entry not listed by its page"
            parent = e.parent
            assert parent is not None and parent.children.get(key) is e, "index entry missing from its parent"
            assert len(e.tokens) == self.page_size, "a full-page entry without a full page of tokens"
            assert parent.page is None or index.by_page.get(parent.page) is parent, "an entry under an evicted parent"
        for page, item in index.by_page.items():
            assert item.page == page and self.kv.refcount[page] >= 1
            if isinstance(item, Tail):
                assert item.parent.tails.get(page) is item and 0 < len(item.tokens) < self.page_size
