"""Headless Chromium driven over the Chrome DevTools Protocol (a test helper).

``Browser.launch(tmp)`` starts ``chromium --headless`` with ``--remote-debugging-port=0``,
reads the port Chromium chose from ``DevToolsActivePort``, and attaches to its page over a
websocket (the ``websockets`` package, sync client). Console errors, uncaught exceptions and
failed loads are collected as they come.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    def __init__(self, process: subprocess.Popen[bytes], ws: ClientConnection) -> None:
        self.process = process
        self.ws = ws
        self.errors: list[str] = []
        self._ids = itertools.count(1)

    @classmethod
    def launch(cls, executable: str, profile: Path, timeout: float = 30) -> Browser:
        profile.mkdir(parents=True, exist_ok=True)
        args = [
            executable,
            "--headless=new",
            "--no-sandbox",  # root in a container
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--window-size=1400,1100",
            "--remote-debugging-port=0",
            "--remote-allow-origins=*",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not port_file.exists() or not port_file.read_text().strip():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"Chromium did not start (exit code {process.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as res:
            pages = [t for t in json.load(res) if t.get("type") == "page"]
        ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=10)
        ws.__enter__()  # entered, as websockets 17 asks; closed in close()
        browser = cls(process, ws)
        for domain in ("Page", "Runtime", "Log"):
            browser.call(f"{domain}.enable")
        return browser

    def call(self, method: str, timeout: float = 30, **params: Any) -> dict[str, Any]:
        """Send a command and wait for its reply, collecting events meanwhile."""
        request_id = next(self._ids)
        self.ws.send(json.dumps({"id": request_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if message.get("id") == request_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._on_event(message)

    def _on_event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append(f"exception: {details.get('exception', {}).get('description')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = [a.get("value", a.get("description")) for a in params.get("args", [])]
            self.errors.append(f"console.{params['type']}: {args}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> Any:
        """Evaluate until the value is truthy; returns it (raises TimeoutError)."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still falsy after {timeout}s: {expression}")
            time.sleep(0.2)

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(data)
        return data

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
