"""Admission control per pool: policy, capacity maths, plan -> decide -> commit, settle windows.

* ``policy``: ``AdmissionPolicy`` and the named reasons.
* ``capacity``: ``CapacityInputs`` -> the capacity report (pure maths).
* ``decide``: ``AdmissionPlan`` (built by the core), ``GateInputs``, the pure ``decide``.
* ``state``: per-pool state (settle window, learned drop, hold queue).
* ``controller``: ``AdmissionController``, which measures, decides, commits and holds on the
  engine's step thread, its deadlines driven by the step loop (``tick`` / ``next_deadline``).

See docs/polykv.md for the semantics.
"""

from .capacity import CapacityInputs, compute_capacity, model_ratio
from .controller import AdmissionController
from .decide import ADMIT, HOLD, REJECT, UNGATED, AdmissionPlan, Decision, GateInputs, decide
from .policy import (ADVISORY, ENFORCED, FLOOR_REASONS, QUEUE, REASON_CONTEXT, REASON_FLOOR, REASON_FLOOR_IDLE,
                     REASON_GUARANTEED, REASON_KV, REASON_OK, REASON_QUEUE_TIMEOUT, REASON_SETTLING,
                     REASON_UNCERTAIN, REASON_UNMEASURED, REJECT as ON_REJECT, UNKNOWN, WARN, AdmissionPolicy)
from .state import DROP_ALPHA, Held, PoolState, Settle, fold_drop

__all__ = ["ADMIT", "HOLD", "REJECT", "UNGATED", "ADVISORY", "ENFORCED", "QUEUE", "WARN", "ON_REJECT",
           "FLOOR_REASONS", "REASON_CONTEXT", "REASON_FLOOR", "REASON_FLOOR_IDLE", "REASON_GUARANTEED", "REASON_KV",
           "REASON_OK", "REASON_QUEUE_TIMEOUT", "REASON_SETTLING", "REASON_UNCERTAIN",
           "REASON_UNMEASURED", "UNKNOWN", "DROP_ALPHA",
           "AdmissionController", "AdmissionPlan", "AdmissionPolicy", "CapacityInputs", "Decision", "GateInputs",
           "Held", "PoolState", "Settle", "compute_capacity", "decide", "fold_drop", "model_ratio"]
