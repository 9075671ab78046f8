"""Speculative decoding by prompt lookup, on vs off, and llama.cpp's own n-gram speculation, one run.

Four servers on the bundled SmolLM2-135M Q4_1 GGUF, ``--threads`` threads each: ``opencoti serve``
with ``--speculative off`` and ``--speculative ngram``, ``llama-server`` (``--parallel 8
--kv-unified -c 16384``) without and with ``--spec-type ngram-simple``. Each round starts every
server fresh (cold caches: no workload can reuse another's KV), all four up at once and idle between
their own requests: each request goes to every server in turn, in an order rotated per request, so
the machine's drift in speed hits them alike (runs made before this change ran one server after the
other, a minute or more apart). The opencoti weight format is the one ``auto`` chose at the first
start, pinned for the rest (the greedy outputs of both opencoti modes are compared token for token).

Workloads (OpenAI chat requests, greedy, ``--tokens`` tokens at most, one at a time):

* ``react_echo``: a ReAct turn whose tool observation (a JSON record) is to be quoted back;
* ``json_tools``: a tool-calling agent whose earlier turn issued ``create_user`` calls (JSON objects
  ``{"name": ..., "arguments": {...}}``, one a line) for three of eight listed people, asked for the
  calls of the rest (these weights answer with 160 tokens of such calls; the earlier prompt, "rewrite
  this list as a JSON array", was answered with one 34-token object and measured little);
* ``summarize_quote``: a summarizer asked to quote its input's sentences;
* ``novel``: a short story (nothing to copy);
* ``sessions_8``: 8 sessions at once (the three repetitive prompts and five stories):
  aggregate tok/s = tokens / (last token - first request sent).

Single-session decode tok/s is the server's ``timings.predicted_per_second`` (both servers report
llama.cpp's timings), the median of :data:`REPEATS` requests per round (each with its own nonce in
its first message, so none reuses another's KV; opencoti may draft from the answers of the requests
before it, as it does for any request of the same cache salt: the ``first request`` ratio is of
each workload's first request in a round, which has no earlier answer of its own workload to draft
from), accepted draft tokens from
``timings.draft_n_accepted`` / ``draft_n``. A round's prompts are the same on every server, so the
two opencoti modes' outputs are compared request by request.
Targets: repetitive workloads >= 1.5x off, ``novel`` >= 0.97x, ``sessions_8`` >= 0.97x, outputs
identical. Results: ``benchmarks/results/<machine-id>/speculative.json``.

Run: .venv/bin/python benchmarks/bench_speculative.py [--quick] [--llama-server PATH]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from peer_llamacpp import build_llama_server, parallel, props, sse_events, start  # noqa: E402

SERVERS = {  # name -> (server, extra flags)
    "opencoti-off": ("opencoti", ["--speculative", "off"]),
    "opencoti-ngram": ("opencoti", ["--speculative", "ngram"]),
    "llama.cpp": ("llama.cpp", []),
    "llama.cpp-ngram": ("llama.cpp", ["--spec-type", "ngram-simple"]),
}
PAIRS = {"opencoti": ("opencoti-ngram", "opencoti-off"), "llama.cpp": ("llama.cpp-ngram", "llama.cpp")}
REPETITIVE = ("react_echo", "json_tools", "summarize_quote")
SINGLE = REPETITIVE + ("novel",)
REPEATS = 3  # each single-session workload per round (median)
LABELS = {"react_echo": "ReAct turn quoting its tool observation",  # recorded with each run (the report's rows)
          "json_tools": "tool-calling agent issuing its next JSON calls",
          "summarize_quote": "summarizer quoting its input", "novel": "short story (nothing to copy)",
          "sessions_8": "8 sessions at once, aggregate"}
TARGET = {"react_echo": 1.5, "json_tools": 1.5, "summarize_quote": 1.5, "novel": 0.97, "sessions_8": 0.97}

OBSERVATION = json.dumps({
    "city": "Paris", "country": "France", "temperature_c": 18.5, "feels_like_c": 17.9, "humidity_pct": 62,
    "wind_kph": 14.2, "wind_direction": "south-west", "condition": "partly cloudy", "uv_index": 4,
    "sunrise": "07:42", "sunset": "17:01", "air_quality": "good", "forecast": [
        {"day": "Monday", "high_c": 19, "low_c": 11, "condition": "sunny"},
        {"day": "Tuesday", "high_c": 17, "low_c": 10, "condition": "rain"},
        {"day": "Wednesday", "high_c": 16, "low_c": 9, "condition": "cloudy"}]}, indent=1)
PEOPLE = [("Alice Martin", "engineer"), ("Bruno Costa", "designer"), ("Chloe Dubois", "analyst"),
          ("David Kim", "manager"), ("Emma Rossi", "engineer"), ("Felix Wagner", "writer"),
          ("Grace Okafor", "researcher"), ("Hugo Silva", "engineer")]


def _email(name: str) -> str:
    return ".".join(name.lower().split()) + "@example.com"


def _create_user(name: str, role: str) -> str:
    """One tool call, in the agent's own call format (an OpenAI-style name + arguments object)."""
    return json.dumps({"name": "create_user", "arguments": {"name": name, "role": role, "email": _email(name)}})


