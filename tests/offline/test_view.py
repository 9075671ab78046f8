"""``PolyKVView`` (opencoti/engine/polykv/view.py), the declared read surface of the engine's state, is
what its readers read and what every implementation has, checked by mypy.

The assignments below are the check: mypy accepts ``type[P] = C`` only when ``C``'s instances have
every member of the protocol ``P`` with a compatible type. The core implements the view and what
admission and the persister need beyond it (the Engine and the admission controller what the persister
reads of them); the simulator's ``SimCore`` the view and admission's
request path; the tests' ``FakeCore`` the view. ``Metrics`` is type-checked against the view it is
given, so a read outside it fails too. And at run time, Metrics and the admission controller driven
by the simulator, and the persister writing and restoring a state directory, read nothing of the
core beyond what they declare.
"""

from __future__ import annotations

from pathlib import Path
from typing import Generic, Protocol

from fake_core import FakeCore
from mypy import api

from opencoti.engine.admission.controller import AdmissionController, AdmissionCore
from opencoti.engine.api.engine import Engine
from opencoti.engine.core.core import EngineCore
from opencoti.engine.persist.engine_view import PersistCore, PersistEngine, PoolPolicies
from opencoti.engine.polykv.view import PolyKVView
from opencoti.sim.engine import SimCore

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve()

_core_view: type[PolyKVView] = EngineCore
_core_admission: type[AdmissionCore] = EngineCore
_core_persist: type[PersistCore] = EngineCore
_engine_persist: type[PersistEngine] = Engine
_admission_persist: type[PoolPolicies] = AdmissionController
_sim_view: type[PolyKVView] = SimCore
_sim_admission: type[AdmissionCore] = SimCore
_fake_view: type[PolyKVView] = FakeCore

CHECKED = ["opencoti/engine/polykv/view.py", "opencoti/engine/observe/metrics.py", "tests/offline/fake_core.py",
           "tests/offline/test_view.py"]


def _mypy(*files: str) -> tuple[str, int]:
    out, err, rc = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--no-error-summary", *files])
    return out + err, rc


def test_the_core_the_simulator_and_the_fake_have_the_view(monkeypatch):
    monkeypatch.chdir(ROOT)
    out, rc = _mypy(*CHECKED)
    assert rc == 0, out


def test_a_surface_change_breaks_the_type_check(tmp_path, monkeypatch):
    """A member an implementation lacks, or a read outside the view, is a type error (so the check
    above can fail)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MYPYPATH", str(HERE.parent))  # fake_core
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import Protocol\n"
        "from fake_core import FakeCore\n"
        "from opencoti.engine.core.core import EngineCore\n"
        "from opencoti.engine.polykv.view import PolyKVView\n"
        "from opencoti.sim.engine import SimCore\n\n\n"
        "class Wider(PolyKVView, Protocol):\n"
        "    def pool_bytes(self, pool_id: int) -> int: ...\n\n\n"
        "_core: type[Wider] = EngineCore\n"
        "_sim: type[Wider] = SimCore\n"
        "_fake: type[Wider] = FakeCore\n\n\n"
        "def read(core: PolyKVView) -> int:\n"
        "    return core.vocab_size\n")
    out, rc = _mypy(str(probe))
    assert rc == 1, out
    for cls in ("EngineCore", "SimCore", "FakeCore"):
        assert f'(expression has type "type[{cls}]", variable has type "type[Wider]")' in out, out
    assert '"PolyKVView" has no attribute "vocab_size"' in out, out


def _members(proto: type) -> set[str]:
    return {name for cls in proto.__mro__ if cls not in (object, Protocol, Generic)
            for name in vars(cls) if not name.startswith("_")}


class Recording:
    """The core as its readers see it: every attribute they read is recorded."""

    def __init__(self, core):
        object.__setattr__(self, "_core", core)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._core, name)

    def __setattr__(self, name, value):
        raise AssertionError(f"a reader set core.{name}")


def test_metrics_and_admission_read_only_what_they_declare():
    """The simulator's loop, with Metrics and the AdmissionController given a recording core: what
    they read of it is in ``PolyKVView`` (Metrics) and ``AdmissionCore`` (admission), and the
    surfaces declared are all used."""
    from opencoti.engine.admission import AdmissionController
    from opencoti.engine.config import SamplingParams
    from opencoti.engine.observe.metrics import Metrics
    from opencoti.sim.engine import SimEngine
    from opencoti.sim.profile import StepProfile

    sim = SimEngine(StepProfile(name="t", table={1: 0.05, 2: 0.06}, noise_sigma=0.0, prefill_s=0.0), seed=1)
    pid = sim.core.add_pool(40).pool_id
    clock = lambda: sim.t  # noqa: E731
    for_metrics, for_admission = Recording(sim.core), Recording(sim.core)
    sim.metrics = Metrics(for_metrics, clock=clock, wall_clock=clock)
    sim.admission = adm = AdmissionController(for_admission, sim.post_to_step_thread, sim.metrics, clock=clock)
    adm.set_policy(pid, target_tps_per_session=1.0)
    params = SamplingParams.greedy(40, ignore_eos=True)
    for sid in ("a", "b"):
        assert adm.capacity(pid, session_id=sid)["can_admit"]
        adm.submit(list(range(1, 61)), params, lambda ev: None, session_id=sid, pool_id=pid).result()
        sim.run_until(sim.t + 1.0)
    sim.run_until(sim.t + 5.0)
    sim.metrics.snapshot()
    sim.metrics.prometheus()
    sim.metrics.counters()
    view, admission = _members(PolyKVView), _members(AdmissionCore)
    assert for_metrics.read <= view, for_metrics.read - view
    assert for_admission.read <= admission, for_admission.read - admission
    assert view <= for_metrics.read | for_admission.read, view - for_metrics.read - for_admission.read
    assert {"prepare", "commit"} <= for_admission.read


def test_the_persister_reads_only_what_it_declares(make_engine, tmp_path):
    """A Persister given a recording core writes an engine's pools and session and restores them
    into another engine (KV file of a pinned pool included): it reads nothing of the core beyond
    ``PersistCore``, and uses what ``PersistCore`` adds to the view."""
    from opencoti.engine import SamplingParams
    from opencoti.engine.persist.store import StateStore
    from opencoti.engine.persist.engine_view import identity_of, kv_identity_of
    from opencoti.engine.persist.sync import Persister

    def persist(eng, restore_only: bool) -> set[str]:
        core = Recording(eng.core)
        p = Persister(StateStore(tmp_path, identity=identity_of(eng)), core, kv_identity=kv_identity_of(eng))
        try:
            stats = p.restore()
            p.sync()
            assert (stats["pools"], stats["sessions"], stats["kv_loaded_pools"]) == ((1, 1, 1) if restore_only
                                                                                     else (0, 0, 0))
        finally:
            eng.core.listeners.remove(p.on_event)
            p.close()
        return core.read

    first = make_engine()
    pool = first.create_pool(tokens=list(range(10, 42)), pinned=True)
    first.generate(list(range(10, 42)) + [5, 6], pool_id=pool.pool_id, session_id="agent",
                   params=SamplingParams.greedy(3))
    read = first.run_on_step_thread(persist, first, False)
    second = make_engine()
    read |= second.run_on_step_thread(persist, second, True)
    assert second.pool(pool.pool_id).residency == "resident"  # its KV came back from the file
    declared = _members(PersistCore)
    assert read <= declared, read - declared
    assert {"vocab_size", "kv", "tables", "sessions", "tree", "listeners", "max_context"} <= read, read
