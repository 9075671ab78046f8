#!/usr/bin/env python
"""Soak: many clients churning pools, sessions and requests against a real `opencoti serve`.

Starts ``opencoti serve`` on a free loopback port (the bundled model, or ``--model``; ``--server
URL`` uses a running one, ``--server-pid`` then gives its process for RSS) and runs ``--clients``
threads, each with its own HTTP connection, for ``--duration`` seconds. Each step a client picks,
by the ``--churn`` weights, one of: a chat turn on one of its named sessions, a streaming chat
(closed mid-stream with probability ``--disconnect``), a completion on one of its pools, create a
root pool, fork one of its pools (extend or branch), release a leaf pool, release a session, a
bad input (lone surrogate, empty messages, wrong types, unknown pool, text/plain body, broken
JSON, oversized label, ...), or a read of ``/polykv/pools``, ``/slots`` or ``/metrics``.

Phases: warm-up (``--warmup`` s of the same mix, then cleanup) -> baseline (integrity, KV pages
used, RSS) -> soak -> RSS at the end -> cleanup (every pool and session the clients made released)
-> integrity, KV pages and RSS again. Reports the request count, status counts, 5xx (must be 0),
integrity before/after, KV pages before/after (must be back to the baseline) and the RSS ratios to
the post-warm-up level (target: the RSS outside the KV pages after cleanup within ``--rss-tolerance``,
5 %; the KV pages, memory maps resident as first written, stay resident while the prefix cache holds
them, at most the KV budget). Exits 1 when a 5xx
was answered, the integrity check failed, or the pages did not come back. The load average is
recorded with the machine: a shared machine slows the requests, not the verdicts.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from common import fmt, log, print_table, ratio  # noqa: E402

HIST: dict = {}  # pool id -> what the clients did with it (to explain a pool left after cleanup)
JSON_H = {"content-type": "application/json"}
WORDS = ("agent pool session prefix branch fork cache page token model tree leaf root shared budget "
         "admission floor stream context window memory tenant label policy compaction").split()

KV_TENSOR_BYTES = [0]  # one KV tensor's bytes (set from /props at start)
# name -> weight: what a client does each step (``--churn`` overrides, e.g. "chat=3,bad=2")
DEFAULT_CHURN = {"chat": 4, "stream": 3, "pool_gen": 3, "create": 1, "fork": 1, "release_pool": 1,
                 "release_session": 1, "bad": 2, "read": 1}


# ============================================================================ server
def start_server(model: str | None, max_pools: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "opencoti", "serve", "--port", "0", "--log-level", "warning", "--state-dir", "none",
           "--max-pools", str(max_pools), *extra]
    if model:
        cmd += ["--model", model]
    proc = common.track(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
    tail: list[str] = []
    while True:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"the server exited (code {proc.returncode}) before listening:\n" + "".join(tail[-20:]))
        tail.append(line)
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if m:
            threading.Thread(target=lambda: [sys.stderr.write(f"[server] {ln}") for ln in proc.stderr
                                             if "Traceback" in ln or "ERROR" in ln or "Error" in ln],
                             daemon=True).start()
            return proc, m.group(1)


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def kv_rss_mib(pid: int | None, tensor_bytes: int) -> float | None:
    """Resident MiB of the server's KV pages: its anonymous mappings at least one KV tensor large (K
    and V, possibly merged into one mapping by the kernel; on CPU they are memory maps whose pages
    become resident as they are first written and stay so while the prefix cache may reuse them).
    Nothing else the server maps anonymously is that large."""
    if pid is None or tensor_bytes <= 0:
        return None
    try:
        maps = common.smaps(pid)
    except OSError:
        return None
    # K and V, possibly merged with each other and little else
    total = sum(m["rss"] for m in maps if not m["path"] and tensor_bytes - 8192 <= m["size"] <= 2 * tensor_bytes + 2**26)
    return total / 2**20


# ============================================================================ clients
class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.status: Counter = Counter()
        self.by_action: dict[str, Counter] = {}
        self.errors_5xx: list[str] = []
        self.transport_errors: Counter = Counter()
        self.disconnects = 0
        self.requests = 0

    def record(self, action: str, status: int, detail: str = "") -> None:
        with self.lock:
            self.requests += 1
            self.status[status] += 1
            self.by_action.setdefault(action, Counter())[status] += 1
            if status >= 500 and len(self.errors_5xx) < 50:
                self.errors_5xx.append(f"{action} {status} {detail[:300]}")


class Client:
    """One simulated user: its own connection, named sessions, and a small pool tree."""

    def __init__(self, idx: int, base: str, vocab: list[int], stats: Stats, args, rng: random.Random):
        import httpx

        self.idx, self.vocab, self.stats, self.args, self.rng = idx, vocab, stats, args, rng
        self.http = httpx.Client(base_url=base, timeout=args.request_timeout)
        self.sessions: set[str] = set()  # named and anonymous (x-session-id) sessions this client made
        self.pools: dict[int, dict] = {}  # pool id -> {"tokens", "parent", "children"}
        self.n = 0

    # ---- helpers -------------------------------------------------------------------------
    def req(self, action: str, method: str, url: str, **kw):
        try:
            r = self.http.request(method, url, **kw)
        except Exception as e:  # noqa: BLE001 - a transport error is counted, never fatal
            with self.stats.lock:
                self.stats.transport_errors[f"{action}: {type(e).__name__}"] += 1
            return None
        self.stats.record(action, r.status_code, r.text if r.status_code >= 500 else "")
        sid = r.headers.get("x-session-id")
        if sid:
            self.sessions.add(sid)
        return r

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def toks(self, n: int) -> list[int]:
        return [self.rng.choice(self.vocab) for _ in range(n)]

    def session_id(self) -> str:
        if self.sessions and self.rng.random() < 0.7:
            return self.rng.choice(sorted(self.sessions))
        self.n += 1
        sid = f"soak-{self.idx}-{self.n}"
        self.sessions.add(sid)  # tracked at once: a refused or cut request may still have made it
        return sid

    def leaf_pools(self) -> list[int]:
        return [pid for pid, p in self.pools.items() if not p["children"]]

    # ---- actions -------------------------------------------------------------------------
    def chat(self) -> None:
        body = {"messages": [{"role": "user", "content": self.words(self.rng.randint(3, 30))}],
                "max_tokens": self.rng.randint(1, self.args.max_tokens), "temperature": 0.7}
        if self.rng.random() < 0.8:
            body["session_id"] = self.session_id()
        self.req("chat", "POST", "/v1/chat/completions", json=body)

    def stream(self) -> None:
        body = {"messages": [{"role": "user", "content": self.words(self.rng.randint(3, 30))}],
                "max_tokens": self.args.max_tokens * 2, "stream": True, "session_id": self.session_id()}
        cut = self.rng.random() < self.args.disconnect
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                self.stats.record("stream", r.status_code, r.read().decode(errors="replace")
                                  if r.status_code >= 500 else "")
                if r.status_code != 200:
                    return
                for i, _ in enumerate(r.iter_lines()):
                    if cut and i >= 2:
                        with self.stats.lock:
                            self.stats.disconnects += 1
                        break  # leaving the block closes the connection mid-stream
        except Exception as e:  # noqa: BLE001
            with self.stats.lock:
                self.stats.transport_errors[f"stream: {type(e).__name__}"] += 1
        if cut:  # the connection is gone: the next request opens a new one
            self.http.close()
            import httpx
            self.http = httpx.Client(base_url=str(self.http.base_url), timeout=self.args.request_timeout)

    def pool_gen(self) -> None:
        if not self.pools:
            return self.create()
        pid = self.rng.choice(sorted(self.pools))
        body = {"prompt": self.pools[pid]["tokens"] + self.toks(self.rng.randint(1, 24)), "pool_id": pid,
                "n_predict": self.rng.randint(1, self.args.max_tokens)}
        if self.rng.random() < 0.5:
            body["session_id"] = self.session_id()
        self.req("pool_gen", "POST", "/completion", json=body)

    def create(self) -> None:
        if len(self.pools) >= self.args.pools_per_client:
            return self.release_pool()
        tokens = self.toks(self.rng.randint(self.args.page_size, 5 * self.args.page_size))
        r = self.req("create", "POST", "/polykv/pools",
                     json={"tokens": tokens, "label": f"soak {self.idx}", "pinned": self.rng.random() < 0.2})
        if r is not None and r.status_code == 200:
            self.pools[r.json()["pool_id"]] = {"tokens": tokens, "parent": None, "children": set()}
            HIST.setdefault(r.json()["pool_id"], []).append(("create", self.idx))

    def fork(self) -> None:
        if not self.pools or len(self.pools) >= self.args.pools_per_client:
            return self.create() if not self.pools else self.release_pool()
        pid = self.rng.choice(sorted(self.pools))
        parent = self.pools[pid]["tokens"]
        body: dict = {"label": f"soak {self.idx} fork"}
        if self.rng.random() < 0.5 or len(parent) < 2:
            tokens = parent + self.toks(self.rng.randint(1, 3 * self.args.page_size))  # extend
        else:
            d = self.rng.randint(1, len(parent) - 1)  # branch
            tokens = parent[:d] + self.toks(self.rng.randint(1, 2 * self.args.page_size))
            body["branch_pos"] = d
        body["tokens"] = tokens
        r = self.req("fork", "POST", f"/polykv/pools/{pid}/fork", json=body)
        if r is not None and r.status_code == 200:
            cid = r.json()["pool_id"]
            self.pools[cid] = {"tokens": tokens, "parent": pid, "children": set()}
            HIST.setdefault(cid, []).append(("fork", self.idx, pid))
            self.pools[pid]["children"].add(cid)

    def release_pool(self, pid: int | None = None) -> None:
        leaves = self.leaf_pools()
        if pid is None:
            if not leaves:
                return
            pid = self.rng.choice(leaves)
        r = self.req("release_pool", "DELETE", f"/polykv/pools/{pid}")
        HIST.setdefault(pid, []).append(("delete", self.idx, r.status_code if r is not None else None,
                                         r.text[:200] if r is not None and r.status_code != 200 else ""))
        if r is not None and r.status_code in (200, 404):
            p = self.pools.pop(pid)
            if p["parent"] in self.pools:
                self.pools[p["parent"]]["children"].discard(pid)

    def release_session(self, sid: str | None = None) -> None:
        if sid is None:
            if not self.sessions:
                return
            sid = self.rng.choice(sorted(self.sessions))
        r = self.req("release_session", "DELETE", f"/polykv/sessions/{sid}")
        if r is not None and r.status_code in (200, 404):
            self.sessions.discard(sid)

    def bad(self) -> None:
        """An input the server must refuse with a 4xx (never a 5xx, never a half-made object)."""
        kind = self.rng.randrange(12)
        if kind == 0:  # a lone surrogate, as raw JSON (json.dumps would escape it the same way)
            self.req("bad", "POST", "/v1/chat/completions", headers=JSON_H,
                     content=b'{"messages":[{"role":"user","content":"hi \\ud800"}],"max_tokens":2}')
        elif kind == 1:
            self.req("bad", "POST", "/v1/chat/completions", json={"messages": [], "max_tokens": 2})
        elif kind == 2:
            self.req("bad", "POST", "/completion", json={"prompt": "x", "n_predict": "many"})
        elif kind == 3:
            self.req("bad", "POST", "/completion", json={"prompt": [1, 2, 3], "pool_id": 10**9, "n_predict": 2})
        elif kind == 4:
            self.req("bad", "POST", "/completion", headers={"content-type": "text/plain"},
                     content=b'{"prompt": "x", "n_predict": 2}')
        elif kind == 5:
            self.req("bad", "POST", "/v1/chat/completions", headers=JSON_H, content=b'{"messages": [')
        elif kind == 6:
            self.req("bad", "POST", "/polykv/pools", json={"tokens": self.toks(4), "label": "L" * 5000})
        elif kind == 7:
            self.req("bad", "POST", "/polykv/pools", headers=JSON_H,
                     content=b'{"text": "abc", "label": "\\udfff"}')
        elif kind == 8:
            self.req("bad", "POST", "/polykv/pools", json={})
        elif kind == 9:
            self.req("bad", "POST", f"/polykv/pools/{10**9}/fork", json={"tokens": self.toks(4)})
        elif kind == 10:
            self.req("bad", "POST", "/tokenize", headers=JSON_H, content=b'{"content": "\\ud800x"}')
        else:
            self.req("bad", "POST", "/v1/chat/completions",
                     json={"messages": [{"role": "user", "content": "x"}], "max_tokens": -5, "stop": ["a"] * 100})

    def read(self) -> None:
        url = self.rng.choice(["/polykv/pools", "/slots", "/metrics", "/health", "/polykv/events"])
        self.req("read", "GET", url)

    # ---- loop ----------------------------------------------------------------------------
    def run(self, until: float, weights: dict[str, int]) -> None:
        names, w = list(weights), list(weights.values())
        while time.monotonic() < until:
            action = self.rng.choices(names, w)[0]
            try:
                getattr(self, action)()
            except Exception as e:  # noqa: BLE001 - a bug here must not end the soak silently
                with self.stats.lock:
                    self.stats.transport_errors[f"{action}: {type(e).__name__}: {e}"[:200]] += 1

    def cleanup(self) -> None:
        """Release every session (first: they hold their pools) and every pool (leaves first) this client made."""
        for sid in sorted(self.sessions):
            self.release_session(sid)
        while self.pools:
            before = len(self.pools)
            for pid in self.leaf_pools():
                self.release_pool(pid)
            if len(self.pools) == before:  # refused (409 while a child lives elsewhere?): give up on them
                log(f"client {self.idx}: could not release pools {sorted(self.pools)}")
                break


def run_phase(clients: list[Client], seconds: float, weights: dict[str, int]) -> float:
    until = time.monotonic() + seconds
    t0 = time.perf_counter()
    ts = [threading.Thread(target=c.run, args=(until, weights), daemon=True) for c in clients]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def cleanup_all(clients: list[Client]) -> None:
    ts = [threading.Thread(target=c.cleanup, daemon=True) for c in clients]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


# ============================================================================ main
def parse_churn(spec: str | None) -> dict[str, int]:
    weights = dict(DEFAULT_CHURN)
    if spec:
        for part in spec.split(","):
            k, _, v = part.partition("=")
            if k.strip() not in weights:
                raise SystemExit(f"--churn: unknown action {k!r} (one of {', '.join(weights)})")
            weights[k.strip()] = int(v)
    if not any(weights.values()):
        raise SystemExit("--churn: every weight is 0")
    return weights


def probe(http, pid: int | None) -> dict:
    integ = http.get("/polykv/integrity")
    pools = http.get("/polykv/pools").json()
    slots = http.get("/slots")
    return {"integrity_status": integ.status_code, "integrity_ok": integ.status_code == 200 and integ.json().get("ok"),
            "kv_pages_used": pools["kv_pages_used"], "kv_pages_cache": pools.get("kv_pages_cache"),
            "pools": len(pools["pools"]), "sessions": len(slots.json()) if slots.status_code == 200 else None,
            "rss_mib": rss_mib(pid), "metrics_lines": len(http.get("/metrics").text.splitlines()),
            "kv_rss_mib": kv_rss_mib(pid, KV_TENSOR_BYTES[0]),
            "pool_list": [(q["pool_id"], q["parent"], q["label"], q["children"], q["sessions"], q["pinned"],
                           q["release_in_s"]) for q in pools["pools"]],
            "session_list": [(s["session_id"], s["pool_id"], s["state"]) for s in slots.json()][:50]
            if slots.status_code == 200 else None}


def short(pr: dict) -> dict:
    """A probe without the lists, unless something is left (then the first few, to see what)."""
    out = {k: v for k, v in pr.items() if not k.endswith("_list")}
    if pr["pools"] or pr["sessions"]:
        out["left"] = {"pools": pr["pool_list"][:5], "sessions": (pr["session_list"] or [])[:5]}
    return out


def drain(http, limit_s: float, pages_baseline: int | None = None, series: list | None = None) -> float:
    """Wait until no pool is left and (when ``pages_baseline`` is given) the KV pages in use are back
    to it, at most ``limit_s`` seconds: a released pool stays (auto-pinned) for the server's grace TTL
    (``--pool-grace-ttl``, 30 s by default) after its last session or child left, so a chain of
    forks released leaves first takes about one TTL per level before its pages are freed.
    ``series`` gets (seconds, pools, KV pages used) every 5 s."""
    t0 = time.monotonic()
    last = -5.0
    while True:
        pools = http.get("/polykv/pools").json()
        now = time.monotonic() - t0
        if series is not None and now - last >= 5.0:
            series.append((round(now, 1), len(pools["pools"]), pools["kv_pages_used"]))
            last = now
        if not pools["pools"] and (pages_baseline is None or pools["kv_pages_used"] == pages_baseline):
            break
        if now >= limit_s:
            break
        time.sleep(1.0)
    return time.monotonic() - t0


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model to serve (default: the bundled one); e.g. tiny:llama")
    p.add_argument("--server", default=None, help="use a running server at URL instead of starting one")
    p.add_argument("--server-pid", type=int, default=None, help="with --server: its process id, for RSS")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=300.0, help="soak seconds (after the warm-up)")
    p.add_argument("--warmup", type=float, default=30.0, help="warm-up seconds of the same mix (then cleanup)")
    p.add_argument("--churn", default=None,
                   help="action weights, e.g. 'chat=4,stream=3,pool_gen=3,create=1,fork=1,release_pool=1,"
                        "release_session=1,bad=2,read=1' (unnamed ones keep their default)")
    p.add_argument("--disconnect", type=float, default=0.3, help="share of streams closed mid-stream")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per request at most (streams: twice)")
    p.add_argument("--pools-per-client", type=int, default=4, help="live pools per client at most")
    p.add_argument("--page-size", type=int, default=16, help="the server's page size (pool prefix lengths)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--drain-timeout", type=float, default=180.0,
                   help="seconds to wait at most after cleanup for the released pools to leave and the KV pages "
                        "to come back to the baseline: a released pool waits out the grace TTL after its last "
                        "child went, so a chain of forks takes one TTL per level")
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `opencoti serve` argument (repeatable)")
    args = p.parse_args()
    if args.quick:
        args.duration, args.warmup, args.clients = 20.0, 5.0, min(args.clients, 4)
    weights = parse_churn(args.churn)
    import httpx

    info = common.machine_info()
    log(common.describe_machine(info))
    proc = None
    if args.server:
        base, pid = args.server.rstrip("/"), args.server_pid
    else:
        extra = list(args.serve_arg)
        if args.threads:
            extra += ["--threads", str(args.threads)]
        # enough pool budget for every client's live pools and the released ones still in their grace
        # TTL: a 503 "budget exhausted" is backpressure, not what this measures
        proc, base = start_server(args.model, max(64, args.clients * args.pools_per_client * 6), extra)
        pid = proc.pid
    rng = random.Random(args.seed)
    failures: list[str] = []
    try:
        http = httpx.Client(base_url=base, timeout=args.request_timeout)
        t_wait = time.monotonic() + 600
        while http.get("/health").status_code != 200:
            if time.monotonic() > t_wait:
                raise RuntimeError("the server did not become healthy in 600 s")
            time.sleep(0.5)
        vocab = sorted(set(http.post("/tokenize", json={"content": " ".join(WORDS) + " 0123456789 .,;:!?"})
                           .json()["tokens"]))
        poly = http.get("/props").json()["opencoti"]["polykv"]
        KV_TENSOR_BYTES[0] = poly["kv_pages_total"] * poly["page_size"] * poly["kv_bytes_per_token"] // 2
        start = probe(http, pid)
        log(f"start: {short(start)}")

        def clients_for(phase: str) -> tuple[Stats, list[Client]]:
            st = Stats()
            return st, [Client(i, base, vocab, st, args, random.Random(rng.random())) for i in range(args.clients)]

        warm_stats, warm = clients_for("warmup")
        log(f"warm-up: {args.clients} clients for {args.warmup:g} s")
        run_phase(warm, args.warmup, weights)
        cleanup_all(warm)
        drain(http, args.drain_timeout)
        before = probe(http, pid)
        log(f"after warm-up and cleanup: {short(before)}")

        stats, soakers = clients_for("soak")
        log(f"soak: {args.clients} clients for {args.duration:g} s, churn {weights}")
        loads = [os.getloadavg()]
        sampler_stop = threading.Event()
        rss_series: list[tuple[float, float | None]] = []

        def sample():
            t0 = time.monotonic()
            while not sampler_stop.wait(10.0):
                rss_series.append((round(time.monotonic() - t0, 1), rss_mib(pid)))
                loads.append(os.getloadavg())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        took = run_phase(soakers, args.duration, weights)
        sampler_stop.set()
        end = probe(http, pid)
        log(f"end of soak: {short(end)}")
        t0 = time.perf_counter()
        cleanup_all(soakers)
        cleanup_s = time.perf_counter() - t0
        drain_series: list = []
        drain_s = drain(http, args.drain_timeout, before["kv_pages_used"], drain_series)
        after = probe(http, pid)
        log(f"after cleanup: {short(after)}")
        for c in warm + soakers:
            c.http.close()

        n_5xx = sum(n for s, n in stats.status.items() if s >= 500) + sum(
            n for s, n in warm_stats.status.items() if s >= 500)
        if n_5xx:
            failures.append(f"{n_5xx} responses were 5xx: {stats.errors_5xx[:5] + warm_stats.errors_5xx[:5]}")
        for name, pr in (("start", start), ("baseline", before), ("end", end), ("after cleanup", after)):
            if not pr["integrity_ok"]:
                failures.append(f"integrity check failed at {name} ({pr['integrity_status']})")
        if after["pools"]:
            failures.append(f"{after['pools']} pools the clients released are still there after {drain_s:.0f} s "
                            f"(id, parent, label, children, sessions, pinned, release_in_s): {after['pool_list'][:8]}")
        if after["kv_pages_used"] != before["kv_pages_used"]:
            failures.append(f"KV pages used {after['kv_pages_used']} after cleanup vs {before['kv_pages_used']} "
                            "at the baseline")
        rss_end, rss_after = ratio(end["rss_mib"], before["rss_mib"]), ratio(after["rss_mib"], before["rss_mib"])

        def other(pr):  # RSS outside the KV pages (they stay resident as the prefix cache's pages)
            return None if pr["rss_mib"] is None or pr["kv_rss_mib"] is None else pr["rss_mib"] - pr["kv_rss_mib"]
        other_end, other_after = ratio(other(end), other(before)), ratio(other(after), other(before))
        rss_ok = None if other_after is None else other_after <= 1 + args.rss_tolerance

        print_table(["status", "soak", "warm-up"],
                    [[str(s), stats.status.get(s, 0), warm_stats.status.get(s, 0)]
                     for s in sorted(set(stats.status) | set(warm_stats.status))],
                    title=f"Responses ({stats.requests} soak requests in {took:.0f} s = "
                          f"{stats.requests / took:.1f}/s, {stats.disconnects} mid-stream disconnects)")
        print_table(["action"] + [str(s) for s in sorted(stats.status)],
                    [[a] + [c.get(s, 0) for s in sorted(stats.status)] for a, c in sorted(stats.by_action.items())],
                    title="Soak responses per action")
        rows = [[name, "ok" if pr["integrity_ok"] else "FAILED", pr["kv_pages_used"], pr["kv_pages_cache"],
                 pr["pools"], pr["sessions"], pr["metrics_lines"], pr["rss_mib"], pr["kv_rss_mib"], other(pr),
                 ratio(other(pr), other(before))]
                for name, pr in (("start", start), ("post-warm-up (baseline)", before), ("end of soak", end),
                                 ("after cleanup", after))]
        print_table(["point", "integrity", "KV pages used", "KV pages cache", "pools", "sessions", "/metrics lines",
                     "RSS MiB", "KV resident MiB", "RSS outside KV MiB", "outside KV / baseline"], rows,
                    title="Server state")
        print(f"\n5xx: {n_5xx} (must be 0); transport errors: {dict(stats.transport_errors) or 0}; "
              f"cleanup took {cleanup_s:.1f} s, then {drain_s:.1f} s until the released pools were gone and the "
              f"KV pages back to the baseline (waiting {args.drain_timeout:g} s at most)")
        print("after cleanup (s, pools, KV pages used): " + " ".join(f"{t:g}/{n}/{pg}" for t, n, pg in drain_series))
        print(f"RSS outside the KV pages after cleanup / post-warm-up: {fmt(other_after, 3)} "
              f"({'PASS' if rss_ok else 'FAIL' if rss_ok is not None else 'n/a'}: within {args.rss_tolerance:.0%}); "
              f"end of soak / post-warm-up: {fmt(other_end, 3)}; whole RSS {fmt(rss_after, 3)} / {fmt(rss_end, 3)} "
              f"(the KV pages written stay resident, held by the prefix cache, at most the KV budget)")
        print(f"load average during the soak: {' '.join('/'.join(f'{x:.1f}' for x in la) for la in loads)}")
        path = common.write_json("soak", {
            "machine": info, "args": vars(args), "churn": weights, "server": base,
            "requests": stats.requests, "seconds": took, "status": {str(k): v for k, v in sorted(stats.status.items())},
            "by_action": {a: {str(k): v for k, v in c.items()} for a, c in stats.by_action.items()},
            "warmup_status": {str(k): v for k, v in sorted(warm_stats.status.items())},
            "n_5xx": n_5xx, "errors_5xx": stats.errors_5xx + warm_stats.errors_5xx,
            "transport_errors": dict(stats.transport_errors), "disconnects": stats.disconnects,
            "probes": {"start": start, "baseline": before, "end": end, "after_cleanup": after},
            "rss_end_vs_baseline": rss_end, "rss_after_cleanup_vs_baseline": rss_after, "rss_pass": rss_ok,
            "rss_outside_kv_end_vs_baseline": other_end, "rss_outside_kv_after_cleanup_vs_baseline": other_after,
            "kv_tensor_bytes": KV_TENSOR_BYTES[0],
            "rss_series": rss_series, "loadavg_during": loads, "cleanup_s": cleanup_s, "drain_s": drain_s,
            "drain_series": drain_series, "drain_timeout_s": args.drain_timeout,
            "left_pools_history": {q[0]: HIST.get(q[0]) for q in after["pool_list"]}, "failures": failures,
        }, args.out)
        log(f"wrote {path}")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
