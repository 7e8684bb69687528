"""`batchgate dashboard`: its HTTP API against a real Redis, and the page in a real,
headless Chromium (Debian's, driven by Playwright) with a real consumer."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import orjson
import pytest
from helpers.processes import BATCHGATE, ConsumerProcess, free_port
from helpers.servers import ServerProcess
from helpers.support import wait_for

from producer import Producer
from scheduler_core.keys import QueueKeys
from scheduler_core.registry import register_queue
from scheduler_core.wire import format_job, split_job

pytest.importorskip("fastapi")

TOKEN = "s3cret-token"
CHROMIUM = next((p for p in (os.environ.get("BATCHGATE_CHROMIUM"), shutil.which("chromium"),
                             "/usr/bin/chromium") if p and os.path.exists(p)), None)
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "img" / "dashboard.png"


def start_dashboard(redis_url: str, *extra: str) -> ServerProcess:
    port = free_port()
    return ServerProcess([BATCHGATE, "dashboard", "--redis-url", redis_url, "--port", str(port),
                          *extra], port, ready_path="/api/config")


@contextlib.contextmanager
def queue_card(redis_url: str, queue: str) -> Iterator:
    """A dashboard on `queue` in Chromium: the queue's card, unfolded (skips without
    Playwright or Chromium)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if CHROMIUM is None:
        pytest.skip("no chromium")
    server = start_dashboard(redis_url, "--queue", queue)
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM,
                                         args=["--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page(viewport={"width": 1200, "height": 1100})
                page.goto(server.url + "/")
                card = page.locator(f"section.queue[data-queue='{queue}']")
                card.locator("h2").click()
                yield card
            finally:
                browser.close()
    finally:
        server.close()


@pytest.fixture
def dashboards() -> Iterator:
    started: list[ServerProcess] = []

    def start(redis_url: str, *extra: str) -> ServerProcess:
        server = start_dashboard(redis_url, *extra)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def dead_letter(redis_url: str, client, queue: str, payload) -> str:
    """A request dead-lettered the way max_attempts does it: submitted with no consumer
    running, its delivery count then set to the limit (3), so the next pop gives up."""
    with Producer(redis_url, queue) as producer:
        handle = producer.submit(payload)
        request_id = handle.id
    keys = QueueKeys(queue)
    meta, envelope = split_job(client.hget(keys.jobs, request_id))
    client.hset(keys.jobs, request_id, format_job(replace(meta, attempts=3), envelope))
    return request_id


def events(url: str, count: int) -> list[dict]:
    """The first `count` data messages of the server-sent event stream."""
    out = []
    with httpx.stream("GET", url + "/events", timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.append(orjson.loads(line[6:]))
                if len(out) == count:
                    break
    return out


def test_the_feed_lists_every_registered_queue_and_actions_need_the_token(
        shared_redis, queue, start_consumer, dashboards):
    other = queue + "-b"
    start_consumer(shared_redis.url, queue, "--model", "consumer.models:noop")
    with Producer(shared_redis.url, other) as producer:
        producer.submit({"i": 1})  # no consumer on this one: it waits
    client = shared_redis.client()
    dead = dead_letter(shared_redis.url, client, queue, {"i": "dead"})
    wait_for(lambda: client.zcard(QueueKeys(queue).dead) == 1, 15, "the dead letter")
    read_only = dashboards(shared_redis.url)
    feed = events(read_only.url, 3)
    names = {s["queue"] for s in feed[-1]["queues"]}
    assert {queue, other} <= names
    by_name = {s["queue"]: s for s in feed[-1]["queues"]}
    assert by_name[other]["depth"]["normal"] == 1
    assert by_name[queue]["consumers"][0]["host"]
    assert [d["id"] for d in by_name[queue]["dead"]["shown"]] == [dead]
    # Updates on its own every --interval (0.5 s): fresh snapshots, the gaps bounded by
    # ten intervals (slack for a host whose cores are all busy; the rate is not timed here).
    gaps = [b["at"] - a["at"] for a, b in zip(feed, feed[1:], strict=False)]
    assert min(gaps) > 0 and max(gaps) < 10 * 0.5, gaps
    # Read-only: every action is refused, and nothing changes.
    for path, body in (("dead-letters/retry", {"ids": [dead]}), ("dead-letters/purge",
                                                                  {"all": True}),
                       ("policy", {"max_batch_size": 4})):
        answer = httpx.post(f"{read_only.url}/api/queues/{queue}/{path}", json=body,
                            headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 403 and "--token" in answer.json()["error"]
    assert client.hget(QueueKeys(queue).policy, "max_batch_size") == b"32"
    assert client.zcard(QueueKeys(queue).dead) == 1

    with_token = dashboards(shared_redis.url, "--token", TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    url = f"{with_token.url}/api/queues/{queue}/policy"
    assert httpx.post(url, json={"max_batch_size": 4}).status_code == 401
    assert httpx.post(url, json={"max_batch_size": 4},
                      headers={"Authorization": "Bearer wrong-token"}).status_code == 401
    bad = httpx.post(url, json={"max_batch_size": 0}, headers=auth)
    assert bad.status_code == 400 and bad.json()["field"] == "max_batch_size"
    text = httpx.post(url, json={"max_batch_size": "abc"}, headers=auth)
    assert text.status_code == 400 and text.json()["field"] == "max_batch_size"
    unknown = httpx.post(url, json={"batch": 3}, headers=auth)
    assert unknown.status_code == 400 and unknown.json()["field"] == "batch"
    assert client.hget(QueueKeys(queue).policy, "max_batch_size") == b"32"  # nothing written
    good = httpx.post(url, json={"max_batch_size": 4}, headers=auth)
    assert good.status_code == 200 and good.json()["policy"]["max_batch_size"] == 4
    assert client.hget(QueueKeys(queue).policy, "max_batch_size") == b"4"
    purge_url = f"{with_token.url}/api/queues/{queue}/dead-letters/purge"
    assert httpx.post(purge_url, json={"ids": []}, headers=auth).status_code == 400
    assert httpx.post(purge_url, json={"ids": [dead]}, headers=auth).json() == {
        "purged": 1, "skipped": 0}
    assert client.zcard(QueueKeys(queue).dead) == 0
    assert not client.hexists(QueueKeys(queue).jobs, dead)


def test_the_page_works_behind_a_path_prefix(shared_redis, queue, dashboards):
    with Producer(shared_redis.url, queue) as producer:
        producer.submit({"i": 1})
    server = dashboards(shared_redis.url, "--root-path", "/bg")
    page = httpx.get(server.url + "/bg/")
    assert page.status_code == 200
    # Every URL in the page is relative: it resolves under the prefix.
    for ref in ('href="static/dashboard.css"', 'src="static/dashboard.js"'):
        assert ref in page.text
    assert "http" not in page.text.replace('charset="utf-8"', "")
    assert httpx.get(server.url + "/bg/static/dashboard.js").status_code == 200
    script = httpx.get(server.url + "/bg/static/dashboard.js").text
    assert 'fetch("api/config")' in script and 'new EventSource("events")' in script
    assert "//" not in "".join(line.split("//")[0] for line in script.splitlines()
                               if "http" in line.split("//")[0])  # no absolute URL
    snap = httpx.get(server.url + "/bg/api/snapshot").json()
    assert queue in {s["queue"] for s in snap["queues"]}
    # A proxy that keeps its prefix and says so in X-Forwarded-Prefix, no --root-path.
    plain = dashboards(shared_redis.url)
    answer = httpx.get(plain.url + "/proxy/api/config",
                       headers={"X-Forwarded-Prefix": "/proxy"})
    assert answer.status_code == 200 and "actions" in answer.json()
    assert httpx.get(plain.url + "/api/config").status_code == 200  # one that strips it


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install "
                    "chromium; CI installs it): the browser test needs a real browser")
def test_the_page_shows_depth_live_and_retries_a_dead_letter(shared_redis, queue,
                                                              dashboards, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    client = shared_redis.client()
    dead = dead_letter(shared_redis.url, client, queue, {"i": "dead"})
    server = dashboards(shared_redis.url, "--token", TOKEN, "--queue", queue)
    consumer = None
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM,
                                     args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 1100})
            page.goto(server.url + "/")
            card = page.locator(f"section.queue[data-queue='{queue}']")
            normal = card.locator("[data-f='depth.normal']")
            sync_api.expect(normal).to_have_text("1", timeout=10_000)  # the one to die
            # Unfolded by a click on its title: it stays so when the queue turns idle.
            card.locator("h2").click()
            sync_api.expect(card).to_have_class(re.compile(r"\bopen\b"))

            # Submitted with no consumer: the page shows the depth rise, without reload.
            with Producer(shared_redis.url, queue) as producer:
                handles = [producer.submit({"i": i}, priority="high") for i in range(40)]
                sync_api.expect(card.locator("[data-f='depth.high']")).to_have_text(
                    "40", timeout=5_000)
                # Drained by a real consumer (4 per batch, 0.5 s each): it falls, live.
                consumer = ConsumerProcess(shared_redis.url, queue, "--model",
                                           "consumer.models:synthetic", "--model-arg",
                                           "base_ms=500", "--max-batch-size", "4",
                                           "--device", "cpu").wait_ready()
                depths, shot = [], os.environ.get("BATCHGATE_SCREENSHOT")
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    depth = int(card.locator("[data-f='depth.high']").inner_text())
                    if not depths or depths[-1] != depth:
                        depths.append(depth)
                    if shot and 0 < depth <= 24:  # docs/img/dashboard.png: a busy queue
                        page.screenshot(path=shot, full_page=True)
                        shot = None
                    if depth == 0:
                        break
                    time.sleep(0.05)
                # Several steps down to 0 seen in one page load: updated without reload.
                assert depths[-1] == 0 and len(depths) >= 4, depths
                assert depths == sorted(depths, reverse=True), depths
                row = card.locator(".consumers tbody tr")
                sync_api.expect(row).to_have_count(1, timeout=10_000)
                sync_api.expect(row).to_contain_text("cpu")  # its --device
                for handle in handles:
                    handle.result(timeout=30)

            # The dead letter: listed, retried with the token after the confirmation.
            row = card.locator(f".dead tbody tr[data-id='{dead}']")
            sync_api.expect(row).to_have_count(1, timeout=10_000)
            page.fill("#token", TOKEN)
            questions: list[str] = []

            def answer(dialog) -> None:
                questions.append(dialog.message)
                dialog.accept()

            page.on("dialog", answer)
            row.locator("button.retry").click()
            sync_api.expect(row).to_have_count(0, timeout=10_000)
            assert questions == [f"Retry request {dead} of queue {queue}?"]
            sync_api.expect(page.locator("#notice")).to_contain_text('"retried":1')
            sync_api.expect(card.locator("[data-f='dead_letters']")).to_have_text("0")

            # The policy, changed from the page: confirmed, then shown as stored.
            card.locator(".policy-edit summary").click()
            card.locator(".policy-form input[name='max_batch_size']").fill("8")
            card.locator(".policy-form button[type='submit']").click()
            sync_api.expect(card.locator(".policy-line")).to_contain_text(
                "max_batch_size=8", timeout=10_000)
            assert questions[-1] == f"Change the policy of queue {queue}?"
        finally:
            browser.close()
            if consumer is not None:
                consumer.close()
    assert client.zcard(QueueKeys(queue).dead) == 0
    assert client.hget(QueueKeys(queue).policy, "max_batch_size") == b"8"
    wait_for(lambda: client.exists(QueueKeys(queue).result(dead)), 15,
             "the retried request's result")


def test_a_trailing_slash_is_not_redirected_to_the_host_header(shared_redis, dashboards):
    """A redirect built from the client's Host header would send a browser (or a cache
    keyed without Host) to another site: paths are matched as written, no redirect."""
    for server, prefix in ((dashboards(shared_redis.url), ""),
                           (dashboards(shared_redis.url, "--root-path", "/bg"), "/bg")):
        with httpx.Client(base_url=server.url, headers={"Host": "evil.example"}) as http:
            for path in ("/api/config/", "/api/snapshot/", "/events/", "/static"):
                answer = http.get(prefix + path)
                assert answer.status_code == 404, (prefix + path, answer.status_code)
                assert "location" not in answer.headers
            assert http.get(prefix + "/api/config").status_code == 200


def test_the_feed_says_when_redis_cannot_be_read(redis_server, queue, dashboards):
    with Producer(redis_server.url, queue) as producer:
        producer.submit({"i": 1})
    server = dashboards(redis_server.url, "--queue", queue)
    assert events(server.url, 1)[0]["queues"][0]["queue"] == queue
    redis_server.close()
    message = events(server.url, 2)[-1]  # the first may be the one read before
    assert message["error"].startswith("cannot read Redis") and "queues" not in message
    assert server.proc.poll() is None  # still serving: the page shows the error


def test_the_page_ships_in_the_wheel():
    """Everything the page loads is package data (pyproject.toml), in one flat folder."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    assert "dashboard/static/*" in data["tool"]["setuptools"]["package-data"]["batchgate"]
    static = root / "batchgate" / "dashboard" / "static"
    assert {p.name for p in static.iterdir()} == {"index.html", "dashboard.js",
                                                   "dashboard.css"}
    page = (static / "index.html").read_text() + (static / "dashboard.js").read_text()
    assert "https://" not in page and "http://" not in page.replace(
        "http://www.w3.org/2000/svg", "")  # no CDN: nothing loaded from elsewhere


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install "
                    "chromium; CI installs it): the browser test needs a real browser")
def test_the_page_under_a_prefix_is_read_only_without_a_token(shared_redis, queue,
                                                               dashboards):
    sync_api = pytest.importorskip("playwright.sync_api")
    client = shared_redis.client()
    dead_letter(shared_redis.url, client, queue, {"i": "dead"})
    server = dashboards(shared_redis.url, "--root-path", "/bg", "--queue", queue)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM,
                                     args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            requested: list[str] = []
            page.on("request", lambda request: requested.append(request.url))
            page.goto(server.url + "/bg/")
            card = page.locator(f"section.queue[data-queue='{queue}']")
            sync_api.expect(card.locator("[data-f='depth.normal']")).to_have_text(
                "1", timeout=10_000)
            sync_api.expect(page.locator("#mode")).to_have_text("read-only")
            assert not page.locator("#token").is_visible()
            for action in (".retry-all", ".purge-all", ".policy-edit"):
                assert not card.locator(action).is_visible(), action
            # Everything the page loaded came from under the prefix, nothing from elsewhere.
            assert requested and all(u.startswith(server.url + "/bg/") for u in requested), \
                requested
        finally:
            browser.close()


def served_snapshot(html: str) -> dict:
    found = re.search(r'<script id="snapshot" type="application/json">(.*?)</script>', html)
    assert found, html
    return orjson.loads(found.group(1))


def test_the_page_comes_with_the_snapshot_busy_queues_first(shared_redis, queue,
                                                            dashboards):
    """The page as served holds the current snapshot (nothing to wait for), busy queues
    first; what the data holds cannot end the script it rides in."""
    idle, busy = queue + "-a", queue + "-b"
    register_queue(shared_redis.client(), idle)
    with Producer(shared_redis.url, busy) as producer:
        producer.submit({"text": "waits"})
    message = "</script><script>alert(1)</script>"  # as a model's exception may say
    shared_redis.client().lpush(QueueKeys(busy).failures, orjson.dumps(
        {"id": "x", "type": "ValueError", "message": message, "at_ms": 1}))
    server = dashboards(shared_redis.url, "--queue", idle, "--queue", busy)
    html = httpx.get(server.url + "/").text
    snap = served_snapshot(html)
    assert [(q["queue"], q["busy"]) for q in snap["queues"]] == [(busy, True), (idle, False)]
    assert snap["queues"][0]["depth"]["normal"] == 1
    assert snap["queues"][0]["policy_text"] == "no policy yet"
    assert snap["queues"][0]["recent_failures"][0]["message"] == message
    assert html.count("</script>") == 2  # the page's own two scripts, nothing more
    assert [q["queue"] for q in httpx.get(server.url + "/api/snapshot").json()["queues"]] == \
        [busy, idle]


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install "
                    "chromium; CI installs it): the browser test needs a real browser")
def test_the_page_is_complete_without_the_live_feed(shared_redis, queue, dashboards,
                                                    start_consumer):
    """With the live feed blocked, the page still shows every queue's figures and charts
    (from the snapshot it was served with): busy first, idle folded to its title until a
    click, each chart's axes labelled with their units."""
    sync_api = pytest.importorskip("playwright.sync_api")
    idle, busy = queue + "-a", queue + "-b"
    start_consumer(shared_redis.url, idle, "--model", "consumer.models:noop",
                   "--max-batch-size", "4")
    with Producer(shared_redis.url, idle) as producer:
        assert all(h.result(timeout=30) for h in producer.submit_many(
            [{"i": i} for i in range(6)]))
    with Producer(shared_redis.url, busy) as producer:
        producer.submit_many([{"i": i} for i in range(3)], priority="high")
    server = dashboards(shared_redis.url, "--queue", idle, "--queue", busy)
    time.sleep(6)  # past the rates' window: the idle queue's batches are behind it
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM,
                                     args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            blocked: list[str] = []
            page.route("**/events", lambda route: (blocked.append(route.request.url),
                                                   route.abort()))
            page.goto(server.url + "/")
            cards = page.locator("section.queue")
            sync_api.expect(cards).to_have_count(2, timeout=10_000)
            assert [cards.nth(i).get_attribute("data-queue") for i in range(2)] == \
                [busy, idle]
            first = page.locator(f"section.queue[data-queue='{busy}']")
            sync_api.expect(first.locator("[data-f='depth.high']")).to_have_text("3")
            assert blocked  # the live feed never answered: all of it came with the page
            # The idle queue: its title only, until a click unfolds it.
            folded = page.locator(f"section.queue[data-queue='{idle}']")
            sync_api.expect(folded).to_have_class(re.compile(r"\bfolded\b"))
            assert folded.locator("h2").is_visible()
            assert not folded.locator(".figures").is_visible()
            sync_api.expect(folded.locator(".idle-note")).to_have_text("idle")
            folded.locator("h2").click()
            assert folded.locator(".figures").is_visible()
            sync_api.expect(folded.locator(".policy-line")).to_have_text(
                "strategy=priority max_batch_size=4 max_queue_delay_ms=50")
            sync_api.expect(folded.locator("[data-f='delay_text']")).to_have_text("50 ms")
            # Every chart: a y label and an x label with units, and the range of each.
            for chart, y, x, ends in (
                    (".depth-chart", "requests waiting", "time (s)", ("−30 s", "now")),
                    (".size-chart", "batches", "batch size (requests)", ("1", "4"))):
                plot = folded.locator(".plot", has=page.locator(chart))
                sync_api.expect(plot.locator(".y-label")).to_have_text(y)
                sync_api.expect(plot.locator(".x-label")).to_have_text(x)
                sync_api.expect(plot.locator(".x-left")).to_have_text(ends[0])
                sync_api.expect(plot.locator(".x-right")).to_have_text(ends[1])
                assert re.fullmatch(r"[\d,]+", plot.locator(".y-top").inner_text())
        finally:
            browser.close()


def test_the_policy_action_on_an_auto_queue_applies_the_delay_posted(shared_redis, queue):
    # The dashboard's action is the same change as `policy set`: a number for
    # max_queue_delay_ms switches an auto queue to that fixed delay, "auto" back again
    # (the fixed delay kept). The app in-process, against a real Redis.
    from fastapi.testclient import TestClient

    from batchgate.dashboard.app import create_app
    from scheduler_core.admin import read_policy, store_policy
    from scheduler_core.policy import Policy

    client = shared_redis.client()
    store_policy(client, queue, Policy.build("dynamic", max_queue_delay_ms="auto",
                                             slo_p99_ms=60), replace=True)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(client, token=TOKEN)) as http:
        url = f"/api/queues/{queue}/policy"
        answer = http.post(url, json={"max_queue_delay_ms": 7}, headers=auth)
        assert answer.status_code == 200, answer.text
        assert (answer.json()["policy"]["delay_mode"],
                answer.json()["policy"]["max_queue_delay_ms"]) == ("fixed", 7)
        stored = read_policy(client, queue)
        assert (stored.delay_mode, stored.max_queue_delay_ms) == ("fixed", 7)
        back = http.post(url, json={"max_queue_delay_ms": "auto"}, headers=auth)
        assert back.status_code == 200, back.text
        stored = read_policy(client, queue)
        assert (stored.delay_mode, stored.max_queue_delay_ms) == ("auto", 7)


@pytest.mark.parametrize("strategy", ["evil", "", 5, ["fifo"], {"a": 1}])
def test_the_policy_action_refuses_an_unknown_strategy_naming_it(shared_redis, queue,
                                                                  strategy):
    """A strategy the policy does not know is a 400 naming the field, and nothing is
    stored (it was a 500: the change looked the strategy up before validating it)."""
    from fastapi.testclient import TestClient

    from batchgate.dashboard.app import create_app
    from scheduler_core.admin import read_policy, store_policy
    from scheduler_core.policy import Policy

    client = shared_redis.client()
    store_policy(client, queue, Policy.build("dynamic"), replace=True)
    before = read_policy(client, queue)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(client, token=TOKEN)) as http:
        answer = http.post(f"/api/queues/{queue}/policy", json={"strategy": strategy},
                           headers=auth)
    assert answer.status_code == 400, answer.text
    assert answer.json()["field"] == "strategy"
    assert read_policy(client, queue) == before


