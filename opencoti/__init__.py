"""opencoti: a serving engine for multi-agent LLM workloads."""

import os as _os

# OpenMP workers that spin-wait for long between parallel regions collapse throughput 5-10x as
# soon as anything else wants a core (a server's event loop, client threads, another process) on
# small CPU machines; fully passive waiting instead pays a wake-up on each of the ~120 GEMMs of a
# decode step (+50% step time at batch 1). A short spin keeps back-to-back regions fast and lets
# idle workers sleep. Only effective when opencoti is imported before torch (the CLI, server and
# benchmarks do); set GOMP_SPINCOUNT or OMP_WAIT_POLICY yourself to override. A spinning team
# still collapses when a core is taken for long (another process): the engine then drops to fewer
# threads at run time (engine/model/threads.py).
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "20000")

__version__ = "0.1.0"
