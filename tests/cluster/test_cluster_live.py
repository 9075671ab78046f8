"""``opencoti cluster``: two replicas of the bundled model (one CPU thread each) on a local Ray
Serve instance. Needs the ``cluster`` extra (``pip install -e '.[cluster]'``); skipped without it.

Placement is checked from each replica's own engine counters (GET /cluster/replicas), not from
what the router believes.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve", reason="needs the cluster extra (Ray Serve): pip install -e '.[cluster]'")

pytestmark = [pytest.mark.cluster, pytest.mark.bundled, pytest.mark.timeout(900)]

MODEL = os.environ.get("OPENCOTI_CLUSTER_TEST_MODEL")  # default: the bundled model
MAX_POOLS = 8  # each replica's pool budget
SYSTEMS = [
    "You are the planner of a research team. Break every task into small numbered steps, name the agent "
    "that owns each step, and keep a short list of open questions at the end of each answer. " * 3,
    "You are a code reviewer. Read the diff, list correctness problems first, then style problems, and "
    "suggest a minimal fix for each problem you find. Never rewrite the whole file. " * 3,
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve

    from opencoti.cluster.app import ClusterConfig, make_app
    from opencoti.cluster.serve import start_local_ray

    start_local_ray(num_cpus=2, object_store_mib=128)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = {"kv_budget_tokens": 4096, "max_pools": MAX_POOLS}
        if MODEL:
            engine["model"] = MODEL
        serve.run(make_app(ClusterConfig(replicas=2, cpus_per_replica=1, engine=engine)),
                  name="opencoti", route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            assert c.get("/health").json()["replicas_ok"] == 2
            yield c
    finally:
        serve.shutdown()
        ray.shutdown()


def replicas(c) -> dict[int, dict]:
    return {r["tag"]: r for r in c.get("/cluster/replicas").json()["replicas"]}


def requests_by_replica(c) -> dict[int, int]:
    return {t: r["counters"]["requests"] for t, r in replicas(c).items()}


def delta(before: dict, after: dict) -> dict[int, int]:
    return {t: after.get(t, 0) - before.get(t, 0) for t in after}


def chat(c, system: str, user: str, **kw):
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 4, "temperature": 0, **kw}
    return c.post("/v1/chat/completions", json=body)


def test_pool_and_session_affinity(cluster):
    c = cluster
    pools = []
    for s in SYSTEMS:
        r = c.post("/polykv/pools", json={"messages": [{"role": "system", "content": s}]})
        assert r.status_code == 200, r.text
        pools.append(r.json())
    holder = {p["pool_id"]: int(r) for p in pools for r in [c.get(f"/polykv/pools/{p['pool_id']}").headers
                                                            ["x-opencoti-replica"]]}
    # two pools created one after the other land on different replicas, and their ids say which
    assert len(set(holder.values())) == 2
    from opencoti.cluster.ids import tag_of
    for pid, t in holder.items():
        assert tag_of(pid) == t and pid in replicas(c)[t]["pools"]

    before = requests_by_replica(c)
    for i in range(3):
        for p, s in zip(pools, SYSTEMS):
            r = chat(c, s, f"step {i}", pool_id=p["pool_id"], session_id=f"agent-{p['pool_id']}-{i}")
            assert r.status_code == 200, r.text
            assert int(r.headers["x-cached-prefix-tokens"]) >= p["prefix_len"]
    d = delta(before, requests_by_replica(c))
    assert d == {holder[p["pool_id"]]: 3 for p in pools}

    # a session named without its pool still goes to the replica that holds it
    before = requests_by_replica(c)
    p0 = pools[0]
    r = chat(c, SYSTEMS[0], "step 0 again", session_id=f"agent-{p0['pool_id']}-0")
    assert r.status_code == 200, r.text
    assert delta(before, requests_by_replica(c))[holder[p0["pool_id"]]] == 1
    # pool operations reach the pool's replica
    assert c.post(f"/polykv/pools/{p0['pool_id']}/pin").json()["pinned"] is True
    assert c.get(f"/polykv/pools/{p0['pool_id']}/capacity").json()["can_admit"] in (True, False)
    merged = c.get("/polykv/pools").json()
    assert {p["pool_id"]: p["replica"] for p in merged["pools"]} == holder
    tps = c.get("/polykv/tps", params={"once": 1}).json()
    assert {s["replica"] for s in tps["sessions"]} == set(holder.values())
    metrics = c.get("/metrics").text
    assert 'replica="1"' in metrics and 'replica="2"' in metrics


def test_clients_work_unchanged(cluster):
    """The chat model of opencoti.langgraph and the merged SSE stream, against the cluster."""
    from opencoti.langgraph import OpencotiChatModel

    c = cluster
    pid = c.post("/polykv/pools", json={"messages": [{"role": "system", "content": "Be brief."}]}).json()["pool_id"]
    model = OpencotiChatModel(base_url=str(c.base_url), temperature=0, max_tokens=4)
    msg = model.invoke([("system", "Be brief."), ("human", "Hi!")], pool_id=pid, session_id="lc-1")
    assert isinstance(msg.content, str)
    msg = model.invoke([("system", "Be brief."), ("human", "Hi!"), ("ai", msg.content), ("human", "And?")],
                       pool_id=pid, session_id="lc-1")
    assert isinstance(msg.content, str)
    with c.stream("GET", "/polykv/tps", params={"count": 2, "interval_ms": 100}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and len(events) == 2
    assert c.delete(f"/polykv/pools/{pid}").status_code == 200


def test_prefix_affinity_for_plain_requests(cluster):
    c = cluster
    systems = [f"You answer in {lang}, in one short sentence, and never use lists or headings. " * 6
               for lang in ("French", "German", "Spanish", "Italian")]
    seen: dict[int, set] = {k: set() for k in range(len(systems))}
    before = requests_by_replica(c)

    def ask(k: int, i: int) -> None:
        r = chat(c, systems[k], f"question {i}")
        assert r.status_code == 200, r.text
        seen[k].add(int(r.headers["x-opencoti-replica"]))

    # the first round arrives at once (the least loaded replica takes each new prompt), the
    # next rounds one request at a time (each follows its prompt's cached prefix)
    first = [threading.Thread(target=ask, args=(k, 0)) for k in range(len(systems))]
    for t in first:
        t.start()
    for t in first:
        t.join()
    for i in (1, 2):
        for k in range(len(systems)):
            ask(k, i)
    # every request with the same system prompt went to one replica; new prompts spread
    assert all(len(v) == 1 for v in seen.values()), seen
    home = {k: next(iter(v)) for k, v in seen.items()}
    assert len(set(home.values())) == 2, home
    d = delta(before, requests_by_replica(c))
    assert d == {t: 3 * sum(1 for h in home.values() if h == t) for t in d}, (d, home)


def test_replication_spreads_attaches(cluster):
    c = cluster
    r = c.post("/polykv/pools", json={"text": "Shared context for a hot pool. " * 20})
    pid = r.json()["pool_id"]
    primary = int(c.get(f"/polykv/pools/{pid}").headers["x-opencoti-replica"])
    other = 3 - primary if primary in (1, 2) else min(t for t in replicas(c) if t != primary)

    assert c.post("/polykv/pools/999/replicate").status_code == 404
    assert c.post(f"/polykv/pools/{pid}/replicate", json={"replica": 99}).status_code == 400
    assert c.post(f"/polykv/pools/{pid}/replicate", json={"replica": "x"}).status_code == 400
    r = c.post(f"/polykv/pools/{pid}/replicate")
    assert r.status_code == 200, r.text
    copies = {x["replica"]: x["pool_id"] for x in r.json()["copies"]}
    assert copies[primary] == pid and other in copies and copies[other] != pid
    assert c.post(f"/polykv/pools/{pid}/replicate").status_code == 409  # every replica holds it
    assert pid in replicas(c)[primary]["pools"] and copies[other] in replicas(c)[other]["pools"]
    view = c.get(f"/polykv/pools/{pid}").json()
    assert {x["replica"] for x in view["copies"]} == {primary, other}
    cap = c.get(f"/polykv/pools/{pid}/capacity").json()
    assert cap["pool_id"] == pid and len(cap["copies"]) == 2

    before = requests_by_replica(c)
    out = []

    def attach(i):
        out.append(c.post("/completion", json={"prompt": "Shared context for a hot pool. " * 20 + f"task {i}",
                                               "pool_id": pid, "n_predict": 12, "temperature": 0}))

    threads = [threading.Thread(target=attach, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in out), [r.text for r in out]
    d = delta(before, requests_by_replica(c))
    assert d[primary] >= 1 and d[other] >= 1 and d[primary] + d[other] == 6
    assert all(int(r.headers["x-cached-prefix-tokens"]) > 0 for r in out)

    # releasing the logical pool releases its copies
    assert c.delete(f"/polykv/pools/{pid}", params={"immediate": "true"}).status_code == 200  # not after the grace TTL
    assert copies[other] not in replicas(c)[other]["pools"]
    assert c.get(f"/polykv/pools/{pid}").status_code == 404


def test_automatic_replication_when_capacity_says_no(cluster):
    c = cluster
    prompt = "Automatic copies. " * 30
    pid = c.post("/polykv/pools", json={"text": prompt}).json()["pool_id"]
    primary = int(c.get(f"/polykv/pools/{pid}").headers["x-opencoti-replica"])
    # one session decoding, and a floor no second session can meet: the pool's replica says no
    policy = {"mode": "enforced", "on_saturation": "reject", "target_tps_per_session": 1e6,
              "guarantee_min_sessions": 1, "settle_tokens": 4, "settle_max_ms": 500}
    assert c.post(f"/polykv/pools/{pid}/admission", json=policy).status_code == 200
    busy = threading.Thread(target=lambda: c.post("/completion", json={
        "prompt": prompt + "long answer", "pool_id": pid, "session_id": "auto-a", "n_predict": 160,
        "ignore_eos": True}))
    busy.start()
    try:
        deadline = time.monotonic() + 120
        while c.get(f"/polykv/pools/{pid}/capacity").json()["can_admit"] and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not c.get(f"/polykv/pools/{pid}/capacity").json()["can_admit"]
        # a new session: refused by the pool's replica, so the pool is copied and the request served there
        r = c.post("/completion", json={"prompt": prompt + "short", "pool_id": pid, "session_id": "auto-b",
                                        "n_predict": 2})
        assert r.status_code == 200, r.text
        other = int(r.headers["x-opencoti-replica"])
        assert other != primary
        copies = {x["replica"]: x["pool_id"] for x in c.get(f"/polykv/pools/{pid}").json()["copies"]}
        assert set(copies) == {primary, other} and r.headers["x-pool-id"] == str(copies[other])
        assert c.get(f"/polykv/pools/{copies[other]}/admission").json()["target_tps_per_session"] == 1e6
        # the session stays on the copy it started on
        r = c.post("/completion", json={"prompt": prompt + "short, again", "pool_id": pid, "session_id": "auto-b",
                                        "n_predict": 2})
        assert r.status_code == 200 and int(r.headers["x-opencoti-replica"]) == other
    finally:
        busy.join()
    assert c.delete(f"/polykv/pools/{pid}").status_code == 200


def test_a_new_pool_goes_to_a_replica_with_room(cluster):
    """A replica whose pool budget is full refuses a new pool (503); the cluster then creates it on
    a replica with room, and answers 503 only when every replica is full. The pools share a long
    text, so the router sends each to the replica that holds that text (prefix affinity): that
    replica fills first, and the rest must be created on the other."""
    c = cluster
    shared = "Room test. " + SYSTEMS[0][:200]
    made = []
    try:
        for i in range(2 * MAX_POOLS + 1):
            r = c.post("/polykv/pools", json={"text": f"{shared} Pool {i}."})
            if r.status_code != 200:
                break
            made.append(r.json()["pool_id"])
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error", r.text
        held = {t: len(info["pools"]) for t, info in replicas(c).items()}
        assert held == {t: MAX_POOLS for t in held}, (held, r.text)  # refused only when both were full
        on = {t: sum(p in info["pools"] for p in made) for t, info in replicas(c).items()}
        assert all(n > 0 for n in on.values()), on
    finally:
        for pid in made:
            c.delete(f"/polykv/pools/{pid}", params={"immediate": "true"})
    assert all(len(info["pools"]) < MAX_POOLS for info in replicas(c).values())


def test_replica_killed_mid_run(cluster):
    c = cluster
    # a pool on each replica. Where a new pool lands depends on what the earlier tests left on each
    # replica (between idle replicas the router prefers the one with less cached prefix text), so
    # while the replicas holding a pool are kept busy the next pool is created: the router places it
    # on a replica with fewer requests in flight (placement itself is tested above)
    texts = {}
    pools, extra, busy = {}, [], []
    for i in range(4):
        text = f"Kill test {i}. " + SYSTEMS[i % 2]
        r = c.post("/polykv/pools", json={"text": text})
        assert r.status_code == 200, r.text
        pid = r.json()["pool_id"]
        texts[pid] = text
        tag = int(c.get(f"/polykv/pools/{pid}").headers["x-opencoti-replica"])
        if tag in pools:
            extra.append(pid)
        else:
            pools[tag] = pid
        if len(pools) == 2:
            break
        for held in pools.values():
            busy.append(threading.Thread(target=c.post, args=("/completion",), kwargs={"json": {
                "prompt": texts[held] + " busy", "pool_id": held, "n_predict": 96, "ignore_eos": True}}))
            busy[-1].start()
        time.sleep(0.5)
    for t in busy:
        t.join()
    assert len(pools) == 2, f"the new pools all landed on replica {list(pools)}"
    for pid in extra:
        assert c.delete(f"/polykv/pools/{pid}", params={"immediate": "true"}).status_code == 200
    victim, survivor = sorted(pools)
    lost, kept = pools[victim], pools[survivor]
    old_tags = set(replicas(c))
    results: list[tuple[float, int]] = []
    stop = threading.Event()

    def traffic():  # requests on the surviving replica's pool, before, during and after the kill
        while not stop.is_set():
            r = c.post("/completion", json={"prompt": texts[kept] + " go", "pool_id": kept, "n_predict": 2})
            results.append((time.monotonic(), r.status_code))

    th = threading.Thread(target=traffic)
    th.start()
    time.sleep(2)
    os.kill(replicas(c)[victim]["pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    deadline = t_kill + 300  # the new replica loads the model again (slow on a busy machine)
    status = None
    while time.monotonic() < deadline:
        r = c.post("/completion", json={"prompt": "x", "pool_id": lost, "n_predict": 1})
        status = r.status_code
        if status == 410:
            assert r.json()["error"]["type"] == "pool_lost_error"
            break
        assert status in (503, 500), r.text  # while Ray notices, the dead replica's answer is 503
        time.sleep(0.5)
    assert status == 410
    # Ray restarts the replica: a new tag, and the endpoint serves both again
    while time.monotonic() < deadline and not (len(replicas(c)) == 2 and set(replicas(c)) - old_tags):
        time.sleep(1)
    stop.set()
    th.join()
    assert len(replicas(c)) == 2 and set(replicas(c)) - old_tags
    assert c.post("/completion", json={"prompt": "x", "pool_id": lost, "n_predict": 1}).status_code == 410
    assert c.get(f"/polykv/pools/{lost}").status_code == 410
    assert c.get("/polykv/pools/12345").status_code == 404  # never existed: 404, not 410
    ok = [s for _, s in results]
    assert ok and all(s == 200 for s in ok), ok  # the survivor's pool never failed
    assert chat(c, "fresh", "after the restart").status_code == 200
