"""Ray Serve's PrefixCacheAffinityRouter on the cluster's forwarded requests (router="ray-prefix").
No Ray instance is started: the router's text extraction is called directly."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="needs the cluster extra (Ray Serve): pip install -e '.[cluster]'")

from opencoti.cluster.app import ClusterConfig  # noqa: E402
from opencoti.cluster.ray_prefix import PrefixCacheAffinityRouter, RayPrefixAffinityRouter, request_prompt  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are agent 3."}, {"role": "user", "content": "Next step?"}]


def forwarded(body) -> dict:
    """What ClusterIngress passes to the replica handle: the raw HTTP request."""
    return {"method": "POST", "path": "/v1/chat/completions", "query": "", "headers": [],
            "body": json.dumps(body).encode()}


def pending(*args):
    return SimpleNamespace(args=args, kwargs={"route": {}})


def test_rays_own_extraction_rejects_our_forwarded_requests():
    router = object.__new__(PrefixCacheAffinityRouter)
    with pytest.raises(ValueError, match="No request with message or prompt"):
        router._extract_text_from_request(pending(forwarded({"messages": MESSAGES})))


def test_the_adapter_reads_the_prompt_text_as_ray_normalizes_it():
    router = object.__new__(RayPrefixAffinityRouter)
    text = router._extract_text_from_request(pending(forwarded({"messages": MESSAGES, "max_tokens": 4})))
    assert text == "You are agent 3.Next step?"  # Ray's own normalization: contents concatenated
    assert router._extract_text_from_request(pending(forwarded({"prompt": "abc"}))) == "abc"
    assert router._extract_text_from_request(pending(forwarded({"content": "xyz"}))) == "xyz"  # llama.cpp /completion
    # admin calls and bodies without a prompt carry no text (Ray then routes by load alone)
    assert router._extract_text_from_request(pending({"method": "GET", "path": "/health", "body": b""})) is None
    assert router._extract_text_from_request(pending(forwarded({"messages": []}))) is None
    assert request_prompt([{"body": b"not json"}]) is None


def test_the_router_is_a_deployment_option():
    assert ClusterConfig(router="ray-prefix").router == "ray-prefix"
    with pytest.raises(ValueError, match="router must be one of"):
        ClusterConfig(router="nope")
