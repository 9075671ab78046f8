"""The disk tier's step pacer (``persist/pacer.py``): a window's work runs on the step thread before a step
(with the credit the steps give) or on the I/O thread while the engine is idle, a step waits for an idle
window but never long, errors reach the writer, and a paced, windowed KV file - buffered or ``O_DIRECT`` -
is the same file, byte for byte, as one written at once."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
import zlib

import numpy as np
import pytest
import torch

from opencoti.engine.persist import kvfile
from opencoti.engine.persist.files import HEADER, MAGIC
from opencoti.engine.persist.pacer import GRACE_S, StepPacer


def run_window(pacer: StepPacer, work_s: float, log: list, fail: BaseException | None = None) -> threading.Thread:
    """The I/O thread handing one window's work to the pacer; ``log`` gets which thread ran it."""
    def work():
        log.append(("start", threading.current_thread().name, time.monotonic()))
        time.sleep(work_s)
        log.append(("end", threading.current_thread().name, time.monotonic()))
        if fail is not None:
            raise fail

    def body():
        try:
            pacer.run(work)
        except BaseException as e:  # noqa: BLE001 - recorded for the test
            log.append(("raised", e, time.monotonic()))

    t = threading.Thread(target=body, name="io", daemon=True)
    t.start()
    return t


def wait_posted(p: StepPacer) -> None:
    for _ in range(1000):
        if p._job is not None:
            return
        time.sleep(0.001)
    raise AssertionError("the writer never posted its window")


def test_idle_windows_run_on_the_io_thread_and_steps_run_them_only_with_credit():
    p = StepPacer(share=0.5)
    log: list = []
    run_window(p, 0.0, log).join(1)
    assert [(k, who) for k, who, _ in log] == [("start", "io"), ("end", "io")]  # idle (no step yet): its own
    p.step_begin()
    p.step_end(0.0)  # no credit
    log.clear()
    t = run_window(p, 0.0, log)
    wait_posted(p)
    p.step_begin()  # no credit: the step does not run it
    assert log == []
    p.step_end(0.02)  # 10 ms of credit
    p.step_begin()  # runs it, on this (the step) thread, before the step
    t.join(1)
    me = threading.current_thread().name
    assert [(k, who) for k, who, _ in log] == [("start", me), ("end", me)]
    assert p.stats["step_turns"] == 1 and p.stats["turns"] == 2


def test_a_window_over_its_credit_is_a_debt_paid_by_later_steps():
    p = StepPacer(share=0.5)
    p.step_begin()
    p.step_end(0.02)  # 10 ms of credit
    log: list = []
    t = run_window(p, 0.03, log)  # the window runs 30 ms: 20 ms over
    wait_posted(p)
    p.step_begin()
    t.join(1)
    p.step_end(0.02)  # pays 10 of the 20 ms of debt
    log2: list = []
    t2 = run_window(p, 0.0, log2)
    wait_posted(p)
    p.step_begin()
    assert log2 == []  # still in debt: the step does not run it
    p.step_end(10.0)  # the rest of the debt and more (the debt is capped at what one step lends)
    p.step_begin()
    t2.join(1)
    assert log2 and p.stats["step_turns"] == 2


def test_a_step_waits_for_an_idle_window_no_longer_than_the_grace():
    p = StepPacer(share=0.5)
    log: list = []
    t = run_window(p, 1.0, log)  # begun while idle, then the disk blocks it
    while not log:
        time.sleep(0.001)
    t0 = time.monotonic()
    p.step_begin()
    assert time.monotonic() - t0 < GRACE_S + 0.5  # (a loaded machine's scheduling; far below the 1 s)
    assert p.stats["step_waits"] == 1
    p.step_end(0.01)
    t0 = time.monotonic()
    p.step_begin()  # the same window still runs: the next step does not wait for it again
    assert p.stats["step_waits"] == 1 and time.monotonic() - t0 < 0.5
    p.step_end(0.01)
    t.join(2)
    assert [k for k, _, _ in log] == ["start", "end"]


def test_an_error_in_a_window_run_by_a_step_reaches_the_writer_not_the_step():
    p = StepPacer(share=0.5)
    p.step_begin()
    p.step_end(0.02)
    log: list = []
    t = run_window(p, 0.0, log, fail=OSError("disk full"))
    wait_posted(p)
    p.step_begin()  # does not raise
    t.join(1)
    assert log[-1][0] == "raised" and str(log[-1][1]) == "disk full"


