"""The cluster registry: one small named Ray actor per application.

It hands out replica tags (1, 2, 3, ...; never reused, so the pools of a replica that died are
known as lost rather than confused with a new replica's) and keeps the table of pool copies
(logical pool id -> {tag: local pool id}). It is detached so that it outlives any one replica or
ingress; ``opencoti cluster serve`` ends it with the local Ray instance, and on a shared cluster
``serve delete`` + ``ray.kill(get_registry(app))`` removes it.
"""

from __future__ import annotations

import time

import ray

NAMESPACE = "opencoti"


@ray.remote(num_cpus=0)
class Registry:
    def __init__(self):
        self.next_tag = 1
        self.replicas: dict[int, dict] = {}  # tag -> {"pid", "node", "started"}
        self.copies: dict[int, dict[int, int]] = {}
        self.version = 0

    def new_tag(self, info: dict) -> int:
        tag = self.next_tag
        self.next_tag += 1
        self.replicas[tag] = {**info, "started": time.time()}
        return tag

    def issued(self) -> int:
        """Tags 1..issued() have been handed out."""
        return self.next_tag - 1

    def add_copy(self, pool_id: int, tag: int, local_id: int) -> int:
        self.copies.setdefault(pool_id, {})[tag] = local_id
        self.version += 1
        return self.version

    def drop_pool(self, pool_id: int) -> int:
        self.copies.pop(pool_id, None)
        self.version += 1
        return self.version

    def all_copies(self) -> tuple[int, dict]:
        return self.version, {k: dict(v) for k, v in self.copies.items()}


def registry_name(app_name: str) -> str:
    return f"opencoti-registry:{app_name or 'default'}"


def get_registry(app_name: str):
    """The registry of application ``app_name`` (created on first use)."""
    return Registry.options(name=registry_name(app_name), namespace=NAMESPACE, lifetime="detached",
                            get_if_exists=True).remote()