ARTICLE = ("The river town grew around a stone bridge built in 1642. Merchants crossed it every morning with "
           "carts of grain and wool. In 1790 a flood destroyed half of the old market, and the town rebuilt it "
           "on higher ground. The new market opened in 1795 with forty stalls and a clock tower. Today the "
           "bridge carries only walkers and cyclists, and the clock tower is a museum of local history.")
EARLIER = json.dumps({"city": "Lyon", "country": "France", "temperature_c": 16.0, "humidity_pct": 70,
                      "condition": "rain"}, indent=1)
PROMPTS = {
    "react_echo": [
        {"role": "system", "content": "You are an agent. After each observation, first repeat the observation "
                                      "exactly as given, then answer the user in one sentence."},
        {"role": "user", "content": "What is the weather in Lyon?"},
        {"role": "assistant", "content": "Action: get_weather(city=\"Lyon\")"},
        {"role": "user", "content": f"Observation:\n{EARLIER}"},
        {"role": "assistant", "content": f"Observation:\n{EARLIER}\nIt is raining in Lyon, 16 C."},
        {"role": "user", "content": "And in Paris this week?"},
        {"role": "assistant", "content": "Action: get_weather(city=\"Paris\")"},
        {"role": "user", "content": f"Observation:\n{OBSERVATION}"}],
    # a tool-calling agent mid-task: its earlier turn issued three create_user calls (one JSON object a
    # line); asked for the calls of the remaining people, the model writes more calls of the same shape.
    # This replaced a "rewrite this list as a JSON array" prompt, which these weights answer with one
    # 34-token object: not JSON-heavy, so it did not measure the workload the issue names. The prompt was
    # chosen by its greedy output with speculation off only: for every nonce of three rounds, 160 tokens,
    # four create_user calls, one a line (some of their roles and emails are wrong: these weights are
    # small; this is a speed workload, and both modes must write the same calls).
    "json_tools": [
        {"role": "system", "content": "You are a tool-calling agent. To call a tool, write one JSON object per "
                                      "line: {\"name\": <tool>, \"arguments\": {...}}. Tools: "
                                      "create_user(name, role, email)."},
        {"role": "user", "content": "Create an account for each of these people:\n" + "\n".join(
            f"- {n}, {r}, {_email(n)}" for n, r in PEOPLE)},
        {"role": "assistant", "content": "\n".join(_create_user(n, r) for n, r in PEOPLE[:3])},
        {"role": "user", "content": "Tool results: 3 users created. Now issue the calls for the remaining "
                                    "people, one per line."}],
    "summarize_quote": [
        {"role": "system", "content": "You are a careful editor. When asked to quote, copy sentences word for "
                                      "word."},
        {"role": "user", "content": f"Text:\n{ARTICLE}\n\nQuote every sentence of the text that contains a "
                                    "year, word for word, one per line, then summarize the text in one line."}],
    "novel": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message "
                                          "in a bottle."}],
}
STORIES = ["a lighthouse keeper", "a clockmaker's apprentice", "a lost cat in Tokyo", "a chess game on a train",
           "the last bakery on the moon"]


