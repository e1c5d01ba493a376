"""`rlfleet web` as its owner meets it: a real Chromium (Debian's package, driven by Playwright through
its executable_path: nothing downloads a browser) against the real aiohttp app on 127.0.0.1, a tiny local
model answering, a real Redis queue worked in-process and the real store. And from outside: every route
refuses a request without a valid login and changes nothing."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
import redis
from rq import Queue, SimpleWorker
from sqlalchemy import select

from rlfleet.bots.web.app import WebApp, build_app
from rlfleet.bots.web.login import COOKIE, ensure_token, session_cookie, valid_bearer, valid_session
from rlfleet.bots.web.run import local_responder
from rlfleet.cli.app import dispatch
from rlfleet.shared.config import load_config
from rlfleet.shared.events import Capture, Rating
from rlfleet.shared.queue import EVENTS_QUEUE, TRAIN_QUEUE, open_queue
from rlfleet.shared.schema import CaptureRow, RatingRow
from rlfleet.shared.store import Store
from rlfleet.shared.webserver import listening
from rlfleet.shared.workers import serving

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
ROUTES = [("GET", "/"), ("GET", "/static/common.js"), ("GET", "/static/app.js"), ("GET", "/static/index.html"),
          ("GET", "/api/about"),
          ("POST", "/api/chat"), ("POST", "/api/rate"), ("POST", "/api/why"), ("POST", "/api/undo"),
          ("GET", "/dashboard"), ("GET", "/static/dashboard.js"),
          ("GET", "/static/vendor/chart.umd.min.js"), ("GET", "/api/dashboard"), ("POST", "/api/command"),
          ("GET", "/api/export"), ("GET", "/metrics"), ("GET", "/ratings"), ("GET", "/static/ratings.js"),
          ("GET", "/api/ratings"), ("POST", "/api/ratings/undo"), ("POST", "/api/ratings/comment")]


@pytest.fixture(scope="module")
def web_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model, never answering with a NUL byte (no capture takes one: about one sampled answer in
    ten of a byte-level random model had one, and its test failed) nor with nothing at all."""
    from transformers import AutoTokenizer, GenerationConfig

    folder = tmp_path_factory.mktemp("web-model") / "tiny"
    shutil.copytree(tiny_model_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    gc = GenerationConfig.from_pretrained(folder)
    nul = tok.convert_tokens_to_ids("\u0100")  # the byte-level alphabet's name for byte 0
    assert tok.decode([nul]) == "\x00"
    gc.suppress_tokens = [nul, *(i for i in tok.all_special_ids if i != tok.eos_token_id)]
    gc.begin_suppress_tokens = [tok.eos_token_id]
    gc.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def endless_model_dir(web_model_dir, tmp_path_factory) -> Path:
    """The web test model that never ends an answer by itself: it writes until max_new_tokens."""
    from transformers import AutoTokenizer, GenerationConfig

    folder = tmp_path_factory.mktemp("endless-model") / "tiny"
    shutil.copytree(web_model_dir, folder)
    gc = GenerationConfig.from_pretrained(folder)
    gc.suppress_tokens = [*gc.suppress_tokens, AutoTokenizer.from_pretrained(folder).eos_token_id]
    gc.save_pretrained(folder)
    return folder


@asynccontextmanager
async def web_rig(home, model_dir, monkeypatch, max_new_tokens: int = 24, threshold: int = 32, **train):
    monkeypatch.setenv("RLFLEET_MODEL", str(model_dir))
    cfg = load_config()
    cfg.chat.max_new_tokens, cfg.train.threshold = max_new_tokens, threshold
    for key, value in train.items():
        setattr(cfg.train, key, value)
    cfg.save()  # the worker reads its own config
    token, _ = ensure_token(cfg.web_token_path)
    handle = open_queue(cfg)
    state = WebApp(cfg, handle, local_responder(cfg), dispatch, token, token_path=cfg.web_token_path)
    try:
        async with listening(build_app(state), "127.0.0.1", 0) as port:
            yield state, f"http://127.0.0.1:{port}"
    finally:
        handle.close()


def ratings(cfg) -> list[tuple[int, int | None, str | None, str]]:
    with Store(cfg.db_url).session() as s:
        return [(r.value, r.stars, r.comment, r.state)
                for r in s.scalars(select(RatingRow).order_by(RatingRow.id))]


def ratings_of(cfg) -> list[tuple[str, int, str | None, str]]:
    with Store(cfg.db_url).session() as s:
        return [(r.actor, r.value, r.comment, r.state) for r in s.scalars(select(RatingRow).order_by(RatingRow.id))]


def captures(cfg) -> int:
    with Store(cfg.db_url).session() as s:
        return len(s.scalars(select(CaptureRow)).all())


def test_every_route_refuses_without_a_valid_login_and_changes_nothing(queued_home, web_model_dir, monkeypatch,
                                                                       rconn):
    async def go():
        async with web_rig(queued_home, web_model_dir, monkeypatch) as (state, url), aiohttp.ClientSession() as http:
            expired = session_cookie(state.token, time.time() - 3600, hours=0.5)
            forged = session_cookie("not-the-token", time.time(), hours=1)
            body = json.dumps({"conversation": "c", "text": "hi", "capture": "x", "value": 1, "reason": "r"})
            keys_before = set(rconn.keys())
            for headers, cookies in [({}, {}), ({"Authorization": "Bearer wrong"}, {}),
                                     ({"Authorization": f"Basic {state.token}"}, {}),
                                     ({}, {COOKIE: expired}), ({}, {COOKIE: forged}), ({}, {COOKIE: "9" * 40}),
                                     ({}, {COOKIE: f"{int(time.time()) + 99}.{'0' * 64}"}),
                                     ({"Cookie": f"{COOKIE}={'²' * 10}.abc"}, {})]:
                for method, path in ROUTES:
                    async with http.request(method, url + path, data=body, cookies=cookies,
                                            headers={"Content-Type": "application/json", **headers}) as r:
                        assert r.status == 401, (method, path, headers, cookies)
                        text = await r.text()
                        assert state.token not in text
            assert set(rconn.keys()) == keys_before  # nothing queued, nothing stored
            assert captures(state.cfg) == 0
            async with http.post(url + "/login", data={"token": "guess"}) as r:
                assert r.status == 401 and "not the login token" in await r.text()
            # the real token as a bearer header: the API answers
            async with http.get(url + "/api/about", headers={"Authorization": f"Bearer {state.token}"}) as r:
                assert r.status == 200 and (await r.json())["model"] == str(web_model_dir)
            async with http.get(url + "/api/about", headers={"Authorization": f"bearer {state.token}"}) as r:
                assert r.status == 200  # the scheme's case does not matter (RFC 9110)
    asyncio.run(go())


def test_a_new_token_in_the_file_revokes_the_old_one_at_once_and_the_page_names_the_served_version(
        queued_home, web_model_dir, monkeypatch):
    """A leaked token is replaced by writing the file: the old one and its cookies stop working at the
    next request, no restart; a file gone or unsafe lets nobody in. /api/about names what CURRENT
    serves now, not what the last answer used."""
    async def go():
        async with web_rig(queued_home, web_model_dir, monkeypatch, max_new_tokens=8) as (state, url), \
                aiohttp.ClientSession() as http:
            old, path = state.token, state.cfg.web_token_path

            async def status(token: str | None = None, cookie: str | None = None) -> int:
                async with http.get(url + "/api/about", headers={"Authorization": f"Bearer {token}"} if token else {},
                                    cookies={COOKIE: cookie} if cookie else {}) as r:
                    return r.status

            async with http.post(url + "/login", data={"token": old}, allow_redirects=False) as r:
                cookie = r.cookies[COOKIE].value
            assert await status(old) == 200 and await status(cookie=cookie) == 200
            path.write_text("a-fresh-token-nobody-has-seen\n")
            assert await status(old) == 401 and await status(cookie=cookie) == 401
            assert await status("a-fresh-token-nobody-has-seen") == 200
            path.chmod(0o644)  # unsafe: nobody
            assert await status("a-fresh-token-nobody-has-seen") == 401
            path.unlink()  # gone: nobody, and no 500
            assert await status("a-fresh-token-nobody-has-seen") == 401 and await status(old) == 401
            path.write_text(old + "\n")
            path.chmod(0o600)
            async with http.post(url + "/logout", allow_redirects=False) as r:  # no session left: still out
                assert r.status == 303 and r.headers["Location"] == "/"
            async with http.get(url + "/api/about", headers={"Authorization": f"Bearer {old}"}) as r:
                assert (await r.json())["version"] is None
            adapters = state.responder.adapters_dir
            (adapters / "v0001").mkdir(parents=True)
            (adapters / "CURRENT").write_text("v0001\n")  # promoted by the worker: no answer since
            async with http.get(url + "/api/about", headers={"Authorization": f"Bearer {old}"}) as r:
                assert (await r.json())["version"] == "v0001"
    asyncio.run(go())


def test_a_cookie_counts_only_in_ascii_digits_and_the_bearer_scheme_in_any_case():
    token, now = "the-token", time.time()
    good = session_cookie(token, now, hours=1)
    assert valid_session(token, good, now)
    for digits in ("²" * 10, "٣" * 10, "①" * 10, "+" + good.split(".")[0][1:], " 1"):  # int() refuses or bends
        assert not valid_session(token, f"{digits}.{good.split('.')[1]}", now), digits
    for header in (f"Bearer {token}", f"bearer {token}", f"BEARER {token}", f"Bearer  {token} "):
        assert valid_bearer(token, header), header
    for header in (None, "", token, f"Basic {token}", f"Bearer{token}", "Bearer ", f"Bearer x{token}"):
        assert not valid_bearer(token, header), header


def test_numbers_no_database_column_holds_are_a_400_not_a_500(queued_home, web_model_dir, monkeypatch):
    """Past SQLite's 64-bit INTEGER the driver cannot even send a number: refused as the request's error."""
    async def go():
        async with web_rig(queued_home, web_model_dir, monkeypatch, max_new_tokens=8) as (state, url), \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {state.token}"}) as http:
            huge = 10 ** 23
            async with http.get(url + "/api/ratings", params={"offset": str(huge)}) as r:
                assert r.status == 400 and "offset" in (await r.json())["message"], await r.text()
            async with http.get(url + "/api/ratings", params={"offset": str(2 ** 63 - 1)}) as r:
                assert r.status == 200 and (await r.json())["ratings"] == []
            for path, body in [("/api/ratings/undo", {"id": huge}),
                               ("/api/ratings/comment", {"id": 2 ** 63, "comment": "x"})]:
                async with http.post(url + path, json=body) as r:
                    assert r.status == 400 and "id" in (await r.json())["message"], (path, await r.text())
            async with http.post(url + "/api/ratings/comment", json={"id": 2 ** 63 - 1, "comment": "x"}) as r:
                assert r.status == 404 and (await r.json())["ok"] is False
    asyncio.run(go())


def test_a_page_that_goes_away_mid_answer_stops_the_answer_quietly(queued_home, endless_model_dir, monkeypatch,
                                                                   caplog):
    """A reload mid-answer: the answer stops at its next token (no model time spent on what nobody
    reads, the next question not kept waiting), nothing is captured, and no traceback is logged."""
    async def go():
        async with web_rig(queued_home, endless_model_dir, monkeypatch, max_new_tokens=900) as (state, url):
            ends: list[tuple[str, int]] = []  # how each answer ended, and after how many pieces
            real = state.responder.answer

            def answer(messages, **kw):
                pieces, on_text = [], kw["on_text"]
                try:
                    got = real(messages, **{**kw, "on_text": lambda t: (pieces.append(t), on_text(t))})
                except BaseException as exc:
                    ends.append((type(exc).__name__, len(pieces)))
                    raise
                ends.append(("done", len(pieces)))
                return got
            monkeypatch.setattr(state.responder, "answer", answer)
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {state.token}"}) as http:
                async with http.post(url + "/api/chat", json={"conversation": "web-gone", "text": "go on"}) as r:
                    assert json.loads(await r.content.readline())["type"] == "text"
                    r.close()  # the page reloads: its connection goes
            deadline = time.monotonic() + 60
            while not ends:
                assert time.monotonic() < deadline, "the answer never ended"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the route's last steps after the answer
            (how, pieces), = ends
            assert how != "done" and pieces < 300, ends  # stopped, not written to its 900 tokens
            assert captures(state.cfg) == 0
    with caplog.at_level(logging.INFO):
        asyncio.run(go())
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud]
    assert any("went away" in r.getMessage() for r in caplog.records)


