"""Headless Chromium driven over the DevTools protocol, with the standard library only.

`Browser` starts Debian's `chromium --headless=new` on a temporary profile with no network use
(no sync, no component updates, no first-run fetches) and a DevTools port chosen by Chromium;
`Page` is a minimal WebSocket client (RFC 6455: masked text frames out, fragmented frames and
pings in) that sends protocol commands and waits for their answers.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless=new",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--metrics-recording-only",
    "--password-store=basic",
    "--use-mock-keychain",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
]


class WebSocket:
    """A client WebSocket over a plain TCP connection (ws:// only)."""

    def __init__(self, url: str, timeout: float):
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("the DevTools socket closed during the handshake")
            head += chunk
        status, _, self.pending = head.partition(b"\r\n\r\n")
        if b" 101 " not in status.split(b"\r\n")[0]:
            raise ConnectionError(f"WebSocket handshake refused: {status[:200]!r}")

    def send(self, text: str) -> None:
        payload = text.encode()
        n = len(payload)
        head = bytes([0x81])  # FIN, text
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(head + mask + masked)

    def _read(self, n: int) -> bytes:
        while len(self.pending) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the DevTools socket closed")
            self.pending += chunk
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def recv(self) -> str:
        """The next text message (control frames answered or skipped)."""
        message = b""
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else None
            data = self._read(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise ConnectionError("the DevTools socket was closed by the browser")
            if opcode == 0x9:  # ping: answer with a masked pong
                self.sock.sendall(bytes([0x8A, 0x80 | len(data)]) + b"\0\0\0\0" + data)
                continue
            if opcode in (0x1, 0x0):
                message += data
                if b0 & 0x80:
                    return message.decode()

    def close(self) -> None:
        self.sock.close()


class Page:
    """One browser tab, driven by DevTools protocol commands."""

    def __init__(self, ws_url: str, timeout: float = 60.0):
        self.ws = WebSocket(ws_url, timeout)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []
        """Protocol events received so far (console messages, uncaught exceptions, ...)."""

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result (events that arrive meanwhile are kept)."""
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))
            if "method" in msg:
                self.events.append(msg)

    def errors(self) -> list[str]:
        """Uncaught exceptions and console errors of the page so far."""
        out = []
        for e in self.events:
            params = e.get("params", {})
            if e["method"] == "Runtime.exceptionThrown":
                out.append(json.dumps(params.get("exceptionDetails", {}))[:2000])
            elif e["method"] == "Runtime.consoleAPICalled" and params.get("type") == "error":
                out.append(json.dumps(params.get("args", []))[:2000])
        return out

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable values)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, limit_s: float = 60.0) -> Any:
        """Evaluate `expression` until it is truthy; its value. An upper bound on waiting,
        not a timing assertion: past `limit_s` the page never got there."""
        deadline = time.monotonic() + limit_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{expression!r} still {value!r} after {limit_s} s")
            time.sleep(0.1)

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def screenshot(self, path: Path) -> bytes:
        """A PNG of the whole page, written to `path`."""
        data = base64.b64decode(
            self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        )
        path.write_bytes(data)
        return data

    def close(self) -> None:
        self.ws.close()


class Browser:
    """A headless Chromium process with its own temporary profile."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 1000):
        args = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"]
        if os.geteuid() == 0:
            args.append("--no-sandbox")  # Chromium refuses to sandbox itself as root
        self.log = (profile.parent / "chromium.log").open("wb")
        self.proc = subprocess.Popen([*args, "about:blank"], stdout=self.log, stderr=self.log)
        self.port = self._devtools_port(profile / "DevToolsActivePort")

    def _devtools_port(self, port_file: Path, limit_s: float = 60.0) -> int:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}; see its log")
            if port_file.is_file():
                text = port_file.read_text().split("\n")[0].strip()
                if text.isdigit():
                    return int(text)
            time.sleep(0.1)
        raise RuntimeError(f"chromium wrote no {port_file} within {limit_s} s")

    def page(self) -> Page:
        """The browser's first tab."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list") as r:
            targets = json.load(r)
        tab = next(t for t in targets if t.get("type") == "page")
        page = Page(tab["webSocketDebuggerUrl"])
        page.call("Page.enable")
        page.call("Runtime.enable")
        return page

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
