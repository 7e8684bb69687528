"""Take the pictures in docs/dashboard.md: five queues in the dashboard, in headless
Chromium, and the same Redis in `batchgate top`.

    python scripts/dashboard_screenshot.py [OUT_DIR]   # default: docs/img

A throw-away redis-server and five queues:

- embeddings: two `batchgate consumer` processes (synthetic model, 60 ms + 4 ms per
  request, batches of up to 16), bursts of mixed priorities in waves (one request in 97
  fails on purpose), and two dead letters;
- summaries: one consumer under `--max-queue-delay-ms auto --slo-p99-ms 200` (20 ms + 1 ms
  per request), a steady ~60 requests/s;
- reports, thumbnails, audio: registered, nothing waiting (folded on the page).

After 25 s of load it writes OUT_DIR/dashboard.png (the whole page, 1200 px wide), then
prints `batchgate top --iterations 2` at 100 columns. Needs Debian's chromium
(/usr/bin/chromium) and playwright (the dev extra); no browser is downloaded.
"""

from __future__ import annotations

import math
import os
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
BUSY, AUTO = "embeddings", "summaries"
IDLE = ("reports", "thumbnails", "audio")
LOAD_S = 25


def dead_letter(url: str, client, payload) -> None:
    """Submitted with no consumer running, its delivery count set to the limit (3): the
    next pop dead-letters it, as max_attempts would."""
    with Producer(url, BUSY) as producer:
        request_id = producer.submit(payload).id
    keys = QueueKeys(BUSY)
    meta, envelope = split_job(client.hget(keys.jobs, request_id))
    client.hset(keys.jobs, request_id, format_job(replace(meta, attempts=3), envelope))


def waves(url: str, stop: threading.Event) -> None:
    rng = random.Random(7)
    with Producer(url, BUSY) as producer:
        i = 0
        while not stop.is_set():
            for _ in range(rng.randint(1, 12)):
                priority = rng.choice(["high", "normal", "normal", "low", "low", "low"])
                producer.submit({"fail": True} if i % 97 == 0 else {"text": f"doc {i}"},
                                priority=priority)
                i += 1
            time.sleep(0.02 + 0.08 * (1 + math.sin(time.time() / 2)))  # waves of load


def steady(url: str, stop: threading.Event) -> None:
    with Producer(url, AUTO) as producer:
        while not stop.is_set():
            producer.submit_many([{"text": "summarise me"}] * 3)
            time.sleep(0.05)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "img"
    batchgate = shutil.which("batchgate")
    assert batchgate, "install batchgate first (./setup.sh)"
    server = EmbeddedRedis()
    children: list[subprocess.Popen] = []
    logs = subprocess.DEVNULL
    stop = threading.Event()

    def run(*args: str) -> None:
        subprocess.run([batchgate, *args, "--redis-url", server.url], check=True,
                       stdout=logs)

    def start(*args: str) -> None:
        children.append(subprocess.Popen([batchgate, *args, "--redis-url", server.url],
                                         stdout=logs, stderr=subprocess.STDOUT))

    try:
        client = server.client()
        dead_letter(server.url, client, {"text": "a payload that crashed its consumer"})
        dead_letter(server.url, client, {"text": "another one"})
        for queue, extra in ((IDLE[0], ["--max-batch-size", "4"]),
                             (IDLE[1], ["--strategy", "dynamic", "--max-queue-delay-ms",
                                        "20"]),
                             (IDLE[2], ["--strategy", "fifo"])):
            run("policy", "set", "--queue", queue, *extra)
        for _ in range(2):
            start("consumer", "--queue", BUSY, "--model", "consumer.models:synthetic",
                  "--model-arg", "base_ms=60", "--model-arg", "per_item_ms=4",
                  "--max-batch-size", "16", "--device", "cpu")
        start("consumer", "--queue", AUTO, "--model", "consumer.models:synthetic",
              "--model-arg", "base_ms=20", "--model-arg", "per_item_ms=1",
              "--strategy", "dynamic", "--max-batch-size", "32",
              "--max-queue-delay-ms", "auto", "--slo-p99-ms", "200", "--device", "cpu")
        port = free_port()
        start("dashboard", "--port", str(port), "--token", "example-token")
        for _ in range(200):
            try:
                httpx.get(f"http://127.0.0.1:{port}/api/config", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        for load in (waves, steady):
            threading.Thread(target=load, args=(server.url, stop), daemon=True).start()
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium",
                                         args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            page.goto(f"http://127.0.0.1:{port}/")
            time.sleep(LOAD_S)
            page.screenshot(path=str(out / "dashboard.png"), full_page=True)
            browser.close()
        top = subprocess.run([batchgate, "top", "--redis-url", server.url, "--iterations",
                              "2", "--interval", "2"], capture_output=True, text=True,
                             env={**os.environ, "COLUMNS": "100"}, check=True)
        print(top.stdout)
        print(f"wrote {out / 'dashboard.png'}")
    finally:
        stop.set()
        for child in children:
            child.terminate()
        for child in children:
            child.wait(30)
        server.close()


if __name__ == "__main__":
    main()