def chat(url: str, messages: list, tokens: int, nonce: str) -> dict:
    """One streamed greedy chat request: its text, timings and client-side times."""
    messages = [{**messages[0], "content": f"[{nonce}] {messages[0]['content']}"}] + messages[1:]
    body = {"model": "m", "messages": messages, "stream": True,
            "max_tokens": tokens, "temperature": 0}
    t_send, first, last, text, timings = time.perf_counter(), None, None, [], None
    for ev in sse_events(url, "/v1/chat/completions", body):
        delta = ((ev.get("choices") or [{}])[0].get("delta") or {}).get("content")
        if delta:
            now = time.perf_counter()
            first, last = first or now, now
            text.append(delta)
        timings = ev.get("timings") or timings
    return {"text": "".join(text), "timings": timings or {}, "sent": t_send, "first": first, "last": last}


def run_round(urls: dict[str, str], tokens: int, nonce: str) -> dict[str, dict]:
    """One round on every server at once (all started fresh and idle between their requests): each
    request is sent to every server in turn, the order rotated per request, so a drift in the
    machine's speed hits all servers alike (one server after the other, minutes apart, it did not)."""
    names = list(urls)
    out: dict[str, dict] = {n: {} for n in names}
    for n in names:
        chat(urls[n], PROMPTS["novel"], 8, nonce + "-warmup")  # lazily built buffers, page faults
    k = 0
    for w in SINGLE:
        runs: dict[str, list] = {n: [] for n in names}
        for i in range(REPEATS):  # new prompts: no cache; the same prompt on every server
            for n in common.rotated(names, k):
                runs[n].append(chat(urls[n], PROMPTS[w], tokens, f"{nonce}-{w}-{i}"))
            k += 1
        for n in names:
            t = [r["timings"] for r in runs[n]]
            each = [x.get("predicted_per_second") or 0.0 for x in t]
            out[n][w] = {"tps": statistics.median(each), "tps_each": each,
                         "n": t[0].get("predicted_n"), "draft_n": sum(x.get("draft_n") or 0 for x in t),
                         "draft_n_accepted": sum(x.get("draft_n_accepted") or 0 for x in t),
                         "texts": [r["text"] for r in runs[n]]}
    prompts = [PROMPTS[w] for w in REPETITIVE] + [[{"role": "user", "content": f"Write a short story about {s}."}]
                                                  for s in STORIES]
    for n in common.rotated(names, k):
        res = parallel(8, lambda i: chat(urls[n], prompts[i], tokens, f"{nonce}-s8-{i}"))
        total = sum(r["timings"].get("predicted_n") or 0 for r in res)
        out[n]["sessions_8"] = {"tps": total / (max(r["last"] for r in res) - min(r["sent"] for r in res)),
                                "n": total, "texts": [r["text"] for r in res]}
    return out