def test_unpaced_windows_run_beside_steps_and_idle_or_switching_off_releases_a_waiting_writer():
    free = StepPacer(share=None)
    free.step_begin()
    log: list = []
    run_window(free, 0.0, log).join(1)
    assert [who for _, who, _ in log] == ["io", "io"]  # share None: nothing is paced
    p = StepPacer()
    p.step_begin()
    p.step_end(0.0)  # no credit
    log2: list = []
    t = run_window(p, 0.0, log2)
    wait_posted(p)
    assert log2 == []
    p.idle()  # the loop waits for requests (or closes): the writer works itself
    t.join(1)
    assert [who for _, who, _ in log2] == ["io", "io"]
    p.step_begin()
    p.step_end(0.0)
    log3: list = []
    t3 = run_window(p, 0.0, log3)
    wait_posted(p)
    p.share = None  # pacing switched off while a writer waits: the next step's end lets it go
    p.step_begin()
    p.step_end(0.0)
    t3.join(1)
    assert log3


def test_bad_shares_are_refused():
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError):
            StepPacer(share=bad)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_chunked_paced_kv_file_is_the_file_written_at_once(tmp_path, dtype, direct):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 37, 2, 8, generator=g).to(dtype)
    v = torch.randn(3, 37, 2, 8, generator=g).to(dtype)
    toks = list(range(100, 137))
    whole = tmp_path / "whole.kv"
    kvfile.write_kv(whole, k, v, 5, toks, store_tokens=True, durable=False, extra={"tier": {"x": 1}})
    turns = []

    def paced(work):
        turns.append(1)
        work()

    chunked = tmp_path / "chunked.kv"
    kvfile.write_kv(chunked, k, v, 5, toks, store_tokens=True, durable=False, extra={"tier": {"x": 1}},
                    chunk_bytes=4096 if direct else 100, paced=paced, direct=direct)
    assert chunked.read_bytes() == whole.read_bytes()
    body = 2 * k.numel() * k.element_size()
    step = 4096 if direct else 100  # (a direct file's windows are multiples of body_writer.ALIGN)
    assert len(turns) == -(-(body + 4 * len(toks)) // step)  # K, V and the tokens' 148 bytes, one stream in windows
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
    assert kvfile.write_kv(path, k, k, 0, [], durable=False, chunk_bytes=64, paced=lambda work: work()) == HEADER
    raw = path.read_bytes()
    meta = json.loads(raw[len(MAGIC):raw.index(b"\n", len(MAGIC))])
    assert len(raw) == HEADER and meta["checksum"] == {"crc32": f"{zlib.crc32(b''):08x}"}
    big = tmp_path / "big.kv"
    with pytest.raises(ValueError, match="header too large"):
        kvfile.write_kv(big, k, k, 0, [], extra={"pad": "x" * HEADER}, chunk_bytes=64, paced=lambda work: work())
    assert not big.exists() and not (tmp_path / "big.kv.tmp").exists()


def test_a_segment_dropped_while_it_is_written_stops_at_its_next_chunk(tmp_path):
    from opencoti.engine.persist.tier_files import DROPPED, PENDING, Segment, write_segment

    k = torch.zeros(2, 4, 16, 1, 8, dtype=torch.float16)  # [L, n pages, page size, H, D]
    seg = Segment("s.kv", [bytes(16)] * 4, list(range(64)), 0, bytes(16), 2 * k.numel() * 2, k, k.clone())
    pacer = StepPacer(share=None, chunk_bytes=256)
    calls = []
    run = pacer.run

    def counting_run(work):
        calls.append(1)
        if len(calls) == 3:
            seg.state = DROPPED  # evicted by the step thread meanwhile
        return run(work)

    pacer.run = counting_run  # type: ignore[method-assign]
    write_segment(tmp_path / "s.kv", seg, None, pacer)
    assert len(calls) == 3 and not (tmp_path / "s.kv").exists() and not (tmp_path / "s.kv.tmp").exists()
    seg.state = PENDING
    write_segment(tmp_path / "s.kv", seg, None, StepPacer(share=None, chunk_bytes=256))  # not dropped: written
    assert (tmp_path / "s.kv").exists()


def _kv(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 300, 2, 8, generator=g).half(), torch.randn(2, 300, 2, 8, generator=g).half()


def test_a_direct_file_is_opened_o_direct_where_the_filesystem_allows_it(tmp_path):
    from opencoti.engine.persist.body_writer import O_DIRECT, BodySink

    sink = BodySink(tmp_path / "probe", 4096, direct=True)
    try:
        with open(f"/proc/self/fdinfo/{sink.fd}") as f:
            flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
        # the flag on the descriptor is what the sink says it used (a filesystem that refuses it: buffered)
        assert bool(flags & O_DIRECT) == sink.direct
    finally:
        sink.close()
    odd = BodySink(tmp_path / "odd", 100, direct=True)
    assert not odd.direct and odd.view is None  # a window not a multiple of ALIGN: buffered
    odd.close()


def test_a_filesystem_refusing_o_direct_gets_the_same_file_buffered(tmp_path, monkeypatch):
    from opencoti.engine.persist import body_writer

    k, v = _kv()
    kvfile.write_kv(tmp_path / "ref.kv", k, v, 0, list(range(300)), store_tokens=True, durable=False)
    real_open, real_pwrite = os.open, os.pwrite

    def refusing_open(path, flags, *a):
        if flags & body_writer.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refusing_open)  # (tmpfs on older kernels)
    info: dict = {}
    kvfile.write_kv(tmp_path / "a.kv", k, v, 0, list(range(300)), store_tokens=True, durable=False,
                    chunk_bytes=4096, direct=True, info=info)
    assert info == {"direct": False} and (tmp_path / "a.kv").read_bytes() == (tmp_path / "ref.kv").read_bytes()
    monkeypatch.setattr(os, "open", real_open)
    calls = []

    def refusing_second_write(fd, data, offset):
        calls.append(offset)
        if len(calls) == 2 and fcntl.fcntl(fd, fcntl.F_GETFL) & body_writer.O_DIRECT:  # the open was taken,
            # a later write is not (some network filesystems)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing_second_write)
    info = {}
    kvfile.write_kv(tmp_path / "b.kv", k, v, 0, list(range(300)), store_tokens=True, durable=False,
                    chunk_bytes=4096, direct=True, info=info)
    assert info == {"direct": False} and (tmp_path / "b.kv").read_bytes() == (tmp_path / "ref.kv").read_bytes()
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError):  # any other error is the writer's to handle (the tier: that segment is lost)
        kvfile.write_kv(tmp_path / "c.kv", k, v, 0, [], durable=False, chunk_bytes=4096, direct=True)
    assert not (tmp_path / "c.kv").exists() and not (tmp_path / "c.kv.tmp").exists()  # nothing half-written


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_direct_file_is_written_beside_the_paced_work_a_buffered_one_inside_it(tmp_path, monkeypatch, direct):
    """The paced work (run on the step thread) of a direct file only checksums and copies: its writes
    happen outside, on the writer's thread (a disk that blocks a direct write never holds a step). A
    buffered file's copy into the page cache is the paced work itself."""
    k, v = _kv(2)
    inside = [False]
    writes: list[bool] = []
    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):
        writes.append(inside[0])
        return real_pwrite(fd, data, offset)

    def paced(work):
        inside[0] = True
        try:
            work()
        finally:
            inside[0] = False

    monkeypatch.setattr(os, "pwrite", pwrite)
    info: dict = {}
    kvfile.write_kv(tmp_path / "a.kv", k, v, 0, list(range(300)), store_tokens=True, durable=False,
                    chunk_bytes=4096, paced=paced, direct=direct, info=info)
    body_writes = writes[:-1]  # (the last is the header, after the body)
    if info["direct"]:
        assert body_writes and not any(body_writes)
    else:  # buffered (asked, or the filesystem refused O_DIRECT)
        assert body_writes and all(body_writes)
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    kvfile.write_kv(tmp_path / "ref.kv", k, v, 0, list(range(300)), store_tokens=True, durable=False)
    assert (tmp_path / "a.kv").read_bytes() == (tmp_path / "ref.kv").read_bytes()
