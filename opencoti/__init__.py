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

# Weights are streamed from memory every decode step (0.8 GB a step for a 1B Q4_K_M model, 5 GB for
# 8B): on 4 KB pages each step walks hundreds of thousands of TLB entries. torch's CPU allocator
# puts allocations of 2 MB and more on transparent huge pages when THP_MEM_ALLOC_ENABLE=1 (where the
# kernel's THP mode is "madvise", the common default, nothing else does). Measured on a 2-core AVX2
# EPYC, a 1B Q4_K_M decode step: 53.1 / 50.1 ms on 4 KB pages, 40.8 / 44.7 ms on huge pages
# (alternating runs); the bundled model 7.35 -> 6.57 ms. Read by torch at its first CPU allocation,
# so it is set here, before the engine allocates anything; THP_MEM_ALLOC_ENABLE=0 turns it off.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