def test_actions_on_a_queue_outside_the_queue_option_are_refused(shared_redis, queue):
    """Started with --queue, the dashboard acts on those queues only: a policy change,
    retry or purge on another is a 404 naming it, and none of its keys change (the
    policy action used to write any queue's policy)."""
    from fastapi.testclient import TestClient

    from batchgate.dashboard.app import create_app
    from scheduler_core.admin import store_policy
    from scheduler_core.policy import Policy

    client = shared_redis.client()
    other = queue + "-outside"
    store_policy(client, other, Policy.build("dynamic"), replace=True)
    request_id = dead_letter(shared_redis.url, client, other, {"i": "dead"})
    client.zadd(QueueKeys(other).dead, {request_id: 1})  # listed as dead, as a pop does

    def keys_of(name: str) -> dict[bytes, bytes]:
        return {k: client.dump(k) for k in client.scan_iter(match=f"{{bg:{name}}}:*")}

    before = keys_of(other)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(client, token=TOKEN, only=[queue])) as http:
        for path, body in (("policy", {"max_batch_size": 4}),
                           ("dead-letters/retry", {"ids": [request_id]}),
                           ("dead-letters/purge", {"all": True})):
            answer = http.post(f"/api/queues/{other}/{path}", json=body, headers=auth)
            assert answer.status_code == 404, (path, answer.text)
            assert repr(other) in answer.json()["error"]
        assert keys_of(other) == before
        # The queue it was started with is still served.
        allowed = http.post(f"/api/queues/{queue}/policy", json={"max_batch_size": 4},
                            headers=auth)
        assert allowed.status_code == 200, allowed.text
