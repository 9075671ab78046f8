"""The /dashboard page in a real headless Chromium (Debian's `chromium`, driven by Playwright).

A real `opencoti` HTTP server (uvicorn on a free loopback port, tiny model, API key on) serves the
page; the test drives it like an operator: the 401 without a key, the tree and KV numbers after
creating pools and sessions through the API, live tps, every action, and a refused action's 409.
"""

from __future__ import annotations

import re
import shutil
import socket
import threading
import time

import httpx
import playwright.sync_api as playwright_sync
import pytest

from opencoti.engine import SamplingParams


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
KEY = "dash-key"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

if not shutil.which("chromium"):
    pytest.fail("Debian's chromium is required for the dashboard tests (scripts/setup.sh --test installs it)",
                pytrace=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(engine):
    import uvicorn

    from opencoti.server import create_app
    from opencoti.server.config import ServerConfig

    port = _free_port()
    app = create_app(engine, config=ServerConfig(api_key=KEY))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    yield base, api
    api.close()
    srv.should_exit = True
    th.join(10)


@pytest.fixture
def browser():
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def _open(browser, base, *, key: str | None):
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    if key is not None:
        page.add_init_script(f"sessionStorage.setItem('opencoti.key', {key!r});")
    page.goto(base + "/dashboard")
    return page, errors


def _slow_steps(engine, monkeypatch) -> None:
    """Each engine step slowed to ~50 ms: the tiny model decodes hundreds of tokens in about a second,
    which can end before the page has loaded and caught the session decoding."""
    execute = engine.core.runner.execute

    def slow_execute(batch):
        time.sleep(0.05)
        return execute(batch)

    monkeypatch.setattr(engine.core.runner, "execute", slow_execute)


def _wait(page, api, expr: str, timeout: float = 20_000) -> None:
    """``page.wait_for_function`` that, when it times out, says what the page and the server showed
    (CI keeps only the failure's text)."""
    try:
        page.wait_for_function(expr, timeout=timeout)
    except playwright_sync.TimeoutError:
        shown = page.evaluate("() => ({conn: document.querySelector('#conn').textContent, "
                              "error: getComputedStyle(document.querySelector('#error')).display !== 'none' ? "
                              "document.querySelector('#error').innerText : null, "
                              "tree: document.querySelector('#tree').innerText})")
        server = api.get("/polykv/pools").json()
        raise AssertionError(f"timed out waiting for {expr}\npage: {shown}\nserver: {server}") from None


def test_without_key_shows_401_then_key_unlocks(server, browser):
    base, api = server
    api.post("/polykv/pools", json={"tokens": list(range(1, 40))}).raise_for_status()
    page, _ = _open(browser, base, key=None)
    page.wait_for_selector("#auth", state="visible")
    assert "401" in page.inner_text("#auth-status")
    assert page.locator("[data-pool]").count() == 0
    page.fill("#key", KEY)
    page.click("#key-save")
    page.wait_for_selector("#tree [data-pool]")
    assert not page.is_visible("#auth")
    # the key lives in this tab's sessionStorage only
    assert page.evaluate("sessionStorage.getItem('opencoti.key')") == KEY
    assert page.evaluate("localStorage.length") == 0


def test_tree_kv_tps_and_actions(server, browser, engine, monkeypatch):
    base, api = server
    _slow_steps(engine, monkeypatch)
    root = api.post("/polykv/pools", json={"tokens": list(range(1, 70)), "label": "root"}).json()
    child = api.post(f"/polykv/pools/{root['pool_id']}/fork", json={"tokens": list(range(1, 100))}).json()
    # a long decode keeps a session live so the tps stream has something to show
    done = threading.Event()

    def run():
        try:
            engine.generate(list(range(1, 70)) + list(range(70, 100)) + [5, 6, 7], pool_id=child["pool_id"],
                            session_id="agent-1", params=SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    page, errors = _open(browser, base, key=KEY)
    page.wait_for_selector(f"#tree [data-pool='{child['pool_id']}']")

    # KV numbers on the page are the API's numbers
    pools = {p["pool_id"]: p for p in api.get("/polykv/pools").json()["pools"]}
    for pid in (root["pool_id"], child["pool_id"]):
        own = page.get_attribute(f"#tree [data-pool='{pid}'] [data-field='own']", "data-bytes")
        assert int(own) == pools[pid]["own_kv_bytes"]
    page.wait_for_selector(f"#cap tr[data-pool='{root['pool_id']}']")  # capacity rows follow the tree

    # live tps arrives (the page updates without reloading)
    _wait(page, api, "() => document.querySelector(\"[data-session='agent-1']\") && "
                     "document.querySelector(\"[data-session='agent-1']\").dataset.tps !== ''", 20_000)
    n0 = page.evaluate("() => document.querySelector('#legend').childElementCount")
    assert n0 >= 1
    assert page.inner_text("#conn") == "live"

    # pin -> the server's pool is pinned
    page.click(f"#tree [data-pool='{root['pool_id']}'] >> [data-action='pin'] >> nth=0")
    _wait(page, api, f"() => document.querySelector(\"#tree [data-pool='{root['pool_id']}'] [data-action='unpin']\")")
    assert api.get(f"/polykv/pools/{root['pool_id']}").json()["pinned"] is True

    # a refused action shows its error: evicting a pinned pool is a 409
    page.click(f"#tree [data-pool='{root['pool_id']}'] >> [data-action='evict'] >> nth=0")
    page.wait_for_selector("#error", state="visible")
    assert "409" in page.inner_text("#error-status")
    assert api.get(f"/polykv/pools/{root['pool_id']}").json()["residency"] == "resident"
    page.click("#error-close")

    # set an admission policy through the page (two prompt dialogs)
    answers = iter(["12.5", "advisory"])
    page.on("dialog", lambda d: d.accept(next(answers)))
    page.click(f"#tree [data-pool='{child['pool_id']}'] >> [data-action='policy'] >> nth=0")
    _wait(page, api,
          f"() => [...document.querySelectorAll(\"#cap tr[data-pool='{child['pool_id']}'] td\")]"
          ".some(t => t.textContent === '12.5')")
    assert api.get(f"/polykv/pools/{child['pool_id']}/admission").json()["target_tps_per_session"] == 12.5

    # release the session from the page: the request is cancelled, the session is gone
    page.click("[data-session='agent-1'] [data-action='release-session']")
    assert done.wait(20)
    _wait(page, api, "() => !document.querySelector(\"[data-session='agent-1']\")")
    assert all(s["session_id"] != "agent-1" for p in api.get("/polykv/pools").json()["pools"] for s in p["sessions"])

    # flush, unpin, then release the leaf and the root
    page.click(f"#tree [data-pool='{child['pool_id']}'] >> [data-action='flush'] >> nth=0")
    page.click(f"#tree [data-pool='{root['pool_id']}'] >> [data-action='unpin'] >> nth=0")
    _wait(page, api, f"() => document.querySelector(\"#tree [data-pool='{root['pool_id']}'] [data-action='pin']\")")
    assert api.get(f"/polykv/pools/{root['pool_id']}").json()["pinned"] is False
    page.click(f"#tree [data-pool='{child['pool_id']}'] >> [data-action='release'] >> nth=0")
    _wait(page, api, f"() => !document.querySelector(\"#tree [data-pool='{child['pool_id']}']\")")
    assert api.get(f"/polykv/pools/{child['pool_id']}").status_code == 404
    page.click(f"#tree [data-pool='{root['pool_id']}'] >> [data-action='release'] >> nth=0")
    _wait(page, api, "() => !document.querySelector('#tree [data-pool]')")
    page.wait_for_selector("#log div")  # the admission policy change is in the event log
    # the only console error is the network log line of the refused (409) evict the test asked for
    assert [e for e in errors if "status of 409" not in e] == [], errors


def test_an_action_waits_for_the_refresh_in_flight(server, browser):
    """A release clicked while a refresh is between listing the pools and asking each one's capacity
    is sent only after that refresh ends: the page never asks about a pool it has just released
    (a 404 in the browser's console), and the tree it draws next is the one after the release."""
    base, api = server
    root = api.post("/polykv/pools", json={"tokens": list(range(1, 40))}).json()
    child = api.post(f"/polykv/pools/{root['pool_id']}/fork", json={"tokens": list(range(1, 60))}).json()
    page, errors = _open(browser, base, key=KEY)
    failed: list[tuple] = []
    page.on("response", lambda r: failed.append((r.status, r.request.method, r.url)) if r.status >= 400 else None)
    deletes: list[str] = []
    page.on("request", lambda r: deletes.append(r.url) if r.method == "DELETE" else None)
    page.wait_for_selector(f"#tree [data-pool='{child['pool_id']}']")

    held: list = []   # the child's capacity request of one refresh, held until the release is clicked
    page.route(f"**/polykv/pools/{child['pool_id']}/capacity",
               lambda route: route.continue_() if held else held.append(route))
    deadline = time.monotonic() + 10
    while not held and time.monotonic() < deadline:
        page.wait_for_timeout(50)
    assert held, "no refresh asked for the child's capacity"
    page.click(f"#tree [data-pool='{child['pool_id']}'] >> [data-action='release'] >> nth=0")
    page.wait_for_timeout(700)
    assert deletes == [], "the release went out while the refresh was still in flight"
    held[0].continue_()
    _wait(page, api, f"() => !document.querySelector(\"#tree [data-pool='{child['pool_id']}']\")")
    assert api.get(f"/polykv/pools/{child['pool_id']}").status_code == 404
    assert len(deletes) == 1
    page.wait_for_timeout(1200)   # two more refreshes: none asks about the released pool
    assert failed == [] and errors == [], (failed, errors)


def test_a_click_held_across_a_refresh_still_acts(server, browser):
    """A person's click lasts ~100 ms from press to release, and the page refreshes twice a second:
    the button pressed must still be the one released on (a tree redrawn from new elements between
    the two drops the click: it lands on their common ancestor, not on a button)."""
    base, api = server
    root = api.post("/polykv/pools", json={"tokens": list(range(1, 40))}).json()
    page, errors = _open(browser, base, key=KEY)
    button = page.locator(f"#tree [data-pool='{root['pool_id']}'] >> [data-action='pin'] >> nth=0")
    button.wait_for()
    box = button.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.wait_for_timeout(1200)   # two refreshes come in while the button is held
    page.mouse.up()
    _wait(page, api, f"() => document.querySelector(\"#tree [data-pool='{root['pool_id']}'] [data-action='unpin']\")")
    assert api.get(f"/polykv/pools/{root['pool_id']}").json()["pinned"] is True
    assert errors == []


def test_a_decoding_sessions_release_button_stays_put(server, browser, engine, monkeypatch):
    """A decoding session's row changes every poll (tps, context length): its release button must not
    move under the pointer meanwhile (a click pressed on it and released beside it does nothing)."""
    base, api = server
    _slow_steps(engine, monkeypatch)
    pool = api.post("/polykv/pools", json={"tokens": list(range(1, 40))}).json()
    page, errors = _open(browser, base, key=KEY)
    page.wait_for_selector(f"#tree [data-pool='{pool['pool_id']}']")
    done = threading.Event()

    def run():
        try:  # the context grows from 43 past 100 (~3 s): its number gains a digit while the page watches
            engine.generate(list(range(1, 40)) + [5, 6, 7, 8], pool_id=pool["pool_id"], session_id="agent-2",
                            params=SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    button = page.locator("[data-session='agent-2'] [data-action='release-session']")
    button.wait_for()
    seen: dict[tuple, set] = {}   # the button's position -> the context lengths shown meanwhile
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ctx = int(re.search(r"ctx (\d+)/", page.inner_text("[data-session='agent-2']")).group(1))
        box = button.bounding_box()
        seen.setdefault((round(box["x"]), round(box["y"])), set()).add(ctx)
        if ctx >= 100:
            break
        page.wait_for_timeout(100)
    shown = set().union(*seen.values())
    assert min(shown) < 100 <= max(shown), shown
    assert len(seen) == 1, seen
    button.click()
    assert done.wait(20)
    assert errors == []


def test_a_pools_buttons_do_not_follow_its_text(server, browser):
    """A pool's numbers change while its sessions decode; its buttons must sit where they sit whatever
    the text before them says (else they move under a click): two pools at the same depth, one with a
    long label, have their buttons at the same place."""
    base, api = server
    short = api.post("/polykv/pools", json={"tokens": list(range(1, 10))}).json()
    long = api.post("/polykv/pools", json={"tokens": list(range(1, 300)), "label": "a long label " * 3}).json()
    page, errors = _open(browser, base, key=KEY)
    page.wait_for_selector(f"#tree [data-pool='{long['pool_id']}']")
    for action in ("pin", "evict", "flush", "release", "policy"):
        xs = {page.locator(f"#tree [data-pool='{p['pool_id']}'] [data-action='{action}']").bounding_box()["x"]
              for p in (short, long)}
        assert len(xs) == 1, (action, xs)
    assert errors == []
