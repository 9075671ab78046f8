"""Save, restore and erase a session's KV cache by file name, like llama.cpp's
``POST /slots/{id}?action=save|restore|erase`` (there a slot, here a session).

Files live in ``<state_dir>/slots/`` (a tenant's in ``slots/<tenant>/``); without a state directory these calls answer 501 as
llama.cpp does without ``--slot-save-path``. A file holds the session's cached tokens and their
KV (``kvfile`` format with the tokens appended and the model's identity in the header), so a
restore needs no recomputation: the session gets private pages holding exactly that KV (it is
detached from its pool; its next request reuses the restored prefix).

Numeric slot ids: llama.cpp clients name slots by number (``"id_slot": 3`` on a generation,
``/slots/3``). Slot number N is the session named ``"N"``: ``id_slot: 3``, ``session_id: "3"`` and
``/slots/3`` all name one session, and ``GET /slots`` gives that session the ``id`` 3 (sessions with
other names have the ``id`` -1, llama.cpp's "none"). ``id_slot: -1`` is llama.cpp's "any slot": no
session is named. Other negative numbers are refused.

Each function takes the :class:`Engine` or a tenant's :class:`TenantEngine` (whose session ids
it maps) and runs its engine work on the step thread; the file is written and read by the caller.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar, Union

from ..errors import CapacityError, InvalidRequestError, OpencotiError, SessionBusyError
from ..requests import SeqState
from . import kvfile
from .engine_view import SlotEngine, TenantSlots, identity_of, kv_identity_of

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
SlotTarget = Union[SlotEngine, TenantSlots]  # the Engine, or a tenant's view of it

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_NUMBER = re.compile(r"[+-]?[0-9]+")
_CANONICAL = re.compile(r"0|[1-9][0-9]*")
MAX_SLOT_DIGITS = 18


def slot_session_id(slot) -> str:
    """The session that a llama.cpp slot id names: a slot number N (an int, or a path segment of
    digits such as ``"3"`` or ``"03"``) is the session ``"N"``; any other string is a session id
    itself. Raises InvalidRequestError for a negative number (``-1``, "any slot", names none) and
    for a bool or another type."""
    if isinstance(slot, str) and not _NUMBER.fullmatch(slot.strip()):
        return slot
    if isinstance(slot, bool) or not isinstance(slot, (int, str)):
        raise InvalidRequestError(f"id_slot must be an integer, got {type(slot).__name__}")
    if isinstance(slot, str):
        digits = slot.strip().lstrip("+-").lstrip("0")
        if len(digits) > MAX_SLOT_DIGITS:
            raise InvalidRequestError(f"slot id {slot!r} is too large (at most {MAX_SLOT_DIGITS} digits)")
        slot = int(slot)
    if slot < 0:
        raise InvalidRequestError(f"slot id {slot} names no session: use a slot number >= 0 (slot N is the "
                                  "session named \"N\") or a session id; -1 (any slot) only applies to a "
                                  "generation's id_slot")
    if slot >= 10 ** MAX_SLOT_DIGITS:
        raise InvalidRequestError(f"slot id {slot} is too large (at most {MAX_SLOT_DIGITS} digits)")
    return str(slot)


def slot_number(session_id: str | None) -> int:
    """The llama.cpp slot id of a session: N for the session named ``"N"`` (as ``slot_session_id``
    writes it), else -1."""
    if isinstance(session_id, str) and len(session_id) <= MAX_SLOT_DIGITS and _CANONICAL.fullmatch(session_id):
        return int(session_id)
    return -1


def generation_session_id(session_id: str | None, id_slot) -> str | None:
    """The session of a generation request given ``session_id`` and/or llama.cpp's ``id_slot``
    (-1 or absent: none); 400 when they name two different sessions."""
    if id_slot is None or (isinstance(id_slot, int) and not isinstance(id_slot, bool) and id_slot == -1):
        return session_id
    if isinstance(id_slot, str):
        raise InvalidRequestError(f"id_slot must be an integer, got {id_slot!r}")
    sid = slot_session_id(id_slot)
    if session_id is not None and session_id != sid:
        raise InvalidRequestError(f"id_slot {id_slot} is the session {sid!r}, but session_id is {session_id!r}: "
                                  "give one of them (or both naming the same session)")
    return sid


class SlotsNotSupportedError(OpencotiError):
    """Slot files need a state directory (HTTP 501, as llama.cpp without ``--slot-save-path``)."""

    status_code = 501
    error_type = "not_supported_error"


def _resolve(engine: SlotTarget, session_id: str) -> tuple[SlotEngine, str, str | None]:
    """(the Engine, the engine's session id, the tenant) for an Engine or a TenantEngine."""
    if isinstance(engine, TenantSlots):  # a tenant's view: its session namespace
        eng, sid = engine.engine_and_session_id(session_id)
        return eng, sid, engine.tenant
    if not isinstance(session_id, str) or not session_id:
        raise InvalidRequestError("session_id must be a non-empty string")
    return engine, session_id, None


def _path(engine: SlotEngine, filename: str, tenant: str | None = None) -> Path:
    """``<state_dir>/slots/<filename>`` (a tenant's files in ``slots/<tenant>/``: its own names)."""
    state_dir = engine.config.state_dir
    if state_dir is None:
        raise SlotsNotSupportedError("this server does not support slot save/restore: start it with --state-dir")
    if not isinstance(filename, str) or not _NAME.fullmatch(filename) or ".." in filename:
        raise InvalidRequestError("Invalid filename: use 1-128 characters of A-Z a-z 0-9 . _ - "
                                  "(no paths), starting with a letter or digit")
    d = Path(state_dir).expanduser() / "slots"
    if tenant is not None:
        d = d / tenant
    d.mkdir(parents=True, exist_ok=True)
    return d / filename


def save_session(engine: SlotTarget, session_id: str, filename: str) -> dict:
    """Write the session's cached tokens and their KV to ``filename``."""
    eng, sid, tenant = _resolve(engine, session_id)
    path = _path(eng, filename, tenant)
    t0 = time.perf_counter()
    core = eng.core

    def snap() -> tuple[list[int], torch.Tensor, torch.Tensor]:
        s = core.polykv.get_session(sid)
        if s.job is not None:
            raise SessionBusyError(f"session {sid!r} is serving a request; save it when idle")
        n = s.seq.num_cached
        toks = list(s.seq.tokens[:n])
        k, v = kvfile.snapshot_kv(core.kv, s.seq.page_table, 0, n)
        return toks, k, v

    toks, k, v = _mapped(engine, eng.run_on_step_thread, snap)
    nbytes = kvfile.write_kv(path, k, v, 0, toks, extra={"identity": identity_of(eng), "kv": kv_identity_of(eng)},
                             store_tokens=True)
    return {"filename": filename, "n_saved": len(toks), "n_written": nbytes,
            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}


def restore_session(engine: SlotTarget, session_id: str, filename: str) -> dict:
    """Replace the session's cache with the tokens and KV saved in ``filename`` (the session is
    created when it does not exist)."""
    eng, sid, tenant = _resolve(engine, session_id)
    path = _path(eng, filename, tenant)
    t0 = time.perf_counter()
    if not path.exists():
        raise InvalidRequestError(f"no slot file named {filename!r}")
    head = kvfile.read_header(path)
    toks = kvfile.read_tokens(path, head) if head is not None else None
    if head is None or toks is None:
        raise InvalidRequestError(f"{filename!r} is not a slot file")
    if head.get("identity") != identity_of(eng):
        raise InvalidRequestError(f"{filename!r} was saved by another model ({head.get('identity')})")
    if head.get("kv") != kv_identity_of(eng):  # same tokens, other KV: never load it
        raise InvalidRequestError(f"{filename!r} holds KV computed {_kv_desc(head.get('kv'))}, this server computes "
                                  f"it {_kv_desc(kv_identity_of(eng))}: it cannot be restored here")
    core = eng.core

    def restore() -> int:
        if toks:
            core.limits.check_tokens(toks, "the saved tokens")
            core.limits.check_fits(len(toks), 0, "the saved context")
        s = core.sessions.get(sid)
        if s is not None and s.job is not None:
            raise SessionBusyError(f"session {sid!r} is serving a request; restore it when idle")
        if s is None:
            core.limits.check_session_id(sid)
        seq = SeqState(toks)
        if toks and not core.tables.extend_reclaiming(seq, len(toks)):  # reclaims idle caches when needed
            raise CapacityError(f"no room for {core.kv.pages_for(len(toks))} KV pages to restore {filename!r}",
                                retry_after=1.0)
        if toks and not kvfile.load_kv(path, core.kv, seq.page_table, 0, len(toks), toks):
            core.tables.drop(seq)
            raise InvalidRequestError(f"{filename!r} does not match this engine's KV layout (dtype or shape)")
        # ---- committed
        core.tables.advance(seq, len(toks))
        core.polykv.restore_session_kv(sid, seq)  # its old cache (and pool attachment) is replaced
        return len(toks)

    n = _mapped(engine, eng.run_on_step_thread, restore)
    return {"filename": filename, "n_restored": n, "n_read": path.stat().st_size,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}


def erase_session(engine: SlotTarget, session_id: str) -> dict:
    """Drop the session's cached tokens and KV (the session and its pool attachment stay)."""
    eng, sid, _ = _resolve(engine, session_id)
    core = eng.core

    def erase() -> int:
        s = core.polykv.get_session(sid)
        if s.job is not None:
            raise SessionBusyError(f"session {sid!r} is serving a request; erase it when idle")
        n = len(s.seq.tokens)
        core.polykv.drop_session_kv(s, detach=False)
        return n

    return {"n_erased": _mapped(engine, eng.run_on_step_thread, erase)}


def _kv_desc(ident) -> str:
    if not isinstance(ident, dict):
        return "by an unknown engine"
    return (f"with {ident.get('weights')} weights and {ident.get('kv_dtype')} KV "
            f"(model {ident.get('model')}, fingerprint {ident.get('fingerprint')})")


def _mapped(engine: SlotTarget, run: Callable[[Callable[[], T]], T], fn: Callable[[], T]) -> T:
    """``run(fn)``; a tenant's view rewrites its session ids out of error messages."""
    try:
        return run(fn)
    except OpencotiError as e:
        raise (engine.rewrite_error(e) if isinstance(engine, TenantSlots) else e) from None
