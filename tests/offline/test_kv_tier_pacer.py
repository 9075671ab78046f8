"""The disk tier's step pacer (``persist/pacer.py``): the I/O thread's chunks run only between steps (with
the credit the steps give) or while the engine is idle, a step waits for a chunk in flight but never long,
and a paced, chunked KV file is the same file, byte for byte, as one written at once."""

from __future__ import annotations

import json
import threading
import time
import zlib
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from opencoti.engine.persist import kvfile
from opencoti.engine.persist.files import HEADER, MAGIC
from opencoti.engine.persist.pacer import GRACE_S, StepPacer


def run_turn(pacer: StepPacer, work_s: float, log: list) -> threading.Thread:
    def body():
        with pacer.writing(), pacer.turn():
            log.append(("start", time.monotonic()))
            time.sleep(work_s)
            log.append(("end", time.monotonic()))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def test_idle_turns_are_free_and_a_step_holds_them_until_it_ends():
    p = StepPacer(share=0.5)
    log: list = []
    run_turn(p, 0.0, log).join(1)
    assert [k for k, _ in log] == ["start", "end"]  # idle (no step yet): free
    p.step_begin()
    log.clear()
    t = run_turn(p, 0.0, log)
    time.sleep(0.05)
    assert log == []  # a step is running: the writer waits
    p.step_end(0.02)  # 10 ms of credit
    t.join(1)
    assert [k for k, _ in log] == ["start", "end"]


def test_a_step_waits_for_the_chunk_in_flight_and_a_debt_is_paid_by_later_steps():
    p = StepPacer(share=0.5)
    p.step_begin()
    p.step_end(0.02)  # 10 ms of credit
    log: list = []
    t = run_turn(p, 0.03, log)  # the chunk runs 30 ms: 20 ms over
    while not log:
        time.sleep(0.001)
    p.step_begin()  # waits for the chunk (at most its credit + the grace)
    began = time.monotonic()
    t.join(1)
    assert began >= log[0][1] + 0.01 - 1e-3
    p.step_end(0.02)  # the step waited 12 ms (credit + grace), the chunk ran 18 more: pays 10 of 20 ms of debt
    log2: list = []
    t2 = run_turn(p, 0.0, log2)
    time.sleep(0.05)
    assert log2 == []
    p.step_begin()
    p.step_end(10.0)  # the rest of the debt and more (the debt is capped at what one step lends)
    t2.join(1)
    assert log2 and p.stats["turns"] == 2


def test_a_stuck_write_holds_a_step_no_longer_than_its_credit_and_the_grace():
    p = StepPacer(share=0.5)
    p.step_begin()
    p.step_end(0.004)  # 2 ms of credit
    log: list = []
    t = run_turn(p, 1.0, log)  # a write the disk blocks
    while not log:
        time.sleep(0.001)
    t0 = time.monotonic()
    p.step_begin()
    assert time.monotonic() - t0 < 0.002 + GRACE_S + 0.5  # (a loaded machine's scheduling; far below the 1 s)
    assert p.stats["step_wait_timeouts"] == 1
    t.join(2)
    p.step_end(0.2)  # 100 ms: more than the debt's cap, whatever the stuck write ran
    log2: list = []
    run_turn(p, 0.0, log2).join(1)
    assert log2


def test_unpaced_turns_run_beside_steps_and_idle_releases_a_waiting_writer():
    free = StepPacer(share=None)
    free.step_begin()
    log: list = []
    run_turn(free, 0.0, log).join(1)
    assert log  # share None: nothing is paced
    p = StepPacer()
    p.step_begin()
    p.step_end(0.0)  # no credit
    log2: list = []
    t = run_turn(p, 0.0, log2)
    time.sleep(0.05)
    assert log2 == []
    p.idle()  # the loop waits for requests (or closes): turns are free
    t.join(1)
    assert log2
    p.step_begin()
    p.step_end(0.0)
    log3: list = []
    t3 = run_turn(p, 0.0, log3)
    time.sleep(0.05)
    assert log3 == []
    p.share = None  # pacing switched off while a writer waits: the next step's end lets it go
    p.step_begin()
    p.step_end(0.0)
    t3.join(1)
    assert log3


