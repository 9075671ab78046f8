#!/usr/bin/env python
"""Crash consistency: ``kill -9`` a real ``opencoti serve`` at random instants while a client creates,
forks, streams on and releases pools, restart it on the same state directory, and check what came
back.

Each round starts the server on one state directory (kept across rounds), checks the restored state
against what the client was told before the previous kill, then runs a random mix of operations
(create a root pool, fork one, stream a greedy completion on one, release a leaf) and kills the
server at a random instant inside the round's target operation: after a random number of other
operations the target runs again and again, and the kill comes a random fraction of that kind's
measured request time (the HTTP request alone, median of the earlier ones) after one request is
sent, so it lands while the server handles it (a request answered before that instant is let go and
the next one is cut). The targets cycle through ``TARGETS``: pinned pool
creations and forks (the operations that write the database and a KV file before answering, half
the forks pinned) in two rounds of three, then streams, releases and unpinned creations. The kill
instant is recorded as the request in flight then (``landed``): ``--min-landed`` kills (20 by
default) must land during a fork or a pinned creation.

Checked after every restart:

* acknowledged pools lost: a pool whose creation was answered (and whose release was not) missing,
  or back with another parent, branch position, length or pin (0 required);
* ids reused: an id that came back for a pool the client never created or had released, or a new
  pool's id not above every id seen before (0 required);
* wrong answers from restored KV: every surviving pinned pool answers a greedy completion exactly
  as it did before the kills (its KV is loaded from its file at restart; 0 required); every start
  after the first serves the weight format the first one chose (``--weights``), so an answer
  checks the restored KV, not a different format;
* ``/polykv/integrity`` ok.

Writes ``benchmarks/results/<machine>/crash.json`` (machine, load before/after, commit, per-round
details). Exits 1 when a check fails.
"""

from __future__ import annotations

import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
from bench_soak import start_server  # noqa: E402
from common import fmt, log, print_table  # noqa: E402

KINDS = ("create", "create_pinned", "fork", "stream", "release")
TARGETS = ("create_pinned", "fork", "stream", "create_pinned", "fork", "release", "create_pinned", "fork", "create")
WRITES = ("create_pinned", "fork", "fork_pinned")  # what --min-landed counts
SUFFIX_WORDS = " and then the agent answered the question about".split()


class Journal:
    """What the client was told: acknowledged pools, released ids, every id seen, references."""

    def __init__(self):
        self.pools: dict[int, dict] = {}  # acknowledged and not released: id -> expected fields
        self.released: set[int] = set()
        self.seen: set[int] = set()
        self.refs: dict[int, dict] = {}  # pinned pool id -> {"prompt": [...], "tokens": [...]}
        self.in_flight: tuple[str, int | None] | None = None  # (kind, pool id) of the op at the kill
        self.request: str | None = None  # the HTTP request being answered now (create_pinned, fork_pinned, ...)
        self.request_t0 = 0.0
        self.request_s: dict[str, list[float]] = {}  # each kind's request times (the kill is timed by them)

    def send(self, what: str, fn):
        """One HTTP request, its kind marked while it is in flight (the killer reads it)."""
        self.request_t0 = time.perf_counter()
        self.request = what
        try:
            r = fn()
        finally:
            self.request = None
        self.request_s.setdefault(what, []).append(time.perf_counter() - self.request_t0)
        return r


