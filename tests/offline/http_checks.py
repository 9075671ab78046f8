"""Assertions on HTTP answers shared by the PolyKV route tests: a 200's JSON, or an error in
llama.cpp's shape with the expected status and message."""

from __future__ import annotations


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def err(r, status: int, match: str = "") -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["code"] == status and match in e["message"], e
    return e
