"""Take docs/img/dashboard.png: a busy queue in the dashboard, in headless Chromium.

    python scripts/dashboard_screenshot.py [OUT.png]

A throw-away redis-server, two `batchgate consumer` processes (synthetic model, 60 ms +
4 ms per request, batches of up to 16), a producer sending bursts of mixed priorities
(one request in 97 fails on purpose), two dead letters, and the dashboard with a token;
the page is photographed after 25 s. Needs Debian's chromium (/usr/bin/chromium) and
playwright (the dev extra); no browser is downloaded.
"""

from __future__ import annotations

import math
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

from batchgate.embedded import EmbeddedRedis, free_port
from producer import Producer
from scheduler_core.keys import QueueKeys
from scheduler_core.wire import format_job, split_job

ROOT = Path(__file__).resolve().parents[1]
QUEUE = "embeddings"


def dead_letter(url: str, client, payload) -> None:
    """Submitted with no consumer running, its delivery count set to the limit (3): the
    next pop dead-letters it, as max_attempts would."""
    with Producer(url, QUEUE) as producer:
        request_id = producer.submit(payload).id
    keys = QueueKeys(QUEUE)
    meta, envelope = split_job(client.hget(keys.jobs, request_id))
    client.hset(keys.jobs, request_id, format_job(replace(meta, attempts=3), envelope))


def load(url: str, stop: threading.Event) -> None:
    rng = random.Random(7)
    with Producer(url, QUEUE) as producer:
        i = 0
        while not stop.is_set():
            for _ in range(rng.randint(1, 12)):
                priority = rng.choice(["high", "normal", "normal", "low", "low", "low"])
                producer.submit({"fail": True} if i % 97 == 0 else {"text": f"doc {i}"},
                                priority=priority)
                i += 1
            time.sleep(0.02 + 0.08 * (1 + math.sin(time.time() / 2)))  # waves of load


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "img" / "dashboard.png"
    batchgate = shutil.which("batchgate")
    assert batchgate, "install batchgate first (./setup.sh)"
    server = EmbeddedRedis()
    children: list[subprocess.Popen] = []
    logs = subprocess.DEVNULL
    stop = threading.Event()
    try:
        client = server.client()
        dead_letter(server.url, client, {"text": "a payload that crashed its consumer"})
        dead_letter(server.url, client, {"text": "another one"})
        for _ in range(2):
            children.append(subprocess.Popen(
                [batchgate, "consumer", "--redis-url", server.url, "--queue", QUEUE,
                 "--model", "consumer.models:synthetic", "--model-arg", "base_ms=60",
                 "--model-arg", "per_item_ms=4", "--max-batch-size", "16", "--device", "cpu"],
                stdout=logs, stderr=subprocess.STDOUT))
        port = free_port()
        children.append(subprocess.Popen(
            [batchgate, "dashboard", "--redis-url", server.url, "--port", str(port),
             "--token", "example-token"], stdout=logs, stderr=subprocess.STDOUT))
        for _ in range(200):
            try:
                httpx.get(f"http://127.0.0.1:{port}/api/config", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        threading.Thread(target=load, args=(server.url, stop), daemon=True).start()
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium",
                                         args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1200, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/")
            time.sleep(25)
            page.screenshot(path=str(out), full_page=True)
            browser.close()
        print(f"wrote {out}")
    finally:
        stop.set()
        for child in children:
            child.terminate()
        for child in children:
            child.wait(30)
        server.close()


if __name__ == "__main__":
    main()
