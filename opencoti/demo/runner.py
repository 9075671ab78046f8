"""``run_demo``: build the engine (or connect to ``--server``), run the scenario graph with the
recorder sampling and a live view, then write the report.

    from opencoti.demo import DemoConfig, run_demo
    result = run_demo(DemoConfig(agents=6, out="demo-report"))      # in-process, bundled model
    result = run_demo(DemoConfig(server="http://127.0.0.1:8080"))   # the same graph over HTTP

The scenario itself is in ``scenario.py``; every number in the report comes from ``recorder.py``.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from ..client import PolyKVClient
from ..engine.errors import CapacityError, OpencotiError
from ..langgraph import OpencotiChatModel
from .config import DemoConfig, DemoResult, auto_max_context
from .hooks import RequestLog
from .recorder import Recorder
from .report import build_report, summarize
from .scenario import Scenario


# ============================================================================ running it
def _wait_for_server(client: PolyKVClient, view, timeout_s: float = 900.0) -> None:
    t0 = time.monotonic()
    last = ""
    while True:
        try:
            client.health()
            return
        except CapacityError as e:  # 503 while the server loads its model
            msg = f"the server is loading its model ({time.monotonic() - t0:.0f} s)"
            if msg != last:
                view.progress(msg)
                last = msg
            if time.monotonic() - t0 > timeout_s:
                raise OpencotiError(f"the server at {client.base_url} did not finish loading in {timeout_s:.0f} s") from e
            time.sleep(1.0)


def run_demo(cfg: DemoConfig, *, view=None, engine=None) -> DemoResult:
    """Run the scenario and write the report. ``engine``: use this in-process engine (it is left
    running) instead of building one; ``view``: a ``live.make_view()`` view (default: chosen from stdout)."""
    from .live import make_view

    if cfg.agents < 2:
        raise ValueError("--agents must be at least 2 (the first sub-agent is the coordinator)")
    if cfg.floor is not None and cfg.floor <= 0:
        raise ValueError("--floor must be a positive number of tokens/s")
    if not 4 <= cfg.max_tokens <= 256:
        raise ValueError("--max-tokens must be in [4, 256] (the demo's agents give short answers)")
    view = view or make_view()
    t_start = time.time()
    own_engine = None
    load_s = 0.0
    if cfg.server:
        client = PolyKVClient(base_url=cfg.server, api_key=cfg.api_key, timeout=600.0, max_retries=3)
        rec_client = PolyKVClient(base_url=cfg.server, api_key=cfg.api_key, timeout=60.0, max_retries=1)
        with view.loading():
            _wait_for_server(client, view)
        model = OpencotiChatModel(base_url=cfg.server, api_key=cfg.api_key, timeout=600.0, max_retries=3)
        transport = f"opencoti serve at {cfg.server}"
        device = None
    else:
        if engine is None:
            from ..engine import Engine, EngineConfig
            t = time.perf_counter()
            with view.loading():
                own_engine = engine = Engine(EngineConfig(
                    model=cfg.model, page_size=cfg.page_size,
                    max_context=cfg.max_context or auto_max_context(cfg.max_tokens),
                    kv_budget_tokens=cfg.kv_budget_tokens, num_threads=cfg.num_threads, weights=cfg.weights,
                    seed=cfg.seed if cfg.seed is not None else 0), progress=view.progress)
            load_s = time.perf_counter() - t
        client = PolyKVClient(engine=engine)
        rec_client = PolyKVClient(engine=engine)
        model = OpencotiChatModel(engine=engine)
        transport = "an in-process engine"
        device = f"{engine.device.type}, {type(engine.backend).__name__}"
    cleanup = cfg.cleanup if cfg.cleanup is not None else bool(cfg.server)
    scenario = None
    try:
        rec = Recorder(rec_client, interval_s=cfg.interval_s)
        model_name = client.model_name()
        ctx_total = engine.max_context if engine is not None else _server_ctx(client)
        rec.info.update(model=model_name, transport=transport, device=device, ctx_total=ctx_total, load_s=load_s)
        view.set_floor(cfg.floor)
        scenario = Scenario(cfg, client, model, rec, ctx_total, on_floor=view.set_floor)
        graph = scenario.graph()
        rec.start()
        view.start(rec, f"opencoti demo · {model_name} · {transport}")
        try:
            final_state = graph.invoke({}, config={"callbacks": [RequestLog(rec)], "recursion_limit": 1000,
                                                   "max_concurrency": 64})
            rec.phase("done", "the lead agent answered; the report is being written")
        except BaseException as e:
            rec.note(f"the run failed: {type(e).__name__}: {e}")
            raise
        finally:
            rec.stop()
            view.stop()
        # the pool status of the recorder's final sample: the report's final KV and this are one answer
        final = {"pools": rec.last_status or client.pools().model_dump(), "tps": client.tps().model_dump()}
        if engine is not None:
            final["counters"] = engine.metrics_counters()
            final["stats"] = engine.stats()
            engine.check_integrity()
            final["integrity"] = "ok"
        run = rec.snapshot()
        cfg_d = asdict(cfg)
        cfg_d.update(floor=scenario.floor, floor_source=scenario.floor_source,
                     compact_threshold=scenario.compact_threshold)
        run.update(config=cfg_d, final=final, outputs={
            "answer": final_state.get("answer"), "brief": final_state.get("brief"),
            "agents": {r["agent"]: r["text"] for r in sorted(final_state.get("results") or [],
                                                              key=lambda r: r["agent"])}})
        try:
            run["graph_mermaid"] = graph.get_graph(xray=1).draw_mermaid()
        except Exception:  # noqa: BLE001 - drawing is a nicety
            run["graph_mermaid"] = None
        paths = build_report(run, cfg.out, charts=cfg.charts)
        return DemoResult(run=run, summary=summarize(run), paths=paths, wall_s=time.time() - t_start,
                          load_s=load_s, errors=list(run.get("errors") or []))
    finally:
        if cleanup and scenario is not None:
            _cleanup(client, scenario)
        if own_engine is not None:
            own_engine.shutdown()


def _server_ctx(client: PolyKVClient) -> int:
    try:
        return int(client._call("props")["default_generation_settings"]["n_ctx"])
    except Exception:  # noqa: BLE001
        return 8192


def _cleanup(client: PolyKVClient, scenario: Scenario) -> None:
    """Release what the demo made on a shared server (sessions, then pools leaves first)."""
    for sid in scenario.sessions_made:
        try:
            client.release_session(sid)
        except OpencotiError:
            pass
    for pid in reversed(scenario.pools_made):
        try:
            client.flush_pool(pid)
            client.release_pool(pid)
        except OpencotiError:
            pass