class Round:
    def __init__(self, http, journal: Journal, rng: random.Random, vocab: list[int], args):
        self.http, self.j, self.rng, self.vocab, self.args = http, journal, rng, vocab, args

    def toks(self, n: int) -> list[int]:
        return [self.rng.choice(self.vocab) for _ in range(n)]

    # ---- the operations (each records what it was told, once it was told) ----------------------
    def create(self, pinned: bool | None = None) -> None:
        pinned = self.rng.random() < 0.6 if pinned is None else pinned
        tokens = self.toks(self.rng.choice((24, 40, 56)))
        self.j.in_flight = ("create", None)
        r = self.j.send("create_pinned" if pinned else "create",
                        lambda: self.http.post("/polykv/pools", json={"tokens": tokens, "pinned": pinned}))
        self._created(r, tokens, None, 0, pinned)

    def create_pinned(self) -> None:
        self.create(pinned=True)

    def known(self) -> list[int]:
        """Pools whose tokens the client knows (not one whose creation was cut and still came back)."""
        return sorted(pid for pid, p in self.j.pools.items() if p["tokens"] is not None)

    def fork(self) -> None:
        if not self.known():
            return self.create()
        pid = self.rng.choice(self.known())
        parent = self.j.pools[pid]
        branch = parent["prefix_len"] if self.rng.random() < 0.5 else self.rng.randrange(1, parent["prefix_len"])
        tokens = parent["tokens"][:branch] + self.toks(self.rng.choice((8, 16)))
        pinned = self.rng.random() < 0.5
        self.j.in_flight = ("fork", pid)
        r = self.j.send("fork_pinned" if pinned else "fork", lambda: self.http.post(
            f"/polykv/pools/{pid}/fork", json={"tokens": tokens, "branch_pos": branch, "pinned": pinned}))
        self._created(r, tokens, pid, branch, pinned)

    def _created(self, r, tokens, parent, branch, pinned) -> None:
        if r.status_code != 200:
            raise RuntimeError(f"pool creation answered {r.status_code}: {r.text[:300]}")
        p = r.json()
        self.check_new_id(p["pool_id"])
        self.j.pools[p["pool_id"]] = {"parent": parent, "branch_pos": branch, "prefix_len": len(tokens),
                                      "pinned": pinned, "tokens": tokens}
        self.j.in_flight = None
        if pinned and len(self.j.refs) < self.args.max_refs:  # its answer, to compare after restarts
            prompt = tokens + self.toks(4)
            self.j.refs[p["pool_id"]] = {"prompt": prompt, "tokens": self.complete(p["pool_id"], prompt)}

    def check_new_id(self, pid: int) -> None:
        if pid in self.j.seen or (self.j.seen and pid <= max(self.j.seen)):
            self.args.failures["ids_reused"].append(pid)
        self.j.seen.add(pid)

    def complete(self, pid: int, prompt: list[int]) -> list[int]:
        r = self.j.send("complete", lambda: self.http.post("/completion", json={
            "prompt": prompt, "pool_id": pid, "n_predict": self.args.n_predict, "temperature": 0, "ignore_eos": True,
            "return_tokens": True}))
        if r.status_code != 200:
            raise RuntimeError(f"completion answered {r.status_code}: {r.text[:300]}")
        return r.json()["tokens"]

    def stream(self) -> None:
        if not self.known():
            return self.create()
        pid = self.rng.choice(self.known())
        prompt = self.j.pools[pid]["tokens"] + self.toks(6)
        self.j.in_flight = ("stream", pid)
        def run():
            with self.http.stream("POST", "/completion", json={"prompt": prompt, "pool_id": pid, "stream": True,
                                                              "n_predict": self.args.n_predict * 2, "temperature": 0,
                                                              "ignore_eos": True}) as r:
                for _ in r.iter_lines():
                    pass
        self.j.send("stream", run)
        self.j.in_flight = None

    def release(self) -> None:
        children = {p["parent"] for p in self.j.pools.values()}
        leaves = [pid for pid in sorted(self.j.pools) if pid not in children]
        if not leaves:
            return self.create()
        pid = self.rng.choice(leaves)
        self.j.in_flight = ("release", pid)
        r = self.j.send("release", lambda: self.http.delete(f"/polykv/pools/{pid}", params={"immediate": "true"}))
        if r.status_code != 200:
            raise RuntimeError(f"release answered {r.status_code}: {r.text[:300]}")
        self.j.pools.pop(pid)
        self.j.refs.pop(pid, None)
        self.j.released.add(pid)
        self.j.in_flight = None

    def pick(self) -> str:
        if len(self.j.pools) >= self.args.max_live:
            return "release"
        return self.rng.choice(("create", "fork", "fork", "stream", "stream", "release"))


