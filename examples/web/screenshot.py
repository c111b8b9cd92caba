#!/usr/bin/env python3
"""Open the demo page in headless Chromium (through ChromeDriver's WebDriver API, stdlib only),
wait until its run against the CPU reference and then its training run have finished, save a
screenshot and fail unless the page says every result is within tolerance and that the tiny
model learned its text. Then open it again with WebGPU off, and fail unless both parts of the
page say so in one clear line. Usage: screenshot.py OUT.png (serves examples/web itself; the
page must be built: scripts/web-demo --build-only)."""

import base64
import functools
import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["value"]


NO_ADAPTER = "This browser offers no WebGPU adapter"


def main(out):
    (kind, status, report), (train_kind, train_status) = visit(out, webgpu=True)
    print(f"status: {status}\n{report}\ntraining: {train_status}")
    if kind != "ok":
        sys.exit(f"the demo page did not finish within tolerance: {status}")
    if train_kind != "ok":
        sys.exit(f"the demo page's training did not learn its text: {train_status}")
    (kind, status, _), (train_kind, train_status) = visit(None, webgpu=False)
    print(f"without WebGPU: {status}\ntraining without WebGPU: {train_status}")
    if kind != "error" or NO_ADAPTER not in status:
        sys.exit(f"without WebGPU the page must say there is no adapter, not: {status!r}")
    if train_kind != "error" or NO_ADAPTER not in train_status:
        sys.exit(f"without WebGPU the training must say there is no adapter, not: {train_status!r}")


def visit(out, webgpu):
    page_port, driver_port = free_port(), free_port()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(HERE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", page_port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    driver = subprocess.Popen(["chromedriver", f"--port={driver_port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{driver_port}"
    try:
        for _ in range(100):
            try:
                call(base, "GET", "/status")
                break
            except OSError:
                time.sleep(0.1)
        args = json.loads((HERE / "webdriver.json").read_text())["goog:chromeOptions"]["args"]
        if not webgpu:
            args = [a for a in args if a != "--enable-unsafe-webgpu"]
        args += ["--headless=new", "--no-sandbox", "--window-size=1100,1300",
                 "--user-data-dir=/tmp/hesper-web-screenshot"]
        caps = {"capabilities": {"alwaysMatch": {"goog:chromeOptions": {"args": args}}}}
        session = call(base, "POST", "/session", caps)["sessionId"]
        s = f"/session/{session}"
        try:
            call(base, "POST", s + "/url", {"url": f"http://127.0.0.1:{page_port}/index.html"})
            script = {"script": "const $ = (id) => document.getElementById(id);"
                                "return [$('status').className, $('status').textContent,"
                                " $('report').textContent,"
                                " $('train-status').className, $('train-status').textContent];",
                      "args": []}
            # The check takes seconds; the training ~2 minutes on SwiftShader (its first step
            # compiles 50 pipelines, ~75 s), the page's --dev build a little more.
            deadline = time.time() + 420
            while True:
                kind, status, report, train_kind, train_status = call(
                    base, "POST", s + "/execute/sync", script)
                done = ("ok", "error")
                if (kind in done and train_kind in done) or time.time() > deadline:
                    break
                time.sleep(0.5)
            if out:
                png = call(base, "GET", s + "/screenshot")
                Path(out).write_bytes(base64.b64decode(png))
        finally:
            call(base, "DELETE", s)
    finally:
        driver.terminate()
        server.shutdown()
    return (kind, status, report), (train_kind, train_status)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "demo.png")