def test_bad_shares_are_refused():
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError):
            StepPacer(share=bad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_chunked_paced_kv_file_is_the_file_written_at_once(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 37, 2, 8, generator=g).to(dtype)
    v = torch.randn(3, 37, 2, 8, generator=g).to(dtype)
    toks = list(range(100, 137))
    whole = tmp_path / "whole.kv"
    kvfile.write_kv(whole, k, v, 5, toks, store_tokens=True, durable=False, extra={"tier": {"x": 1}})
    turns = []

    class Turn:
        def __enter__(self):
            turns.append(1)

        def __exit__(self, *exc):
            return False

    chunked = tmp_path / "chunked.kv"
    kvfile.write_kv(chunked, k, v, 5, toks, store_tokens=True, durable=False, extra={"tier": {"x": 1}},
                    chunk_bytes=100, turn=Turn)
    assert chunked.read_bytes() == whole.read_bytes()
    body = 2 * k.numel() * k.element_size()
    assert len(turns) == 2 * -(-body // 2 // 100) + 2  # K and V in 100-byte chunks, then the 148 bytes of tokens
    # the format itself, read without the writer's code: magic + JSON header padded to HEADER, K, V, tokens
    raw = chunked.read_bytes()
    assert raw.startswith(MAGIC) and len(raw) == HEADER + body + 4 * len(toks)
    meta = json.loads(raw[len(MAGIC):raw.index(b"\n", len(MAGIC))])
    as_bytes = [(t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes() for t in (k, v)]
    expect = b"".join(as_bytes) + np.asarray(toks, dtype="<u4").tobytes()
    assert raw[HEADER:] == expect
    assert meta["checksum"] == {"crc32": f"{zlib.crc32(expect):08x}"}
    assert (meta["shape"], meta["start"], meta["end"], meta["tier"], meta["n_tokens_stored"]) == (
        [3, 37, 2, 8], 5, 42, {"x": 1}, 37)


def test_an_empty_kv_file_and_a_header_too_large(tmp_path):
    k = torch.zeros(2, 0, 1, 4, dtype=torch.float16)
    path = tmp_path / "empty.kv"
    assert kvfile.write_kv(path, k, k, 0, [], durable=False, chunk_bytes=64, turn=nullcontext) == HEADER
    raw = path.read_bytes()
    meta = json.loads(raw[len(MAGIC):raw.index(b"\n", len(MAGIC))])
    assert len(raw) == HEADER and meta["checksum"] == {"crc32": f"{zlib.crc32(b''):08x}"}
    big = tmp_path / "big.kv"
    with pytest.raises(ValueError, match="header too large"):
        kvfile.write_kv(big, k, k, 0, [], extra={"pad": "x" * HEADER}, chunk_bytes=64, turn=nullcontext)
    assert not big.exists() and not (tmp_path / "big.kv.tmp").exists()


def test_a_segment_dropped_while_it_is_written_stops_at_its_next_chunk(tmp_path):
    from opencoti.engine.persist.tier_files import DROPPED, PENDING, Segment, write_segment

    k = torch.zeros(2, 4, 16, 1, 8, dtype=torch.float16)  # [L, n pages, page size, H, D]
    seg = Segment("s.kv", [bytes(16)] * 4, list(range(64)), 0, bytes(16), 2 * k.numel() * 2, k, k.clone())
    pacer = StepPacer(share=None, chunk_bytes=256)
    calls = []
    turn = pacer.turn

    def counting_turn():
        calls.append(1)
        if len(calls) == 3:
            seg.state = DROPPED  # evicted by the step thread meanwhile
        return turn()

    pacer.turn = counting_turn  # type: ignore[method-assign]
    write_segment(tmp_path / "s.kv", seg, None, pacer)
    assert len(calls) == 3 and not (tmp_path / "s.kv").exists() and not (tmp_path / "s.kv.tmp").exists()
    seg.state = PENDING
    write_segment(tmp_path / "s.kv", seg, None, StepPacer(share=None, chunk_bytes=256))  # not dropped: written
    assert (tmp_path / "s.kv").exists()
