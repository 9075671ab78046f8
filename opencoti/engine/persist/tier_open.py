"""Opening the engine's disk tier (``tier.DiskTier``) from its configuration."""

from __future__ import annotations

import logging
from pathlib import Path

from .tier import TIER_DIR, DiskTier
from .tier_files import tier_budget_mib

log = logging.getLogger("opencoti.engine.persist")


def open_tier(engine) -> DiskTier | None:
    """The engine's disk tier, attached to its KV tables (None: off: no directory, a budget of 0,
    or no prefix cache to keep its pages)."""
    from .engine_view import kv_identity_of

    config = engine.config
    if config.kv_disk_dir is not None:
        directory = Path(config.kv_disk_dir).expanduser()
    elif config.state_dir is not None:
        directory = Path(config.state_dir).expanduser() / TIER_DIR
    else:
        return None
    if config.kv_disk_budget_mib == 0 or not config.prefix_cache:
        if config.kv_disk_budget_mib:
            log.warning("KV tier: off, it needs the prefix cache (--prefix-cache on)")
        return None
    directory.mkdir(parents=True, exist_ok=True)
    budget = tier_budget_mib(config, directory)
    if budget <= 0:
        return None
    tier = DiskTier(directory, int(budget * 2**20), kv_identity_of(engine))
    # a finished prefetch wakes the step loop (it sleeps while the only waiting request waits for it)
    tier.wake = lambda: engine.post_to_step_thread(lambda: None)
    engine.core.tables.tier = tier
    log.info("KV tier: %s, %.0f MiB: pages reclaimed from RAM are kept there and read back", directory, budget)
    return tier
