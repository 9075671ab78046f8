"""PrefixIndex: which resident pages hold the KV of which token prefixes (host-side, no tensors).

Keys are chained hashes of full pages: ``key(page i) = H(key(page i-1), tokens of page i)``, the
first page's parent being a root derived from the request's ``cache_salt`` (empty salt: the shared
root). Equal keys therefore mean equal prefixes — up to a hash collision, which can never share
wrong KV: every match also compares the page's tokens and checks that the entry hangs under the
entry matched just before it.

The index keeps a reference on every page it lists (taken and released by KVTables, which owns
refcounts). A page whose only reference is the index's is *cache*: nobody uses it, it is kept
for a later request with the same prefix, and it is evicted LRU, leaves first, when memory is
needed. Besides full pages the index keeps *tails*: the partial last page of a finished request
(valid for its first ``len(tokens)`` slots), which a later request copies instead of recomputing.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from array import array
from typing import Iterator, Sequence as Seq


def salt_root(salt: str | None) -> bytes:
    """The parent key of a prefix's first page; requests with different salts never share."""
    if not salt:
        return b""
    return hashlib.blake2b(b"opencoti-cache-salt\0" + salt.encode("utf-8"), digest_size=16).digest()


def page_key(parent: bytes, tokens: Seq[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def tail_key(parent: bytes, tokens: Seq[int]) -> bytes:
    """The key of a tail (a partial last page) under the page ``parent``: its own hash domain, so
    it never equals a full page's key."""
    h = hashlib.blake2b(b"opencoti-tail\0" + parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class Entry:
    """One indexed page (or a root, with ``page`` None)."""

    __slots__ = ("key", "page", "tokens", "parent", "children", "tails", "last_access", "depth")

    def __init__(self, key: bytes, page: int | None, tokens: tuple, parent: "Entry | None", now: int):
        self.key = key
        self.page = page
        self.tokens = tokens
        self.parent = parent
        self.children: dict[bytes, Entry] = {}
        self.tails: dict[int, Tail] = {}  # page -> tail
        self.last_access = now
        self.depth: int = 0 if parent is None else parent.depth + 1


class Tail:
    __slots__ = ("page", "tokens", "parent", "last_access")

    def __init__(self, page: int, tokens: tuple, parent: Entry, now: int):
        self.page, self.tokens, self.parent, self.last_access = page, tokens, parent, now


class Match:
    """The longest cached prefix of a token list: full pages, then optionally a page to copy."""

    __slots__ = ("pages", "keys", "partial_page", "partial_tokens")

    def __init__(self):
        self.pages: list[int] = []
        self.keys: list[bytes] = []
        self.partial_page: int | None = None
        self.partial_tokens = 0

    def num_tokens(self, page_size: int) -> int:
        return len(self.pages) * page_size + self.partial_tokens


class PrefixIndex:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.entries: dict[bytes, Entry] = {}
        self.by_page: dict[int, Entry | Tail] = {}  # every page the index holds, full or tail
        self.roots: dict[bytes, Entry] = {}
        self._clock = itertools.count(1)  # logical LRU clock (ties broken by insertion order)
        self.key_fn = page_key  # replaceable in tests (forced collisions)

    def __len__(self) -> int:
        return len(self.by_page)

    def root(self, root_key: bytes) -> Entry:
        r = self.roots.get(root_key)
        if r is None:
            r = self.roots[root_key] = Entry(root_key, None, (), None, 0)
        return r

    def keys_for(self, tokens: Seq[int], root_key: bytes, n_pages: int) -> list[bytes]:
        ps, out, k = self.page_size, [], root_key
        for i in range(n_pages):
            k = self.key_fn(k, tokens[i * ps:(i + 1) * ps])
            out.append(k)
        return out

    # ---- lookup ------------------------------------------------------------------------
    def match(self, tokens: Seq[int], root_key: bytes, limit: int, keys: list[bytes] | None = None) -> Match:
        """Longest cached prefix of ``tokens[:limit]``: full pages whose keys, tokens and parent
        links all match, then the page (full, or a tail) sharing the most of the next tokens."""
        ps = self.page_size
        m = Match()
        node = self.roots.get(root_key)
        if node is None:
            return m
        now = next(self._clock)
        n_full = limit // ps
        k = root_key
        for i in range(n_full):
            page_tokens = tokens[i * ps:(i + 1) * ps]
            k = keys[i] if keys is not None and i < len(keys) else self.key_fn(k, page_tokens)
            e = self.entries.get(k)
            if e is None or e.parent is not node or e.tokens != tuple(page_tokens):
                break
            e.last_access = now
            assert e.page is not None  # (only roots have none)
            m.pages.append(e.page)
            m.keys.append(k)
            node = e
        rest = tokens[len(m.pages) * ps:limit]
        if rest:
            best, best_n = self.best_partial(node, rest)
            if best is not None:
                best.last_access = now
                m.partial_page, m.partial_tokens = best.page, best_n
        return m

    @staticmethod
    def best_partial(node: Entry, rest: Seq[int]) -> "tuple[Entry | Tail | None, int]":
        """The page under ``node`` (a child or a tail) sharing the most leading tokens with ``rest``."""
        best, best_n = None, 0
        for cand in list(node.children.values()) + list(node.tails.values()):
            n = common_prefix(cand.tokens, rest)
            if n > best_n:
                best, best_n = cand, n
        return best, best_n

    def pending_key(self, keys: list[bytes], n_cached_pages: int) -> bytes | None:
        """The first of ``keys`` (a prompt's page keys) past the indexed ones, if any."""
        for i in range(n_cached_pages, len(keys)):
            if keys[i] not in self.entries:
                return keys[i]
        return None

    # ---- insertion (KVTables takes the page reference) --------------------------------
    def add(self, key: bytes, parent: Entry, page: int, tokens: tuple) -> Entry | None:
        """Index a full page under ``parent``; None when the key is taken (the same prefix cached
        in another page, or a collision) or the page is already indexed."""
        if key in self.entries or page in self.by_page:
            return None
        e = Entry(key, page, tokens, parent, next(self._clock))
        self.entries[key] = e
        parent.children[key] = e
        self.by_page[page] = e
        return e

    def add_tail(self, parent: Entry, page: int, tokens: tuple) -> bool:
        if page in self.by_page or not tokens:
            return False
        t = Tail(page, tokens, parent, next(self._clock))
        parent.tails[page] = t
        self.by_page[page] = t
        return True

    def lookup_entry(self, key: bytes, parent: Entry, tokens: tuple) -> Entry | None:
        e = self.entries.get(key)
        return e if e is not None and e.parent is parent and e.tokens == tokens else None

    # ---- removal -----------------------------------------------------------------------
    def remove(self, item: "Entry | Tail") -> None:
        """Unlist one leaf (an entry without children, or a tail); the caller drops its reference."""
        assert item.page is not None and item.parent is not None, "a root is never removed"
        self.by_page.pop(item.page, None)
        if isinstance(item, Tail):
            item.parent.tails.pop(item.page, None)
            return
        assert not item.children and not item.tails, "only leaves are removed"
        self.entries.pop(item.key, None)
        item.parent.children.pop(item.key, None)

    def eviction_order(self, refcount: Seq[int]) -> Iterator[Entry | Tail]:
        """Yield cache-only leaves (refcount 1: only the index holds the page), least recently used
        first; a parent becomes a candidate once its last child is gone."""
        heap: list[tuple[int, int, Entry | Tail]] = []
        tie = itertools.count()
        for page, item in self.by_page.items():
            if refcount[page] == 1 and (isinstance(item, Tail) or not (item.children or item.tails)):
                heap.append((item.last_access, next(tie), item))
        heapq.heapify(heap)
        while heap:
            _, _, item = heapq.heappop(heap)
            if item.page is None or self.by_page.get(item.page) is not item or refcount[item.page] != 1:
                continue
            if isinstance(item, Entry) and (item.children or item.tails):
                continue
            parent = item.parent
            yield item
            if (parent is not None and parent.page is not None and parent.page in self.by_page
                    and not parent.children and not parent.tails and refcount[parent.page] == 1):
                heapq.heappush(heap, (parent.last_access, next(tie), parent))


def common_prefix(a: tuple, b: Seq[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
