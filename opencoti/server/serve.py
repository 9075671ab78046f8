"""``opencoti serve``: one Engine behind the HTTP API, run by uvicorn.

The socket opens at once; the model loads in the background (``/health`` answers 503 until it is
ready). A start-up that fails (the model, the state directory) ends the process with exit status 1
and the reason on stderr. SIGINT/SIGTERM shut down gracefully: no new connections, live tps streams end, in-flight
generations get ``--graceful-timeout`` seconds to finish (a stream still open then ends with an
SSE error event and its request is cancelled), the engine stops, and the process exits with 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


SWITCH_INTERVAL_S = 0.001  # sys.setswitchinterval for the server process (see run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..engine.config import KV_DTYPES, SPECULATIVE_MODES, EngineConfig

    p.add_argument("--model", "-m", default=None, help="HF model dir, .gguf path or tiny:<arch> "
                                                     "(default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any free port)")
    p.add_argument("--api-key", default=os.environ.get("OPENCOTI_API_KEY"),
                   help="require this key (Authorization: Bearer / X-Api-Key) on every route but /health "
                        "(default: $OPENCOTI_API_KEY)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-budget-tokens", type=int, default=None, help="KV cache size in tokens")
    kv.add_argument("--kv-budget-mib", type=float, default=None, help="KV cache size in MiB")
    p.add_argument("--max-pools", type=int, default=16, help="pool budget (default 16)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--parallel", "-np", type=int, default=64, help="sessions decoding at once (default 64)")
    p.add_argument("--ctx-size", "-c", type=int, default=None, help="context length per sequence (default: the model's)")
    p.add_argument("--batch-tokens", type=int, default=512, help="tokens computed per step at most (default 512)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="torch CPU threads (default: adapted at run time to the cores the engine gets)")
    p.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"],
                   help="projection weight format (default auto: the fastest that passes the accuracy gate)")
    p.add_argument("--kv-dtype", default="auto", choices=list(KV_DTYPES),
                   help="what the KV pages hold (16-bit: twice the tokens in the same --kv-budget-mib; q8: int8 "
                        "values and a scale per head vector, about 3.8x; attention computes in fp32; default auto: "
                        "fp16 under fp32 activations, else the activations' dtype)")
    p.add_argument("--pool-grace-ttl", type=float, default=30.0, help="seconds an interior pool stays pinned after "
                                                                      "its last descendant leaves (default 30)")
    p.add_argument("--prefix-cache", default="on", choices=["on", "off"],
                   help="reuse any cached prompt prefix automatically, for requests without a pool or a session "
                        "id too (default on)")

    spec_default = EngineConfig.__dataclass_fields__["speculative"].default
    p.add_argument("--speculative", "--spec-type", default=spec_default, choices=list(SPECULATIVE_MODES),
                   help="speculative decoding: ngram = drafts looked up in each session's own context, verified "
                        f"in one step (outputs unchanged); a request's speculative.n_max overrides (default {spec_default})")
    p.add_argument("--draft-max", "--draft", "--draft-n", type=int,
                   default=EngineConfig.__dataclass_fields__["speculative_max"].default,
                   help="draft tokens verified per step at most (default %(default)s)")
    p.add_argument("--session-ttl", type=float, default=300.0,
                   help="seconds an idle session created without a session_id lives on (default 300)")
    p.add_argument("--n-predict", "-n", type=int, default=-1,
                   help="default max tokens when a request gives none (-1 = until EOS / context)")
    p.add_argument("--alias", default=None, help="model id reported by /v1/models")
    p.add_argument("--seed", "-s", type=int, default=-1,
                   help="the sampling seed of every request that gives none, as llama.cpp: the same request "
                        "gives the same answer (-1 = a fresh seed per request)")
    p.add_argument("--tps-interval-ms", type=float, default=500.0, help="GET /polykv/tps SSE period (default 500)")
    p.add_argument("--max-body-mib", type=float, default=16.0, help="request body limit (default 16 MiB)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow CORS from ORIGIN (repeatable; '*' for any). Off by default")
    p.add_argument("--graceful-timeout", type=float, default=5.0,
                   help="seconds in-flight requests get to finish on shutdown (default 5)")
    p.add_argument("--state-dir", default=None, metavar="DIR|none",
                   help="where pools, named sessions and pool ids persist across restarts (default: "
                        "$OPENCOTI_STATE_DIR, else state/port-<port> under the cache dir; none with --port 0; "
                        "'none': keep nothing). See docs/persistence.md")
    p.add_argument("--session-kv-budget-mib", type=float, default=1024.0, metavar="MIB",
                   help="disk the named sessions' KV may use in the state directory, so that a session's next "
                        "turn after a restart reads its cache (least recently written dropped first; 0: off; "
                        "default 1024)")
    p.add_argument("--kv-disk-budget-mib", type=float, default=None, metavar="MIB",
                   help="disk the KV tier may use: KV pages reclaimed from RAM (idle sessions', pools', the prefix "
                        "cache's) are written there and read back instead of recomputed (0: off, reclaimed KV is "
                        "recomputed; default: on where a state directory exists, 4096 MiB capped at half the disk "
                        "space free at start). See docs/persistence.md")
    p.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="where the KV tier's files go (default: kv_tier/ in the state directory; emptied at start)")
    p.add_argument("--kv-disk-write-share", type=float, default=0.03, metavar="F",
                   help="the KV tier writes between decode steps, at most this share of their time (at the disk's "
                        "speed while nothing computes); 0: unpaced, beside the steps (default 0.03, measured on CPU: "
                        "docs/persistence.md)")
    p.add_argument("--kv-disk-write-ahead", choices=("on", "off"), default="on",
                   help="write idle sessions' KV to the KV tier ahead of the reclaim that takes it (while nothing "
                        "computes, and within the write share between steps), so that the reclaim frees their "
                        "pages without a copy on the step thread (default on). See docs/persistence.md")
    p.add_argument("--kv-idle-spill-s", type=float, default=1.0, metavar="S",
                   help="a session with no request in flight for longer than this leaves RAM first when pages run "
                        "short, before the prefix cache's pages (default 1.0)")
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="one '<tenant> <key>' per line: each key a tenant that sees only its own pools and "
                        "sessions (docs/persistence.md); not with --api-key")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="on a loopback address only loopback Host names are answered (DNS rebinding); "
                        "also answer NAME (repeatable; '*' for any)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive (408 after; default 30)")
    p.add_argument("--no-metrics", action="store_true",
                   help="no GET /metrics (it answers 501 not_supported_error, as llama.cpp without --metrics) "
                        "and no Prometheus series collected for it (default: on)")
    p.add_argument("--metrics-key", default=os.environ.get("OPENCOTI_METRICS_KEY"), metavar="KEY",
                   help="a key that opens GET /metrics only (a Prometheus scraper); with --api-keys-file the only "
                        "key /metrics answers, since it shows every tenant (default: $OPENCOTI_METRICS_KEY)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def engine_seed(seed: int) -> int:
    """The engine's default seed from ``--seed``: -1 draws a random one (llama.cpp's default)."""
    return int.from_bytes(os.urandom(8), "little") >> 1 if seed == -1 else seed


def allowed_hosts(bind: str, extra: list[str]) -> list[str] | None:
    """Host names answered: any when bound to a non-loopback address (or with ``--allowed-host '*'``),
    else the loopback names plus ``extra``."""
    import ipaddress

    if "*" in extra:
        return None
    try:
        loopback = bind == "localhost" or ipaddress.ip_address(bind).is_loopback
    except ValueError:
        loopback = False
    return [*LOOPBACK_NAMES, *extra] if loopback else None


def run(args) -> int:
    import uvicorn

    from ..engine import Engine, EngineConfig
    from ..engine.errors import OpencotiError
    from ..engine.persist.store import resolve_state_dir
    from .app import ServerConfig, create_app
    from .tenants import load_keys_file

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("opencoti.server")
    try:
        engine_config = EngineConfig(
            model=args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
            kv_budget_tokens=args.kv_budget_tokens, kv_budget_mib=args.kv_budget_mib, max_pools=args.max_pools,
            max_running=args.parallel, max_context=args.ctx_size, max_batch_tokens=args.batch_tokens,
            num_threads=args.threads, pool_grace_ttl_s=args.pool_grace_ttl,
            prefix_cache=args.prefix_cache == "on", session_ttl_s=args.session_ttl,
            state_dir=resolve_state_dir(args.state_dir, args.port), weights=args.weights,
            kv_dtype=args.kv_dtype, session_kv_budget_mib=args.session_kv_budget_mib, speculative=args.speculative,
            kv_disk_budget_mib=args.kv_disk_budget_mib, kv_disk_dir=args.kv_disk_dir,
            kv_idle_spill_s=args.kv_idle_spill_s, kv_disk_write_share=args.kv_disk_write_share,
            kv_disk_write_ahead=args.kv_disk_write_ahead == "on",
            speculative_max=args.draft_max, seed=engine_seed(args.seed))
        server_config = ServerConfig(
            api_key=args.api_key or None, max_body_bytes=int(args.max_body_mib * 2**20),
            cors_origins=list(args.cors_origin), tps_interval_ms=args.tps_interval_ms,
            default_max_tokens=None if args.n_predict < 0 else args.n_predict, model_alias=args.alias,
            default_seed=None if args.seed == -1 else args.seed,
            tenant_keys=load_keys_file(args.api_keys_file) if args.api_keys_file else None,
            allowed_hosts=allowed_hosts(args.host, args.allowed_host), body_timeout_s=args.body_timeout,
            metrics=not args.no_metrics, metrics_key=args.metrics_key or None)
        if server_config.body_timeout_s <= 0:
            raise OpencotiError("--body-timeout must be > 0")
        if server_config.tenant_keys and server_config.api_key:
            raise OpencotiError("--api-key (or $OPENCOTI_API_KEY) and --api-keys-file cannot be combined")
        if server_config.metrics_key is not None and (server_config.metrics_key == server_config.api_key or
                                                      server_config.metrics_key in (server_config.tenant_keys or {})):
            raise OpencotiError("--metrics-key must be a key of its own (not the API key or a tenant's key)")
        if server_config.tps_interval_ms < 50:
            raise OpencotiError("--tps-interval-ms must be >= 50")
        if args.n_predict == 0:
            raise OpencotiError("--n-predict must be -1 or a positive number")
    except OpencotiError as e:
        print(f"opencoti serve: {e}", file=sys.stderr)
        return 2

    def load() -> Engine:
        return Engine(engine_config, progress=lambda msg: log.info("%s", msg))

    app = create_app(engine_factory=load, config=server_config)
    state = app.state.server

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            # Like uvicorn's, without re-raising the signal after shutdown: a requested stop exits 0.
            # live /polykv/tps streams end now; generation streams end (with an SSE error event)
            # just before uvicorn's graceful timeout would cancel them mid-chunk
            state.begin_stop(max(0.0, args.graceful_timeout - 0.5))
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            for srv in self.servers:
                for sock in srv.sockets:
                    host, port = sock.getsockname()[:2]
                    # one machine-readable line (tests and scripts wait for it)
                    print(f"opencoti serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)

    # The event loop takes the GIL back several times per request (uvloop gives it up around each
    # poll): while a worker thread runs Python (parsing a large body, decoding megabytes of ids)
    # each take waits for the switch interval, 5 ms by default. 1 ms: measured on the 2-core AVX2
    # box, a thread that takes the GIL back 5 times waits 8 ms (p50) instead of 28 beside a parse.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # h11 writes header names as the app spells them (httptools lowercases them all): llama.cpp
    # sends "Access-Control-Allow-Origin", and clients that read headers into a plain dict (llama.cpp's
    # own test suite does) look them up by that spelling; a token takes milliseconds, h11 microseconds;
    # request heads up to 256 KiB (h11's default is 16 KiB)
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=args.graceful_timeout, access_log=args.log_level == "debug",
                                   lifespan="on", http="h11", h11_max_incomplete_event_size=2**18))
    def load_failed(e: BaseException) -> None:
        # a server that cannot start exits (non-zero) instead of answering 500 forever: a process
        # supervisor (systemd, Kubernetes) sees the failure and acts on its restart policy
        print(f"opencoti serve: start-up failed: {e}", file=sys.stderr, flush=True)
        server.should_exit = True

    state.on_load_error = load_failed
    server.run()
    if state.load_error is not None:
        return 1
    return 0
