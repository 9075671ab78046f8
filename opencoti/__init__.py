"""opencoti: a serving engine for multi-agent LLM workloads."""

import os as _os

# OpenMP threads that spin-wait between parallel regions collapse throughput 5-10x as soon as
# anything else wants a core (a server's event loop, client threads, a second process) on small
# CPU machines. Passive waiting costs nothing measurable at our step sizes. This only takes
# effect when opencoti is imported before torch (the CLI and server always do); set
# OMP_WAIT_POLICY yourself to override.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