def test_an_answer_streams_in_pieces_and_bad_bodies_are_refused(queued_home, web_model_dir, monkeypatch):
    async def go():
        async with web_rig(queued_home, web_model_dir, monkeypatch, max_new_tokens=40) as (state, url), \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {state.token}"}) as http:
            async with http.post(url + "/api/chat", json={"conversation": "web-t", "text": "tell me a story"}) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("application/x-ndjson")
                lines = [json.loads(line) async for line in r.content if line.strip()]
            pieces = [m["text"] for m in lines if m["type"] == "text"]
            done = lines[-1]
            assert done["type"] == "done" and done["capture"] and done["version"] is None, done
            assert len(pieces) >= 2  # sent as generated, not in one go at the end
            assert "".join(pieces).strip() == done["text"]
            for payload, status in [({"conversation": "c"}, 400), ({"conversation": "c", "capture": "x"}, 400),
                                    ({"conversation": "c", "capture": done["capture"], "value": 1, "stars": 2}, 400),
                                    ({"conversation": "c", "capture": done["capture"], "value": 3}, 400),
                                    ({"conversation": "c", "capture": "no-such", "value": 1}, 409)]:
                async with http.post(url + "/api/rate", json=payload) as r:
                    assert r.status == status, (payload, await r.text())
            long = " ".join(f"w{i}" for i in range(3000))  # past the test model's 1,024-token context
            async with http.post(url + "/api/chat", json={"conversation": "web-t", "text": long}) as r:
                assert r.status == 400 and "reads at most 1,024" in (await r.json())["message"]
            async with http.post(url + "/api/rate", data="value=1") as r:
                assert r.status == 415
            async with http.post(url + "/api/rate", data="{nope", headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400 and "not JSON" in (await r.json())["message"]
            assert ratings(state.cfg) == []
    asyncio.run(go())


async def log_in(page, url: str, token: str) -> None:
    response = await page.goto(url + "/")
    assert response is not None and response.status == 401
    await page.fill("input[name=token]", token)
    await page.click("button[type=submit]")


async def rate_by_api(http, url: str, text: str, **rating) -> str:
    """Ask and rate through the API (as a script with the token would): the capture id."""
    async with http.post(url + "/api/chat", json={"conversation": "web-api", "text": text}) as r:
        done = [json.loads(line) async for line in r.content if line.strip()][-1]
    assert done.get("capture"), done
    async with http.post(url + "/api/rate", json={"conversation": "web-api", "capture": done["capture"],
                                                  **rating}) as r:
        assert r.status == 200, await r.text()
    return done["capture"]


def test_metrics_and_commands_for_a_script_with_the_token(queued_home, web_model_dir, monkeypatch):
    from prometheus_client.parser import text_string_to_metric_families

    async def go():
        async with web_rig(queued_home, web_model_dir, monkeypatch, max_new_tokens=8) as (state, url), \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {state.token}"}) as http:
            await rate_by_api(http, url, "one", value=1)
            await rate_by_api(http, url, "two", stars=2, comment="wrong")
            async with http.get(url + "/metrics") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                families = {f.name: f for f in text_string_to_metric_families(await r.text())}
            got = {(s.labels["source"], s.labels["value"], s.labels["state"]): s.value
                   for s in families["rlfleet_ratings"].samples}
            assert got == {("web", "good", "pending"): 1.0, ("web", "bad", "pending"): 1.0}
            applied = {s.labels["kind"]: s.value for s in families["rlfleet_events_applied"].samples
                       if s.name == "rlfleet_events_applied_total"}
            assert applied["capture"] == 2 and applied["rating"] == 2
            assert families["rlfleet_pending_ratings"].samples[0].value == 2
            assert families["rlfleet_adapter_info"].samples[0].labels["version"] == "base"
            # The sample Grafana dashboard asks only for names this endpoint serves.
            served = set(families) | {s.name for f in families.values() for s in f.samples}
            wanted = set(re.findall(r"rlfleet_[a-z_]+", (ROOT / "deploy/grafana/rlfleet.json").read_text()))
            assert wanted and wanted <= served, wanted - served
            async with http.get(url + "/api/export") as r:
                lines = [json.loads(line) for line in (await r.text()).splitlines()]
            assert [(x["label"], x.get("stars"), x.get("comment")) for x in lines] == [(True, None, None),
                                                                                      (False, 2, "wrong")]
            for body, status, said in [({"name": "rollback"}, 409, "already on the base model"),
                                       ({"name": "dance"}, 400, "unknown action"),
                                       ({"name": "promote", "version": "v0042"}, 409, "v0042")]:
                async with http.post(url + "/api/command", json=body) as r:
                    assert r.status == status and said in (await r.json())["message"], (body, await r.text())
            async with http.post(url + "/api/command", json={"name": "train"}) as r:
                assert r.status == 200 and "queued on 2 ratings" in (await r.json())["message"]
    asyncio.run(go())


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium package is not installed")
def test_the_dashboard_draws_the_ratings_follows_them_live_and_pauses_training(queued_home, web_model_dir,
                                                                              monkeypatch):
    from playwright.async_api import async_playwright, expect

    async def go():
        # A tiny random model: the gate would refuse what it learns, and exploring is slow on a CPU.
        async with web_rig(queued_home, web_model_dir, monkeypatch, max_new_tokens=8, threshold=4, gate=False,
                           explore=0, preload=False) as (state, url), \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {state.token}"}) as http, \
                async_playwright() as pw:
            await rate_by_api(http, url, "one", value=1)
            await rate_by_api(http, url, "two", value=-1, comment="<script>window.__pwned=1</script>")
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                await log_in(page, url, state.token)
                await page.goto(url + "/dashboard")
                await expect(page.locator("#total")).to_have_text("2")
                await expect(page.locator("#versions tbody")).to_contain_text("no adapter versions yet")
                assert await page.locator("#threshold").evaluate("e => [e.value, e.max]") == [2, 4]
                await expect(page.locator("#threshold-text")).to_have_text("2 of 4 pending: 2 more start a run")
                drawn = "id => Chart.getChart(document.querySelector(id)).data.datasets.map(" \
                        "d => d.data.reduce((a, b) => a + b, 0))"
                assert await page.evaluate(drawn, "#timeline-chart") == [1, 1]
                assert await page.evaluate(drawn, "#sources-chart") == [1, 1, 2]
                # A rating made elsewhere shows up without a reload: the bar and the chart move.
                await rate_by_api(http, url, "three", stars=5)
                await expect(page.locator("#total")).to_have_text("3", timeout=30_000)
                assert await page.locator("#threshold").evaluate("e => e.value") == 3
                # a local folder by its own name in the header, the whole path on hover
                await expect(page.locator("#model")).to_have_text(web_model_dir.name)
                assert await page.locator("#model").get_attribute("title") == str(web_model_dir)
                assert await page.evaluate(drawn, "#timeline-chart") == [2, 1]  # drawn in the same refresh
                def accept(dialog) -> None:
                    asyncio.ensure_future(dialog.accept())
                page.on("dialog", accept)
                # Paused, the rating that reaches the threshold starts no run; resuming starts it.
                await page.dblclick("#pause")  # one command: the second click finds the button busy
                await expect(page.locator("#training-state")).to_have_text("idle · automatic training paused")
                await expect(page.locator("#action-said")).to_contain_text("automatic training paused")
                await expect(page.locator("#pause")).to_have_text("Resume automatic training")
                await rate_by_api(http, url, "four", value=-1)
                await expect(page.locator("#threshold-text")).to_have_text("4 pending: a run is due", timeout=30_000)
                await page.wait_for_timeout(2500)  # a dashboard refresh later: still no run
                await expect(page.locator("#training-state")).to_have_text("idle · automatic training paused")
                await page.click("#pause")
                await expect(page.locator("#action-said")).to_contain_text("resumed")
                await expect(page.locator("#training-state")).to_have_text("queued", timeout=30_000)
                # The run, by a training worker right here; its version is served and can be rolled back.
                SimpleWorker([Queue(TRAIN_QUEUE, connection=state.handle.redis)],
                             connection=state.handle.redis).work(burst=True)
                await expect(page.locator("#serving")).to_have_text("adapter v0001", timeout=30_000)
                v1 = page.locator("#versions tbody tr", has_text="v0001")
                await expect(v1).to_contain_text("active")
                asked: list[str] = []
                page.remove_listener("dialog", accept)
                page.on("dialog", lambda d: (asked.append(d.message), asyncio.ensure_future(d.accept())))
                await v1.locator("button", has_text="roll back").click()
                await expect(page.locator("#action-said")).to_contain_text("base model")
                await expect(page.locator("#serving")).to_have_text("base model")
                assert asked and asked[0].startswith("Roll back from v0001 to the base model?")
                await v1.locator("button", has_text="serve this").click()
                await expect(page.locator("#serving")).to_have_text("adapter v0001")
                await v1.locator("td a").click()  # what v0001 trained on, in the ratings browser
                await expect(page.locator("#count")).to_have_text("4 ratings")
                await page.go_back()
                await expect(v1).to_contain_text("active")  # the dashboard drawn again, not a blank page
                await expect(page.locator("#total")).to_have_text("4")
                if os.environ.get("RLFLEET_WEB_DASHBOARD_SCREENSHOT"):  # docs/img/web-dashboard.png
                    await page.screenshot(path=os.environ["RLFLEET_WEB_DASHBOARD_SCREENSHOT"], full_page=True)
                assert await page.evaluate("window.__pwned") is None
                # The server gone: the page says it is not live any more, throws nothing, and comes back
                await page.route("**/api/dashboard", lambda route: route.abort())
                await expect(page.locator("#serving")).to_contain_text("not connected")
                await page.unroute("**/api/dashboard")
                await expect(page.locator("#serving")).to_have_text("adapter v0001")
                assert errors == []
            finally:
                await browser.close()
    asyncio.run(go())


async def slack_rating(state, text: str, value: int, comment: str | None = None) -> str:
    """A Slack user's rated answer, as the Slack bot's events would store it."""
    cap = Capture(source="slack", actor="U1", owner="U1", conversation="C1", prompt=[{"role": "user", "content": text}],
                  response=f"answer to {text}", model=state.cfg.model)
    assert (await state.handed(cap))["ok"]
    assert (await state.handed(Rating(source="slack", actor="U1", conversation="C1", target=cap.capture_id,
                                      value=value, comment=comment)))["ok"]
    return cap.capture_id


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium package is not installed")
def test_the_ratings_browser_filters_undoes_and_edits_comments(queued_home, web_model_dir, monkeypatch):
    from playwright.async_api import async_playwright, expect

    async def go():
        async with web_rig(queued_home, web_model_dir, monkeypatch, max_new_tokens=8) as (state, url), \
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {state.token}"}) as http, \
                async_playwright() as pw:
            await rate_by_api(http, url, "mine", value=1)
            await slack_rating(state, "their first", -1, comment="50% too long")
            await slack_rating(state, "their <b>second</b>", 1)
            async with http.get(url + "/api/ratings", params={"limit": "0"}) as r:
                assert r.status == 400  # a page of nothing is not a request
            async with http.get(url + "/api/ratings", params={"text": "%"}) as r:
                assert [x["comment"] for x in (await r.json())["ratings"]] == ["50% too long"]  # % is literal
            for params, n in [({"source": " Slack "}, 2), ({"version": "PENDING"}, 3), ({"version": "1"}, 0)]:
                async with http.get(url + "/api/ratings", params=params) as r:  # as people type them
                    assert (await r.json())["total"] == n, params
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await browser.new_page()
                page.on("dialog", lambda d: asyncio.ensure_future(
                    d.accept("far too long") if d.type == "prompt" else d.accept()))
                await log_in(page, url, state.token)
                await page.goto(url + "/ratings")
                await expect(page.locator("#count")).to_have_text("3 ratings")
                await page.fill("input[name=source]", "slack")
                await page.select_option("select[name=value]", "-1")
                await page.click("#filter button[type=submit]")
                await expect(page.locator("#count")).to_have_text("1 rating")
                row = page.locator("#ratings tbody tr").first
                await expect(row.locator("td.comment")).to_have_text("50% too long")
                await row.locator("button.edit").click()
                await expect(page.locator("#said")).to_have_text("noted why it is bad: far too long")
                await expect(page.locator("#ratings tbody tr").first.locator("td.comment")).to_have_text("far too long")
                await page.locator("#ratings tbody tr").first.locator("button.undo").click()
                await expect(page.locator("#said")).to_contain_text("undid")
                await expect(page.locator("#count")).to_have_text("0 ratings")
                await page.fill("input[name=source]", "")
                await page.select_option("select[name=value]", "0")
                await page.fill("input[name=text]", "<b>second</b>")
                await page.click("#filter button[type=submit]")
                await expect(page.locator("#count")).to_have_text("1 rating")
                await expect(page.locator("#ratings td.qa").first).to_contain_text("their <b>second</b>")
                assert await page.locator("#ratings b").count() == 0
            finally:
                await browser.close()
            async with http.post(url + "/api/ratings/undo", json={"id": 999}) as r:
                assert r.status == 404
            by_actor = [(a, v, c, st) for a, v, c, st in ratings_of(state.cfg)]
            assert by_actor == [("local", 1, None, "active"), ("U1", -1, "50% too long", "replaced"),
                                ("U1", 1, None, "active"), ("U1", -1, "far too long", "undone")]
    asyncio.run(go())


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium package is not installed")
def test_in_a_browser_log_in_chat_and_rate_with_a_thumb_stars_a_comment_and_a_reason(queued_home, web_model_dir,
                                                                                     monkeypatch):
    from playwright.async_api import async_playwright, expect

    async def go():
        async with web_rig(queued_home, web_model_dir, monkeypatch) as (state, url), async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                response = await page.goto(url + "/")
                assert response is not None and response.status == 401
                await page.fill("input[name=token]", "a guess")
                await page.click("button[type=submit]")
                await expect(page.locator(".error")).to_contain_text("not the login token")
                await page.fill("input[name=token]", state.token)
                await page.click("button[type=submit]")
                await expect(page.locator("#version")).to_have_text("base model")

                # Hostile text is shown as text: no element made, no script run.
                await page.fill("#text", HOSTILE)
                await page.press("#text", "Enter")
                first = page.locator("article.ai").nth(0)
                await expect(first.locator(".rate .good")).to_be_visible(timeout=60_000)
                assert await page.locator("article.you .text").first.text_content() == HOSTILE
                assert await page.locator("main img, main script").count() == 0
                assert await page.evaluate("window.__pwned") is None
                await expect(first.locator(".ver")).to_have_text("· base model")

                # A comment, then 👎: one rating with the words; then 4 stars re-rate it good.
                await first.locator(".comment-text").fill("too <b>long</b>")
                await first.locator(".bad").click()
                await expect(first.locator(".said")).to_contain_text("rated bad")
                await expect(first.locator(".reasons")).to_be_hidden()  # the words are the reason
                await first.locator(".stars button[data-stars='4']").click()
                await expect(first.locator(".said")).to_contain_text("re-rated good (4★)")
                await first.locator(".good").click()  # the same thumb: the server keeps the stars, so does the page
                await expect(first.locator(".said")).to_contain_text("already rated that way")
                await expect(first.locator(".stars button.on")).to_have_count(4)

                # A second answer, 👎 without words: the reasons are offered; a chip gives one.
                await page.fill("#text", "and another")
                await page.click("#send")
                second = page.locator("article.ai").nth(1)
                await expect(second.locator(".rate .bad")).to_be_visible(timeout=60_000)
                await second.locator(".bad").click()
                await expect(second.locator(".reasons")).to_be_visible()
                await second.locator(".reasons .chip", has_text="too long").click()
                await expect(second.locator(".said")).to_have_text("noted why it is bad: too long")

                if os.environ.get("RLFLEET_WEB_SCREENSHOT"):  # the README's picture: docs/img/web-chat.png
                    await page.screenshot(path=os.environ["RLFLEET_WEB_SCREENSHOT"])
                # History is kept across a reload (the stars too); /new starts over.
                await page.reload()
                await expect(page.locator("article.ai")).to_have_count(2)
                await expect(page.locator("article.ai").nth(0).locator(".stars button.on")).to_have_count(4)
                # The server gone: the click says so where it was made, and nothing is thrown.
                await page.route("**/api/rate", lambda route: route.abort())
                await page.locator("article.ai").nth(1).locator(".good").click()
                await expect(page.locator("article.ai").nth(1).locator(".said.err")).to_contain_text(
                    "the server did not answer")
                await page.unroute("**/api/rate")
                await page.fill("#text", "/new")
                await page.press("#text", "Enter")
                await expect(page.locator("article")).to_have_count(0)
                assert errors == []
            finally:
                await browser.close()
            assert ratings(state.cfg) == [(-1, None, "too <b>long</b>", "replaced"), (1, 4, None, "active"),
                                          (-1, None, None, "replaced"), (-1, None, "too long", "active")]
    asyncio.run(go())


def test_a_new_conversation_stops_the_answer_in_hand_and_takes_the_next_message_at_once(
        queued_home, endless_model_dir, monkeypatch):
    from playwright.async_api import async_playwright, expect

    async def go():
        async with web_rig(queued_home, endless_model_dir, monkeypatch, max_new_tokens=900) as (state, url), \
                async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                await page.goto(url + "/")
                await page.fill("input[name=token]", state.token)
                await page.click("button[type=submit]")
                await page.fill("#text", "go on and on")
                await page.press("#text", "Enter")
                await expect(page.locator("article.ai.streaming .text")).not_to_be_empty(timeout=30_000)
                await page.click("#new")
                await expect(page.locator("article")).to_have_count(0)
                await expect(page.locator("#send")).to_be_enabled(timeout=3_000)  # not after 900 unseen tokens
                await page.fill("#text", "hello again")
                await page.press("#text", "Enter")
                await expect(page.locator("article.you .text")).to_have_text("hello again")
                await expect(page.locator("article.ai .rate .good")).to_be_visible(timeout=60_000)
                assert errors == []
            finally:
                await browser.close()
            assert captures(state.cfg) == 1  # the new answer's: the stopped one was never finished
    asyncio.run(go())


def test_rlfleet_web_makes_a_private_token_and_serves_behind_it_with_its_workers(queued_home, web_model_dir):
    env = {**os.environ, "RLFLEET_MODEL": str(web_model_dir)}
    # Every address: allowed, with a warning to put TLS in front (no traffic leaves this machine here).
    proc = subprocess.Popen([sys.executable, "-m", "rlfleet.cli", "web", "--host", "0.0.0.0",
                             "--port", "0"], env={**env, "COLUMNS": "300"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        seen = ""
        deadline = time.monotonic() + 120
        while "put TLS in front" not in seen and time.monotonic() < deadline:
            seen += proc.stdout.readline()  # type: ignore[union-attr]
        assert "login token:" in seen and "warning: listening on 0.0.0.0" in seen, seen
        token_file = queued_home / "web-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert "made now" in seen and token not in seen  # the token goes to a terminal only, never a log
        port = int(seen.split("http://0.0.0.0:")[1].split("/")[0])

        async def probe():
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/api/about") as r:
                    assert r.status == 401
            # With its events worker running: the answer is captured and rated through it.
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
                await rate_by_api(http, f"http://127.0.0.1:{port}", "hello", stars=5)
        conn = redis.Redis.from_url(os.environ["REDIS_URL"])
        while not serving(conn, EVENTS_QUEUE):  # the events worker it started
            assert time.monotonic() < deadline and proc.poll() is None, "rlfleet web started no events worker"
            time.sleep(0.5)
        asyncio.run(probe())
        assert ratings(load_config()) == [(1, 5, None, "active")]
        proc.terminate()
        assert proc.wait(timeout=60) == 0
        assert "stopping workers" in proc.stdout.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium package is not installed")
def test_a_running_run_shows_its_step_speed_and_time_left(queued_home, web_model_dir, monkeypatch):
    """The dashboard's live run: what a training worker reports (its ProgressBoard in Redis, the run
    running in the store, the training lock held) shown as step, tokens/s and an ETA from the steps the
    page saw go by; the ETA follows the rate, and the line clears when the run ends."""
    from playwright.async_api import async_playwright, expect

    from rlfleet.shared.models import model_slug
    from rlfleet.shared.queue import train_lock_key
    from rlfleet.worker.orchestrate import ProgressBoard
    from rlfleet.worker.samples import Progress

    async def go():
        async with web_rig(queued_home, web_model_dir, monkeypatch) as (state, url), async_playwright() as pw:
            conn, slug = state.handle.redis, model_slug(state.cfg.model)
            run_id = state.store.create_run(slug)
            state.store.start_run(run_id, None)
            conn.set(train_lock_key(slug), "held-by-this-test", ex=120)
            report = ProgressBoard.start(conn, slug, run_id).reporter("v0001")
            report(Progress(step=2, total=40, tokens_per_s=123.4))
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await browser.new_page()
                await log_in(page, url, state.token)
                await page.goto(url + "/dashboard")
                await expect(page.locator("#training-state")).to_have_text("running")
                detail = page.locator("#training-detail")
                await expect(detail).to_have_text("v0001 training step 2/40 · 123 tok/s")  # no rate seen yet
                assert await page.locator("#training-progress").evaluate("e => [e.hidden, e.value, e.max]") == \
                    [False, 2, 40]
                # Six steps in about six seconds: a step a second, 32 to go.
                for step in range(3, 9):
                    await asyncio.sleep(1.0)
                    report(Progress(step=step, total=40, tokens_per_s=123.4))
                await expect(detail).to_contain_text("step 8/40", timeout=10_000)
                left = int(re.search(r"about (\d+) s left", await detail.text_content()).group(1))
                assert 16 <= left <= 48, left  # 32 steps at the page's measured rate, within its refresh lag
                state.store.fail_run(run_id, "stopped by the test")
                conn.delete(train_lock_key(slug))
                await expect(page.locator("#training-progress")).to_be_hidden(timeout=10_000)
                await expect(detail).not_to_contain_text("left")
            finally:
                await browser.close()
    asyncio.run(go())


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium package is not installed")
def test_the_dashboard_lists_each_scopes_own_adapter_as_text(queued_home, web_model_dir, monkeypatch):
    from playwright.async_api import async_playwright, expect

    from rlfleet.shared import scopes
    from rlfleet.shared.models import model_slug

    async def go():
        async with web_rig(queued_home, web_model_dir, monkeypatch) as (state, url), async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await browser.new_page()
                await log_in(page, url, state.token)
                await page.goto(url + "/dashboard")
                await expect(page.locator("#total")).to_have_text("0")
                assert await page.locator("#scopes").is_hidden()  # every rating shared: no scopes section
                # a person's own adapter appears (a platform id is text, however it reads)
                key = f"person:telegram:{HOSTILE}"
                store = Store(state.cfg.db_url)
                for value in (1, -1, 1):
                    c = Capture(source="telegram", owner=HOSTILE, conversation="c",
                                prompt=[{"role": "user", "content": "q"}], response="a", model="m")
                    store.apply_many([c, Rating(source="telegram", actor=HOSTILE, target=c.capture_id, value=value)],
                                     scopes.lineage(model_slug(state.cfg.model), key))
                row = page.locator("#scopes-table tbody tr")
                await expect(row).to_have_count(1, timeout=30_000)
                assert await row.locator("td").all_inner_texts() == [key, "base model", "0", "3 (2 · 1)", "3", "idle"]
                assert await page.evaluate("window.__pwned") is None
            finally:
                await browser.close()
    asyncio.run(go())



@asynccontextmanager
async def browsing(home, model_dir, monkeypatch, **page_args):
    """The rig (answers of 8 tokens) and a Chromium page logged in to it, on the chat page."""
    from playwright.async_api import async_playwright

    async with web_rig(home, model_dir, monkeypatch, max_new_tokens=8) as (state, url), async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = await browser.new_page(**page_args)
            await log_in(page, url, state.token)
            yield state, url, page
        finally:
            await browser.close()


def stored_turns(page) -> object:
    return page.evaluate("(JSON.parse(localStorage.getItem('rlfleet.chat')) || {turns: []}).turns"
                         ".map(t => [t.role, t.content.length > 20 ? t.content.length : t.content])")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium package is not installed")
def test_a_refused_message_leaves_the_conversation_as_it_was_and_offers_nothing_to_rate(queued_home, web_model_dir,
                                                                                       monkeypatch):
    from playwright.async_api import expect

    async def go():
        async with browsing(queued_home, web_model_dir, monkeypatch) as (state, url, page):
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            await expect(page.locator("#version")).to_have_text("base model")
            await page.fill("#text", "x" * 200_001)  # one character more than a message may have
            await page.press("#text", "Enter")
            refused = page.locator("article.ai").nth(0)
            await expect(refused.locator(".said")).to_contain_text("at most 200000 characters")
            await expect(page.locator("#send")).to_be_enabled()
            assert await refused.locator(".rate").is_hidden()  # no capture: no 👍/👎, stars or comment
            assert await stored_turns(page) == []
            # The next message is answered: the refused one is not sent along as history.
            await page.fill("#text", "hello")
            await page.press("#text", "Enter")
            answer = page.locator("article.ai").nth(1)
            await expect(answer.locator(".rate .good")).to_be_visible(timeout=60_000)
            assert await stored_turns(page) == [["user", "hello"], ["assistant", await answer.locator(
                ".text").text_content()]]
            # A conversation an older page stored with an overlong turn in it is mended when loaded.
            await page.evaluate("""() => { const s = JSON.parse(localStorage.getItem('rlfleet.chat'));
                s.turns.push({role: 'user', content: 'y'.repeat(200001)});
                localStorage.setItem('rlfleet.chat', JSON.stringify(s)); }""")
            await page.reload()
            await expect(page.locator("article")).to_have_count(2)
            await page.fill("#text", "again")
            await page.press("#text", "Enter")
            await expect(page.locator("article.ai").nth(1).locator(".rate .good")).to_be_visible(timeout=60_000)
            assert [role for role, _ in await stored_turns(page)] == ["user", "assistant"] * 2
            assert errors == []
    asyncio.run(go())


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium package is not installed")
def test_enter_while_an_answer_streams_waits_for_it(queued_home, web_model_dir, monkeypatch):
    """Only one answer streams at a time: Enter meanwhile sends nothing and leaves the message in the box,
    so the stored conversation keeps its order (user, assistant, user, assistant)."""
    from playwright.async_api import expect

    async def go():
        async with browsing(queued_home, web_model_dir, monkeypatch) as (state, url, page):
            await expect(page.locator("#version")).to_have_text("base model")
            answering = asyncio.Event()  # held until the test lets the first answer through

            async def hold(route) -> None:
                await answering.wait()
                await route.continue_()
            await page.route("**/api/chat", hold)
            await page.fill("#text", "one")
            await page.press("#text", "Enter")
            await expect(page.locator("article.ai.streaming")).to_have_count(1)
            await page.fill("#text", "two")
            await page.press("#text", "Enter")
            await page.wait_for_timeout(200)
            assert await page.locator("article.you").count() == 1
            assert await page.input_value("#text") == "two"
            answering.set()
            await expect(page.locator("article.ai").nth(0).locator(".rate .good")).to_be_visible(timeout=60_000)
            await expect(page.locator("#send")).to_be_enabled()
            await page.press("#text", "Enter")  # now it goes
            await expect(page.locator("article.ai").nth(1).locator(".rate .good")).to_be_visible(timeout=60_000)
            turns = await stored_turns(page)
            assert [(role, text if role == "user" else "") for role, text in turns] == [
                ("user", "one"), ("assistant", ""), ("user", "two"), ("assistant", "")]
    asyncio.run(go())


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium package is not installed")
def test_on_a_phone_the_pages_fit_the_screen_and_wide_tables_scroll_in_their_own_box(queued_home, web_model_dir,
                                                                                     monkeypatch):
    from playwright.async_api import expect

    async def go():
        async with browsing(queued_home, web_model_dir, monkeypatch,
                            viewport={"width": 375, "height": 800}) as (state, url, page):
            await slack_rating(state, "a question " * 30, -1, comment="a comment " * 20)
            await page.fill("#text", "hello")
            await page.press("#text", "Enter")
            await expect(page.locator("article.ai .rate .good")).to_be_visible(timeout=60_000)
            for path, ready in [("/", "#version"), ("/dashboard", "#serving"), ("/ratings", "#count")]:
                if path != "/":
                    await page.goto(url + path)
                await expect(page.locator(ready)).not_to_be_empty()
                width = await page.evaluate("document.documentElement.scrollWidth")
                assert width <= 375, (path, width)
                out = await page.locator("header form button").bounding_box()
                assert out and 0 <= out["x"] and out["x"] + out["width"] <= 375, (path, out)
                wide = await page.evaluate("[...document.querySelectorAll('table')].filter(t => t.offsetParent)"
                                           ".map(t => [t.id, t.scrollWidth, t.parentElement.clientWidth])")
                assert all(w > box for _, w, box in wide)  # tables wider than the screen, scrolled in a box
    asyncio.run(go())
