"""A tiny HTTP client for simulator tests: JSON calls and timestamped SSE lines (stdlib only)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Stream:
    status: int
    headers: dict[str, str]
    sent_at: float
    # (seconds since the request was sent, the SSE line without its trailing blank line)
    lines: list[tuple[float, str]] = field(default_factory=list)

    def events(self) -> list[dict[str, Any]]:
        """The JSON payloads of the `data:` lines, without the final [DONE]."""
        out = []
        for _, line in self.lines:
            payload = line.removeprefix("data: ")
            if payload != "[DONE]":
                out.append(json.loads(payload))
        return out


def _connect(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout), parts.path


def call(url: str, path: str, body: Any = None, method: str | None = None,
         timeout: float = 30.0) -> Reply:
    conn, prefix = _connect(url, timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json"} if data is not None else {}
        conn.request(method or ("POST" if data is not None else "GET"), prefix + path,
                     body=data, headers=headers)
        response = conn.getresponse()
        return Reply(response.status, response.read(),
                     {k.lower(): v for k, v in response.getheaders()})
    finally:
        conn.close()


def stream(url: str, path: str, body: dict[str, Any], timeout: float = 60.0) -> Stream:
    """POST with stream=true and record when each SSE line arrived."""
    conn, prefix = _connect(url, timeout)
    try:
        sent = time.monotonic()
        conn.request("POST", prefix + path, body=json.dumps({**body, "stream": True}).encode(),
                     headers={"content-type": "application/json"})
        response = conn.getresponse()
        result = Stream(response.status, {k.lower(): v for k, v in response.getheaders()},
                        sent)
        while True:
            raw = response.readline()
            if not raw:
                break
            line = raw.decode().rstrip("\n")
            if line:
                result.lines.append((time.monotonic() - sent, line))
        return result
    finally:
        conn.close()