def verify_restart(http, j: Journal, failures: dict, rep: dict) -> None:
    """Compare the restored tree with the journal (the op cut by the kill may have gone either way)."""
    pools = {p["pool_id"]: p for p in http.get("/polykv/pools").json()["pools"]}
    kind, target = j.in_flight or (None, None)
    for pid, want in sorted(j.pools.items()):
        got = pools.get(pid)
        if got is None:
            if kind == "release" and pid == target:  # its release may have committed before the kill
                j.pools.pop(pid)
                j.refs.pop(pid, None)
                j.released.add(pid)
                continue
            failures["pools_lost"].append(pid)
            continue
        if (got["parent"], got["branch_pos"], got["prefix_len"], got["pinned"]) != \
                (want["parent"], want["branch_pos"], want["prefix_len"], want["pinned"]):
            failures["pools_changed"].append({"pool": pid, "want": {k: want[k] for k in (
                "parent", "branch_pos", "prefix_len", "pinned")}, "got": got})
    for pid, got in sorted(pools.items()):
        if pid in j.pools:
            continue
        if pid in j.released or pid in j.seen:
            failures["ids_reused"].append(pid)  # a released (or lost) pool's id came back
        elif kind in ("create", "fork"):  # the creation in flight committed before the kill: keep it
            j.seen.add(pid)
            j.pools[pid] = {"parent": got["parent"], "branch_pos": got["branch_pos"], "prefix_len": got["prefix_len"],
                            "pinned": got["pinned"], "tokens": None}
            rep["in_flight_create_kept"] = pid
        else:
            failures["unknown_pools"].append(pid)
    j.in_flight = None
    rep["pools"] = len(pools)
    rep["resident_at_start"] = sorted(pid for pid, p in pools.items() if p["residency"] == "resident")


def check_answers(rnd: Round, failures: dict, rep: dict) -> None:
    checked = 0
    resident = set(rep.get("resident_at_start", []))
    for pid, ref in sorted(rnd.j.refs.items()):
        if pid not in rnd.j.pools:
            continue
        got = rnd.complete(pid, ref["prompt"])
        checked += pid in resident
        if got != ref["tokens"]:
            failures["wrong_answers"].append({"round": rep.get("round"), "pool": pid, "from_kv_file": pid in resident,
                                              "commit": common.machine_info()["git"], "want": ref["tokens"],
                                              "got": got})
    rep["answers_checked"] = len([p for p in rnd.j.refs if p in rnd.j.pools])
    rep["answers_from_kv_files"] = checked


