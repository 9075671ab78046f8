"""The declared interfaces through which the slot files and a tenant's view reach the shared engine,
checked by mypy like ``test_view.py``'s: ``persist/engine_view.py``'s ``SlotEngine`` (what
``persist/slots.py`` reads of the ``Engine``: the persister's reads, the core with its request checks,
the step thread) and ``TenantSlots`` (a ``TenantEngine`` as the slot files use it), and
``api/tenancy.py``'s ``StepThread`` (what a ``TenantEngine`` runs on the engine's step thread and
reads of its core: the read-only pool tree, ``mark_anonymous``). A ``type[P] = C`` assignment is
accepted only when ``C``'s instances have every member of ``P`` with a compatible type, and the
modules that use the interfaces are type-checked against them (no read outside them).
"""

from __future__ import annotations

from pathlib import Path

from mypy import api

from opencoti.engine.api.engine import Engine
from opencoti.engine.api.tenancy import StepThread, TenantEngine
from opencoti.engine.persist.engine_view import SlotEngine, TenantSlots

ROOT = Path(__file__).resolve().parents[2]

_engine_slots: type[SlotEngine] = Engine
_tenant_slots: type[TenantSlots] = TenantEngine
_engine_step: type[StepThread] = Engine

CHECKED = ["opencoti/engine/persist/slots.py", "opencoti/engine/persist/engine_view.py",
           "opencoti/engine/api/tenancy.py", "tests/offline/test_typed_interfaces.py"]


def test_the_engine_and_a_tenants_view_have_the_declared_interfaces(monkeypatch):
    monkeypatch.chdir(ROOT)
    out, err, rc = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--no-error-summary", *CHECKED])
    assert rc == 0, out + err


def test_a_tenants_view_is_told_from_the_engine():
    """``slots._resolve`` tells a tenant's view from the ``Engine`` by ``TenantSlots`` (run-time
    checkable): the engine has none of its members."""
    assert not isinstance(object.__new__(Engine), TenantSlots)
    view = object.__new__(TenantEngine)
    view.tenant = "alice"
    assert isinstance(view, TenantSlots)
