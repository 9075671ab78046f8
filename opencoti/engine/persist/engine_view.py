"""The engine as persistence sees it, declared: what the persister reads of the core
(``PersistCore``) and of the admission controller (``PoolPolicies``), how it runs a function on the
step thread (``RunOnStep``), what ``sync.attach`` / ``open_state`` and the slot files read of the
``Engine`` (``PersistEngine``), and the identities stored state must match to be used by an engine:
``identity_of`` a state directory's (token ids only mean something to the same tokenizer),
``kv_identity_of`` a KV file's (the same tokens give other KV under another model, weight format or
KV dtype). Checked against ``EngineCore``, ``AdmissionController`` and ``Engine`` by mypy
(``tests/offline/test_view.py``).
"""

from __future__ import annotations

import hashlib
import weakref
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, TypeVar, runtime_checkable

from ..polykv.view import PolyKVView

if TYPE_CHECKING:
    import torch

    from ..admission.state import PoolState
    from ..chat.tokenizer import Tokenizer
    from ..config import EngineConfig
    from ..limits import Limits
    from ..errors import OpencotiError
    from ..kv.pages import PagePool
    from ..kv.tables import KVTables
    from ..model.types import LoadedModel
    from ..polykv.state import PolyKV

T = TypeVar("T")


class PersistCore(PolyKVView, Protocol):
    """What the persister needs of the core: the read-only view (what it writes to the store),
    plus what restoring and loading KV files take: the vocabulary size, the KV pages themselves
    (``kvfile`` copies their rows), the KV tables, and the owner of the pool and session state
    (``PolyKV``), whose ``restore_pool`` / ``restore_session`` / ``pool_loaded`` bring the stored
    tree back: the persister writes no pool or session field itself."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def polykv(self) -> PolyKV: ...

    @property
    def kv(self) -> PagePool: ...

    @property
    def tables(self) -> KVTables: ...


class PoolPolicies(Protocol):
    """What the persister needs of the admission controller (``AdmissionController``): each pool's
    admission state (its policy is stored with the pool) and ``set_policy`` to restore one."""

    @property
    def states(self) -> Mapping[int, PoolState]: ...

    def set_policy(self, pool_id: int, **policy: object) -> dict: ...


class RunOnStep(Protocol):
    """Runs ``fn()`` on the step thread and returns its result (``Engine.run_on_step_thread``)."""

    def __call__(self, fn: Callable[[], T]) -> T: ...


class EmbeddingRows(Protocol):
    """The model's input embedding table as the KV identity samples it (a tensor, or a GGUF's
    quantized rows: ``model/embedding.py``)."""

    @property
    def shape(self) -> torch.Size: ...

    def __getitem__(self, rows: slice) -> torch.Tensor: ...


class IdentityModel(Protocol):
    """The forward as the KV identity reads it: its embedding table and weight format."""

    @property
    def embed(self) -> EmbeddingRows: ...

    @property
    def weights(self) -> str: ...


class KvDtype(Protocol):
    """The KV page store as the KV identity reads it: its dtype's name."""

    @property
    def dtype_name(self) -> str: ...


class PersistEngine(Protocol):
    """What persistence reads of the ``Engine``: the core (``sync.PersistCore``), its configuration
    (``state_dir``, ``session_kv_budget_mib``), and what the identities are made of: the tokenizer, the
    loaded model (name, config, source), the forward and the KV pages' dtype."""

    @property
    def core(self) -> PersistCore: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def loaded(self) -> LoadedModel: ...

    @property
    def model(self) -> IdentityModel: ...

    @property
    def kv(self) -> KvDtype: ...


class SlotCore(PersistCore, Protocol):
    """What the slot files (``slots.py``) need of the core besides the persister's: the request checks
    a restored session's tokens and id go through."""

    @property
    def limits(self) -> Limits: ...


class SlotEngine(PersistEngine, Protocol):
    """What the slot files need of the ``Engine``: the persister's reads (the identities, the state
    directory), its core with the request checks, and its step thread (the work on sessions and pages
    runs there)."""

    @property
    def core(self) -> SlotCore: ...

    def run_on_step_thread(self, fn: Callable[[], T]) -> T: ...


@runtime_checkable
class TenantSlots(Protocol):
    """A tenant's view of an ``Engine`` (``api.tenancy.TenantEngine``) as the slot files use it: the
    shared engine and its id of one of the tenant's sessions, the tenant (its files live apart), and
    the rewriting of its session ids out of an error's message."""

    @property
    def tenant(self) -> str: ...

    def engine_and_session_id(self, session_id: str) -> tuple[SlotEngine, str]: ...

    def rewrite_error(self, e: OpencotiError) -> OpencotiError: ...


def identity_of(engine: PersistEngine) -> dict:
    """What a state directory must match: token ids only mean something to the same tokenizer."""
    tok = engine.tokenizer
    return {"model": engine.loaded.name, "vocab_size": int(engine.core.vocab_size),
            "eos": sorted(int(t) for t in tok.eos_token_ids)}


_KV_IDENTITIES: weakref.WeakKeyDictionary[PersistEngine, dict] = weakref.WeakKeyDictionary()  # engine -> identity


def kv_identity_of(engine: PersistEngine) -> dict:
    """What a KV file must match besides its tokens and shape: the same tokens give other KV under
    another model, another weight format (int4 projections compute other keys and values than fp32)
    or another KV dtype. The page size is not part of it: a file holds token rows, loaded into any
    page layout. Computed once per engine (on its step thread)."""
    cached = _KV_IDENTITIES.get(engine)
    if cached is not None:
        return cached
    model = engine.model
    h = hashlib.sha256(engine.loaded.hf_config.to_json_string(use_diff=False).encode())
    rows = -(-4096 // model.embed.shape[1])  # the table's first 4096 values (a sample of this model's weights)
    emb = model.embed[:rows].reshape(-1)[:4096].float().contiguous().cpu()
    h.update(emb.numpy().tobytes())
    ident = {**identity_of(engine), "fingerprint": h.hexdigest()[:16], "weights": str(model.weights),
             "source": "gguf" if engine.loaded.source_gguf else "hf",
             "kv_dtype": engine.kv.dtype_name}
    _KV_IDENTITIES[engine] = ident
    return ident
