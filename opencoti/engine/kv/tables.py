"""KVTables: the one owner of page tables and page refcounts.

Every change to a page table goes through this object: sharing a prefix (full pages by
refcount, the partial last page copied, so a page is never written by two holders), extending a
table to cover more tokens, truncating it in place, moving a cache to a new sequence, dropping a
table, and the integrity check. The rest of the engine decides *what* to share or drop; this
class is the only code that touches ``PagePool.incref/decref/allocate/copy_page`` or assigns a
``Sequence.page_table``.

Ownership: a sequence owns ``page_table[num_borrowed_pages:]`` (pages it allocated itself) and
only reads the leading borrowed pages. Pages that are in use but owned by no pool or session are
attributed to the prefix cache.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence as Seq

from ..session import Sequence
from .pages import PagePool

Reclaim = Callable[..., int]  # reclaim(num_pages, keep=None) -> pages freed


class KVTables:
    def __init__(self, kv: PagePool):
        self.kv = kv
        self.page_size = kv.page_size
        self.reclaim: Reclaim = lambda n, keep=None: 0  # installed by the core (memory policy)

    # ---- capacity ----------------------------------------------------------------------
    def _reserve(self, n: int, keep=None) -> bool:
        """True when ``n`` pages can be allocated now (after reclaiming if needed)."""
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
        if part and not self._reserve(1, keep):
            return None
        table = list(src[:full])
        self.kv.incref(table)
        if part:
            page = self.kv.allocate(1)[0]
            self.kv.copy_page(src[full], page)
            table.append(page)
        return table

    def share_into(self, seq: Sequence, src: Seq[int], n_tokens: int, borrowed: int, keep=None) -> bool:
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

    def continue_from(self, old: Sequence, new: Sequence, n_tokens: int, borrowed: int) -> bool:
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
        new.num_cached = n_tokens
        new.num_borrowed_pages = borrowed
        return True

    def extend(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq``'s table cover ``num_tokens`` (check-then-commit, reclaiming if needed)."""
        need = self.kv.pages_for(num_tokens) - len(seq.page_table)
        if need <= 0:
            return True
        if not self._reserve(need):
            return False
        seq.page_table.extend(self.kv.allocate(need))
        return True

    def can_copy_partial(self, n_tokens: int, keep=None) -> bool:
        """Check (before committing) that sharing ``n_tokens`` can copy its partial last page."""
        return not n_tokens % self.page_size or self._reserve(1, keep)

    def advance(self, seq: Sequence, n_tokens: int) -> None:
        """``n_tokens`` more of ``seq``'s tokens now have KV in its pages (computed this step)."""
        seq.num_cached += n_tokens

    def hand_over(self, seq: Sequence, n_pages: int) -> None:
        """``seq``'s first ``n_pages`` pages are now owned by another table (a pool adopted them);
        ``seq`` keeps reading them."""
        assert n_pages <= len(seq.page_table)
        seq.num_borrowed_pages = n_pages

    def drop(self, seq: Sequence) -> None:
        """Release every page of ``seq``'s table; its tokens stay (they can be recomputed)."""
        self.kv.decref(seq.page_table)
        seq.page_table = []
        seq.num_cached = 0
        seq.num_borrowed_pages = 0

    # ---- checks ------------------------------------------------------------------------
    def check_integrity(self, holders: Iterable[Sequence]) -> None:
        """Refcount == number of tables holding each page; every owned page has one owner."""
        seqs = list(holders)
        self.kv.check_integrity([s.page_table for s in seqs])
        owned: list[int] = []
        for s in seqs:
            assert 0 <= s.num_borrowed_pages <= len(s.page_table), "borrowed pages beyond the table"
            assert s.num_cached <= len(s.page_table) * self.page_size, "cached tokens without pages"
            owned += s.owned_pages
        assert len(owned) == len(set(owned)), "a page has two owners"
        assert len(owned) == self.kv.num_used, f"ownership: {len(owned)} owned pages != {self.kv.num_used} pages in use"
