"""The byte pipe from the engine to the client: one relay thread per forwarded request.

The event loop parses requests and schedules loads; the answer's bytes do not pass through it.
A relay thread connects to the engine (`Connection: close`), sends the request, rewrites only the
response head (hop-by-hop headers), then loops on a blocking recv from the engine and a send to
the client: no SSE parsing, no buffering, chunked encoding passes through as it is. Measured on
a 16-core host, such a loop adds ~12 µs per streamed chunk, an asyncio protocol pipe ~20 µs
(each a wake-up, a recv and a send; the loop's own bookkeeping is the difference).

The relay writes to a duplicate of the client's socket descriptor (so a descriptor number reused
after the client left can never be written to), and only while the loop writes nothing to that
client. A client that goes away (a failed send, or the loop seeing the connection close) ends
the relay and closes the engine connection at once, which is how vLLM and llama-server learn to
abort the request. A client that reads slowly blocks the relay, and so the engine's socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import select
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vllmstack.router.http import (
    HOP_BY_HOP,
    MAX_HEAD,
    READ_SIZE,
    Connection,
    Request,
    UpstreamError,
    response_head,
)

POLL_MS = 200  # how often a relay blocked on a slow client looks whether it was cancelled


@dataclass
class Outcome:
    answered: bool  # the engine's response head reached the client
    complete: bool  # ...and its whole body, as framed (else the client connection must close)
    error: str = ""


def rewrite_head(head: bytes, keep_alive: bool) -> tuple[bytes, str, int | None, bool]:
    """The engine's response head for the client: (head, framing "length"|"chunked"|"close",
    Content-Length, whether the client connection may stay open)."""
    status_line, *lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 502
    headers = [(n, v.strip()) for n, _, v in (line.partition(":") for line in lines)]
    kept = [(n, v) for n, v in headers if n.lower() not in ("connection", "keep-alive")]
    names = {n.lower(): v for n, v in headers}
    length = names.get("content-length", "")
    if status in (204, 304) or 100 <= status < 200:
        length = "0"
    if length.isdigit():
        framing, size = "length", int(length)
    elif "chunked" in names.get("transfer-encoding", "").lower():
        framing, size = "chunked", None
    else:
        framing, size = "close", None
        keep_alive = False  # the body ends when the engine closes: so must we
    if not keep_alive:
        kept.append(("connection", "close"))
    return response_head(status, kept), framing, size, keep_alive


class Relay:
    """One forwarded request, run in a relay thread."""

    def __init__(self, client_fd: int, host: str, port: int, payload: bytes) -> None:
        self.client_fd = os.dup(client_fd)
        self.host, self.port, self.payload = host, port, payload
        self.upstream: socket.socket | None = None
        self.cancelled = False
        self.keep_alive = True
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """From the loop: the client left. Unblocks a recv waiting on the engine."""
        with self._lock:
            self.cancelled = True
            if self.upstream is not None:
                with contextlib.suppress(OSError):
                    self.upstream.shutdown(socket.SHUT_RDWR)

    def run(self) -> Outcome:
        try:
            return self._run()
        finally:
            os.close(self.client_fd)
            if self.upstream is not None:
                self.upstream.close()

    def _run(self) -> Outcome:
        try:
            up = _connect(self.host, self.port)
        except OSError as exc:
            return Outcome(False, False, f"cannot connect to {self.host}:{self.port} "
                                         f"({exc.strerror or exc})")
        with self._lock:
            self.upstream = up
            if self.cancelled:
                return Outcome(False, False, "the client left")
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(READ_SIZE)
        view = memoryview(buf)
        try:
            up.sendall(self.payload)
            head = b""
            while (end := head.find(b"\r\n\r\n")) < 0:
                n = up.recv_into(buf)
                if not n or len(head) > MAX_HEAD:
                    return Outcome(False, False, f"{self.host}:{self.port} closed the connection "
                                                 "without an answer")
                head += view[:n]
        except OSError as exc:
            return Outcome(False, False, f"{self.host}:{self.port}: {exc.strerror or exc}")
        new_head, framing, left, self.keep_alive = rewrite_head(head[:end], self.keep_alive)
        rest = head[end + 4:]
        if not self._send(new_head + rest):
            return Outcome(True, False, "the client left")
        tail = rest[-5:]
        if left is not None:
            left -= len(rest)
        # The hot loop: every piece the engine sends goes to the client as it is.
        while left is None or left > 0:
            try:
                n = up.recv_into(buf)
            except OSError:
                n = 0
            if not n:
                break
            if not self._send(view[:n]):
                return Outcome(True, False, "the client left")
            if left is not None:
                left -= n
            elif framing == "chunked":
                tail = (tail + view[max(0, n - 5):n].tobytes())[-5:]
        complete = (left is not None and left <= 0) or (framing == "chunked" and tail == b"0\r\n\r\n")
        return Outcome(True, complete or framing == "close")

    def _send(self, data: bytes | memoryview) -> bool:
        """All of `data` to the client (its descriptor is non-blocking: it belongs to the loop's
        transport); False when the client is gone or the relay was cancelled."""
        view = memoryview(data)
        poller: select.poll | None = None
        while view:
            try:
                view = view[os.write(self.client_fd, view):]
            except BlockingIOError:
                if poller is None:
                    poller = select.poll()
                    poller.register(self.client_fd, select.POLLOUT)
                while not poller.poll(POLL_MS):
                    if self.cancelled:
                        return False
            except OSError:  # EPIPE, ECONNRESET: the client left
                return False
            if self.cancelled:
                return False
        return True


def _connect(host: str, port: int) -> socket.socket:
    """A connected socket; a numeric IPv4 address (the engine's) skips getaddrinfo."""
    try:
        socket.inet_aton(host)
    except OSError:
        return socket.create_connection((host, port))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.connect((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class RelayPool:
    """Relay threads, started as needed and kept for the next request (a thread start costs
    more than a hand-over)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        self._jobs.put(job)
        if start:
            threading.Thread(target=self._work, name="router-relay", daemon=True).start()

    def _work(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


async def forward(client: Connection, request: Request, host: str, port: int, body: bytes,
                  pool: RelayPool, drop: frozenset[str] = frozenset()) -> None:
    """Send `request` (with `body`) to the engine at host:port and pipe its answer to `client`.
    UpstreamError when the engine cannot be reached or closes without answering."""
    lines = [f"{request.method} {request.target} HTTP/1.1", f"host: {host}:{port}"]
    lines += [f"{name}: {value}" for name, value in request.raw_headers
              if name.lower() not in HOP_BY_HOP and name.lower() not in drop]
    lines += ["connection: close", f"content-length: {len(body)}"]
    payload = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    transport = client.transport
    if transport is None or client.closed:
        return
    while transport.get_write_buffer_size():  # an earlier answer still leaving: keep the order
        await asyncio.sleep(0.001)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Outcome] = loop.create_future()
    relay = Relay(transport.get_extra_info("socket").fileno(), host, port, payload)
    relay.keep_alive = client.keep_alive

    def job() -> None:
        outcome = Outcome(False, False, "the relay failed")
        try:
            outcome = relay.run()
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(_settle, done, outcome)

    client.relay = relay
    pool.submit(job)
    try:
        outcome = await done
    finally:
        client.relay = None
    client.keep_alive = relay.keep_alive and outcome.complete
    if not outcome.answered and not relay.cancelled:
        raise UpstreamError(outcome.error)


def _settle(done: asyncio.Future[Outcome], outcome: Outcome) -> None:
    if not done.done():
        done.set_result(outcome)