def main() -> int:
    import httpx

    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model to serve (default: the bundled one)")
    p.add_argument("--rounds", type=int, default=36, help="kills (at least 20 for the committed result)")
    p.add_argument("--min-landed", type=int, default=20,
                   help="kills that must land during a fork or a pinned creation (the run fails with fewer)")
    p.add_argument("--max-live", type=int, default=8, help="live pools at most (the client releases above)")
    p.add_argument("--max-refs", type=int, default=4, help="pinned pools whose answers are checked")
    p.add_argument("--n-predict", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `opencoti serve` argument")
    args = p.parse_args()
    rng = random.Random(args.seed)
    load_before = common.load_snapshot()
    machine = common.machine_info()
    log(common.describe_machine(machine))
    state = Path(tempfile.mkdtemp(prefix="opencoti-crash-"))
    serve = ["--state-dir", str(state), "--max-pools", str(args.max_live + 8), "--page-size", "16",
             "--prefix-cache", "off", *args.serve_arg]
    args.failures = {k: [] for k in ("pools_lost", "pools_changed", "ids_reused", "unknown_pools", "wrong_answers",
                                     "integrity", "start_failures")}
    j = Journal()
    rounds, cut, landed_on = [], Counter(), Counter()
    vocab: list[int] = []
    t_start = time.perf_counter()
    for n in range(args.rounds + 1):  # the last start only checks
        t0 = time.perf_counter()
        try:
            proc, base = start_server(args.model, args.max_live + 8, serve)
        except RuntimeError as e:  # a start that died: a failure of the run (with its exit code), then one retry
            args.failures["start_failures"].append({"round": n, "error": str(e)[:2000]})
            log(f"round {n}: {e}; starting again")
            proc, base = start_server(args.model, args.max_live + 8, serve)
        http = httpx.Client(base_url=base, timeout=600)
        while http.get("/health").status_code != 200:
            time.sleep(0.2)
        rep: dict = {"round": n, "start_s": round(time.perf_counter() - t0, 2)}
        if n == 0 and not any(a.startswith("--weights") for a in serve):
            # every later start serves the format this one chose: an answer checks the KV it was
            # restored from, not a weight format that auto may choose differently at a busy restart
            chosen = http.get("/props").json()["opencoti"]["weights"]["format"]
            serve += ["--weights", chosen]
            rep["weights"] = chosen
        if not vocab:
            vocab = http.post("/tokenize", json={"content": " ".join(SUFFIX_WORDS) * 4}).json()["tokens"]
        rnd = Round(http, j, rng, vocab, args)
        if n:
            verify_restart(http, j, args.failures, rep)
            check_answers(rnd, args.failures, rep)
            integ = http.get("/polykv/integrity").json()
            if not integ.get("ok"):
                args.failures["integrity"].append({"round": n, "report": integ})
        if n == args.rounds:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            rounds.append(rep)
            break
        target = TARGETS[n % len(TARGETS)]
        warm = rng.randrange(0, 4)
        killed = threading.Event()
        landed: list = []
        kill_rng = random.Random(rng.random())  # the killer thread's own (the client's rng stays in step)

        def killer(kind: str) -> None:
            # a request of the target's kind (fork: pinned or not) in flight, then a random fraction
            # of that kind's typical request time after it was sent (that request still unanswered)
            kinds = ("fork", "fork_pinned") if kind == "fork" else (kind,)
            times = sorted(t for k in kinds for t in j.request_s.get(k, []))
            typical = times[len(times) // 2] if times else 0.05
            for _ in range(200):  # a request answered before its instant: the next one is cut instead
                while True:
                    what, t0 = j.request, j.request_t0
                    if what in kinds:
                        break
                    time.sleep(0.0005)
                time.sleep(max(0.0, t0 + kill_rng.uniform(0.0, typical) - time.perf_counter()))
                if j.request == what and j.request_t0 == t0:
                    break
            landed.append(j.request)  # (None: answered before the kill: between requests)
            proc.send_signal(signal.SIGKILL)
            killed.set()

        ops = []
        try:
            for _ in range(warm):
                kind = rnd.pick()
                getattr(rnd, kind)()
                ops.append(kind)
            threading.Thread(target=killer, args=(target,), daemon=True).start()
            while not killed.is_set():  # the target kind again and again until the kill cuts one
                getattr(rnd, target if len(j.pools) < args.max_live or target == "release" else "release")()
                ops.append(target)
        except (httpx.HTTPError, RuntimeError) as e:
            if not killed.is_set():
                killed.wait(timeout=5)
                if not killed.is_set():
                    raise
            rep["cut"] = f"{type(e).__name__}"
        proc.wait()
        http.close()
        in_flight = j.in_flight[0] if j.in_flight else "between operations"
        cut[in_flight] += 1
        hit = landed[0] if landed and landed[0] else "between requests"
        landed_on[hit] += 1
        rep.update({"target": target, "ops": ops, "killed_during": in_flight, "landed": hit,
                    "live_pools": len(j.pools)})
        rounds.append(rep)
        log(f"round {n}: {rep}")
    failures = args.failures
    on_writes = sum(landed_on[k] for k in WRITES)
    summary = {"kills": args.rounds, "killed_during": dict(cut), "landed": dict(landed_on),
               "kills_during_forks_and_pinned_creates": on_writes,
               "request_ms_median": {k: round(1000 * sorted(v)[len(v) // 2], 1) for k, v in sorted(j.request_s.items())},
               "pools_created": len(j.seen),
               "pools_released": len(j.released), "live_pools_at_end": len(j.pools),
               "answers_checked": sum(r.get("answers_checked", 0) for r in rounds),
               "answers_from_kv_files": sum(r.get("answers_from_kv_files", 0) for r in rounds),
               **{k: len(v) for k, v in failures.items()}, "seconds": round(time.perf_counter() - t_start, 1)}
    print_table(["check", "value"], [(k, fmt(v) if not isinstance(v, dict) else str(v)) for k, v in summary.items()],
                title="crash consistency (kill -9 at random instants)")
    ok = not any(failures.values()) and on_writes >= args.min_landed
    if on_writes < args.min_landed:
        log(f"only {on_writes} kills landed during a fork or a pinned creation (--min-landed {args.min_landed})")
    path = common.write_json("crash", {"machine": machine, "load_before": load_before, "args": {
        k: v for k, v in vars(args).items() if k != "failures"}, "summary": summary, "failures": failures,
        "rounds": rounds, "ok": ok}, out=args.out)
    log(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