def main() -> int:
    p = common.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=160, help="tokens per request at most")
    p.add_argument("--llama-server", default=None, help="a llama-server binary (default: build and cache one)")
    p.add_argument("--only", default=None, choices=["opencoti", "llama.cpp"], help="one server kind only")
    args = p.parse_args()
    if args.quick:
        args.rounds = 1
    from opencoti.engine.model.loader import bundled_gguf_path
    from opencoti.engine.model.threads import usable_cpus

    gguf = str(bundled_gguf_path())
    threads = args.threads or usable_cpus()
    names = [n for n, (kind, _) in SERVERS.items() if args.only in (None, kind)]
    llama_bin = None
    if any(SERVERS[n][0] == "llama.cpp" for n in names):
        llama_bin = Path(args.llama_server) if args.llama_server else build_llama_server()
    before = common.load_snapshot()
    raw: dict[str, list] = {n: [] for n in names}
    info: dict[str, dict] = {}
    weights: list[str] = []
    for rnd in range(args.rounds):
        order = common.rotated(names, rnd)
        servers = {}
        try:
            for name in order:  # every server of the round up at once, fresh
                kind, extra = SERVERS[name]
                if kind == "opencoti" and weights:
                    extra = extra + ["--weights", weights[0]]
                srv = servers[name] = start(kind, gguf, threads, llama_bin, extra)
                ready = srv.wait_ready()
                if kind == "opencoti" and not weights:
                    weights.append(props(srv.url).get("weights") or "auto")
                info.setdefault(name, props(srv.url))
                info[name]["ready_s"] = ready  # the last round's; each round's is in raw
            res = run_round({n: servers[n].url for n in order}, args.tokens, f"r{rnd}")  # the same prompts on each
            for name in order:
                res[name]["ready_s"] = info[name]["ready_s"]  # this round's start
                raw[name].append(res[name])
                common.log(f"round {rnd + 1}: {name}: " + ", ".join(
                    f"{w} {res[name][w]['tps']:.1f}" for w in SINGLE + ("sessions_8",)))
        finally:
            for srv in servers.values():
                srv.stop()
    med = {n: {w: statistics.median(r[w]["tps"] for r in raw[n]) for w in SINGLE + ("sessions_8",)} for n in names}
    # the first request of each workload in a round: no earlier answer of its own workload to draft from
    first = {n: {w: statistics.median(r[w]["tps_each"][0] for r in raw[n]) for w in SINGLE} for n in names}
    acc = {n: {w: [(r[w]["draft_n_accepted"], r[w]["draft_n"]) for r in raw[n]] for w in SINGLE} for n in names}
    same = None
    if {"opencoti-off", "opencoti-ngram"} <= set(names):
        pairs = list(zip(raw["opencoti-off"], raw["opencoti-ngram"]))  # the same round: the same prompts
        same = {w: all(a[w]["texts"] == b[w]["texts"] for a, b in pairs) for w in SINGLE}
        same["sessions_8"] = all(a["sessions_8"]["texts"] == b["sessions_8"]["texts"] for a, b in pairs)
    rows, ratios = [], {}
    for kind, (on, off) in PAIRS.items():
        if on not in med:
            continue
        for w in SINGLE + ("sessions_8",):
            r = common.ratio(med[on][w], med[off][w])
            ratios.setdefault(kind, {})[w] = r
            a = [x for x in acc[on].get(w, []) if x[1]]
            rate = sum(x[0] for x in a) / sum(x[1] for x in a) if a else None
            r1 = common.ratio(first[on][w], first[off][w]) if w in first[on] else None
            if r1 is not None:
                ratios.setdefault(kind + "_first", {})[w] = r1
            rows.append([kind, w, med[off][w], med[on][w], r, r1, rate,
                         common.check_mark(r, TARGET[w]) if kind == "opencoti" else "-"])
    common.print_table(["server", "workload", "tok/s off", "tok/s ngram", "ngram/off", "first request ngram/off",
                        "draft acceptance", "target"], rows, title=f"prompt-lookup speculative decoding, {args.rounds} round(s), "
                                               f"{threads} threads, medians")
    if "opencoti-ngram" in med and "llama.cpp-ngram" in med:
        peer = {w: common.ratio(med["opencoti-ngram"][w], med["llama.cpp-ngram"][w]) for w in med["opencoti-ngram"]}
        common.print_table(["workload", "opencoti ngram", "llama.cpp ngram", "ours / theirs"],
                           [[w, med["opencoti-ngram"][w], med["llama.cpp-ngram"][w], peer[w]] for w in peer])
        ratios["vs_llama_cpp_ngram"] = peer
    print(f"identical greedy outputs (opencoti ngram vs off): {same}")
    machine = common.machine_info()
    print(common.describe_machine(machine))
    path = common.write_json("speculative", {
        "config": {"workloads": LABELS, "interleaved": True, "rounds": args.rounds, "tokens": args.tokens, "threads": threads,
                   "gguf": Path(gguf).name,
                   "servers": {n: SERVERS[n] for n in names}, "opencoti_weights": weights[:1], "quick": args.quick},
        "servers": info, "raw": raw, "median": med, "first_request": first, "ratio": ratios, "identical_outputs": same,
        "machine": machine, "load_before": before}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
