"""The cluster tests need the ``cluster`` extra (Ray Serve); a bare ``pytest`` without it skips them,
saying why. ``make test`` installs the extra and sets ``OPENCOTI_REQUIRE_CLUSTER=1``: there a missing
extra stops the run with an import error instead of skipping the tests."""

from __future__ import annotations

import os

if os.environ.get("OPENCOTI_REQUIRE_CLUSTER") == "1":
    import ray.serve  # noqa: F401
