"""The dashboard's FastAPI app: live metrics, benchmark runs and history, and the page.

Endpoints (all JSON; `/api/*` answers carry `Cache-Control: no-store`):

    GET    /api/health                       the dashboard is up (+ whether the engine is)
    GET    /api/info                         engine URL, model, auth mode, run kinds
    GET    /api/metrics                      the latest poll: gauges and derived rates
    GET    /api/metrics/history?limit=N      the server-side ring of points
    GET    /api/runs                         every kind's run state and the active kind
    GET    /api/runs/{kind}                  one kind's state and log
    POST   /api/runs/{kind}                  start (202), 409 while any run is active
    POST   /api/runs/{kind}/cancel           end it and its children
    GET    /api/history/{kind}               records (ETag / 304)
    GET    /api/history/{kind}/{id}          one record as a download
    DELETE /api/history/{kind}/{id}          delete one record
    POST   /api/history/{kind}/clear         delete all records of a kind

Every request passes `gate.Gate` first, which decides from the headers alone, before any body is
read: the token wherever one is required (reachable from other machines, or a token set), for
reading `/api/` as much as for changes (only /api/health and /api/info stay open); on loopback
without a token, a loopback Host (and Origin, for changes), so a web page or a DNS-rebinding
name can neither drive nor read it; bodies of at most 64 KiB and JSON at most 16 levels deep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

from vllmstack.bench.client.row import ROW_KINDS, RowError, rows_of
from vllmstack.bench.report import history
from vllmstack.core import access
from vllmstack.core.errors import StackError
from vllmstack.dashboard.gate import Gate, authorized, header_map
from vllmstack.dashboard.live import LiveMetrics
from vllmstack.dashboard.runs import (
    RUN_KINDS,
    RUN_RECORD_FILE,
    CommandBuilder,
    RunBusyError,
    RunError,
    RunManager,
    RunNotActiveError,
    bench_command,
)
from vllmstack.observe.metrics import metrics_url
from vllmstack.serve.boot_history import read_boots_in

STATIC_DIR = Path(__file__).parent / "static"
HISTORY_KINDS = ("bench", "depth", "conc")
# The boots the page lists (results/boot_history.jsonl, `invoke startup --history`).
BOOTS_SHOWN = 5
# Long strings (raw logs) are cut in listings; the download has them whole.
LIST_STRING_LIMIT = 2000

FetchText = Callable[[], Awaitable[str]]


class DashboardError(StackError, ValueError):
    """Settings the dashboard cannot run with; the message names the setting and the fix."""


@dataclass
class DashboardSettings:
    engine_url: str
    history_dir: Path
    host: str = "127.0.0.1"
    port: int = 8083
    # Where users reach it: in a container the app binds 0.0.0.0 while the host publishes
    # the port on 127.0.0.1. The token rule follows this address.
    exposure: str | None = None
    token: str = ""
    model: str | None = None
    tokenizer: str | None = None
    max_num_seqs: int | None = None
    poll_interval: float = 1.0
    max_backoff: float = 8.0
    ring_size: int = 900
    run_timeouts: dict[str, float] = field(default_factory=dict)
    cancel_grace: float = 5.0
    python: str = sys.executable
    # `invoke router`'s URL: the page shows its resident model, queue and recent swaps.
    router_url: str = "http://127.0.0.1:8080"
    router_token: str = ""
    # Where the running benchmark is recorded, so a dashboard started after this one was killed
    # finds it (dashboard.runs); default: the history folder.
    state_dir: Path | None = None

    @property
    def run_record_path(self) -> Path:
        return (self.state_dir or self.history_dir) / RUN_RECORD_FILE

    @property
    def exposed_on(self) -> str:
        return self.exposure or self.host

    @property
    def auth_required(self) -> bool:
        return access.token_required(self.exposed_on, self.token)

    def validate(self) -> None:
        if access.exposed_without_token(self.exposed_on, self.token):
            raise DashboardError(
                f"the dashboard would listen on {self.exposed_on}, reachable from other machines, "
                "without a token; set DASHBOARD_TOKEN in .env (any long random string, e.g. "
                "`python -c 'import secrets; print(secrets.token_urlsafe(24))'`) or bind it to "
                "127.0.0.1 (DASHBOARD_BIND; in a container that binds 0.0.0.0 behind a loopback "
                "port, pass that address with --exposure)"
            )
        if self.poll_interval <= 0:
            raise DashboardError(f"poll interval must be positive, got {self.poll_interval}")
        parts = urlsplit(self.engine_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise DashboardError(
                f"engine URL {self.engine_url!r} is not an http(s) URL; "
                "pass e.g. --engine-url http://127.0.0.1:8180")


def _clean(value: Any) -> Any:
    """JSON cannot carry NaN or infinities; the page shows them as missing."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _shorten(record: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cut: list[str] = []
    for key, value in record.items():
        if isinstance(value, str) and len(value) > LIST_STRING_LIMIT:
            out[key] = value[:LIST_STRING_LIMIT] + "…"
            cut.append(key)
        else:
            out[key] = value
    if cut:
        out["_truncated"] = cut
    return out


def _typed_rows(kind: str, record: dict[str, Any], where: str) -> dict[str, Any]:
    """The record with its bench rows as `BenchRow` writes them (every field's key, old rows
    included). A row this checkout cannot read (a newer row version, a key of the wrong type) is
    not guessed at: the record goes out as stored, with `_unread` saying why."""
    if kind not in ROW_KINDS:
        return record
    try:
        rows = rows_of(record, where)
    except RowError as exc:
        return {**record, "_unread": exc.cause}
    return {**record, "results": [row.to_json() for row in rows]}


def _file_tag(path: Path) -> str:
    parts = []
    for candidate in (path, history.rotated_path(path)):
        try:
            st = candidate.stat()
            parts.append(f"{st.st_size}-{st.st_mtime_ns}")
        except FileNotFoundError:
            parts.append("0")
    return '"' + ":".join(parts) + '"'


def _json_safe(value: Any) -> Any:
    """`value` if JSON can carry it, else its text (NaN and infinities are not JSON)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)
    return value


class RunOptions(BaseModel):
    """What a page may choose for a run; everything else comes from the profile.

    Strict: `true` is not a number and "8" is not a count (JSON has types; a page that sends the
    wrong one has a bug worth seeing), NaN and infinities are refused, and a field this API does
    not know is a 422 naming it rather than an option silently ignored.
    """

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    pp: int | None = Field(default=None, ge=1, le=1_000_000)
    tg: int | None = Field(default=None, ge=1, le=1_000_000)
    runs: int | None = Field(default=None, ge=1, le=100)
    duration: float | None = Field(default=None, gt=0, le=86_400)
    max_num_seqs: int | None = Field(default=None, ge=1, le=65_536)


def create_app(
    settings: DashboardSettings,
    *,
    fetch_text: FetchText | None = None,
    build_command: CommandBuilder | None = None,
    poll: bool = True,
    environ: Mapping[str, str] | None = None,
) -> FastAPI:
    """The app. `fetch_text` (the /metrics body) and `build_command` (a run's argv) are injectable."""
    settings.validate()
    live = LiveMetrics(settings.engine_url, interval=settings.poll_interval,
                       max_backoff=settings.max_backoff, ring_size=settings.ring_size)
    poll_lock = asyncio.Lock()
    model_cache: dict[str, Any] = {"at": 0.0, "value": None}

    # One client per event loop, kept open: a new client per poll costs ~100 ms (TLS context,
    # new connection) — ten times the budget of a poll.
    clients: dict[int, httpx.AsyncClient] = {}

    async def engine_client() -> httpx.AsyncClient:
        loop = id(asyncio.get_running_loop())
        client = clients.get(loop)
        if client is None:
            client = clients[loop] = httpx.AsyncClient(timeout=2.0)
        return client

    async def close_client() -> None:
        client = clients.pop(id(asyncio.get_running_loop()), None)
        if client is not None:
            await client.aclose()

    async def default_fetch() -> str:
        client = await engine_client()
        response = await client.get(metrics_url(settings.engine_url))
        if response.status_code != 200:
            raise RuntimeError(f"{metrics_url(settings.engine_url)} answered HTTP "
                               f"{response.status_code}")
        return response.text

    fetch = fetch_text or default_fetch

    async def poll_once() -> dict[str, Any]:
        async with poll_lock:
            try:
                text = await fetch()
            except Exception as exc:  # any failure to read the engine is "engine down"
                detail = str(exc) or exc.__class__.__name__
                return live.record(None, time.time(),
                                   f"cannot read {metrics_url(settings.engine_url)}: {detail}")
            return live.record(text, time.time())

    async def poll_forever() -> None:
        while True:
            try:
                await poll_once()
            except Exception as exc:  # a bug in one poll must not end live metrics for good
                print(f"dashboard: metrics poll failed: {exc!r}", file=sys.stderr, flush=True)
            await asyncio.sleep(live.next_delay())

    def engine_models() -> dict[str, Any]:
        """The engine's /v1/models card (cached a minute), or {} when it does not answer."""
        now = time.monotonic()
        if model_cache["value"] is not None and now - model_cache["at"] < 60:
            return dict(model_cache["value"])
        try:
            response = httpx.get(settings.engine_url.rstrip("/") + "/v1/models", timeout=3.0)
            data = response.json().get("data") or []
            card = data[0] if data and isinstance(data[0], dict) else {}
        except (httpx.HTTPError, ValueError, AttributeError):
            return {}
        model_cache.update(at=now, value=card)
        return dict(card)

    def model_name() -> str:
        if settings.model:
            return settings.model
        name = engine_models().get("id")
        if not name:
            raise RunError(
                f"the engine at {settings.engine_url} did not say which model it serves "
                "(GET /v1/models); start the engine, or start the dashboard with --model NAME")
        return str(name)

    builder = build_command or bench_command(
        python=settings.python, engine_url=settings.engine_url,
        history_dir=settings.history_dir, model=model_name, tokenizer=settings.tokenizer,
        max_num_seqs=settings.max_num_seqs)
    child_env = dict(environ) if environ is not None else None
    if child_env is not None:
        child_env.setdefault("PYTHONUNBUFFERED", "1")
    runs = RunManager(builder, timeouts=settings.run_timeouts, grace_s=settings.cancel_grace,
                      env=child_env, record_path=settings.run_record_path)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(poll_forever()) if poll else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await close_client()
            await asyncio.to_thread(runs.shutdown)

    app = FastAPI(title="vllmstack dashboard", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.settings = settings
    app.state.live = live
    app.state.runs = runs
    app.state.poll_once = poll_once

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the input back; a NaN there makes the 422 itself fail
        # to serialize (a 500). Say where and what, and echo only JSON-safe input.
        detail = [{"loc": list(err.get("loc", ())), "msg": err.get("msg", ""),
                   "type": err.get("type", ""), "input": _json_safe(err.get("input"))}
                  for err in exc.errors()]
        return JSONResponse(status_code=422, content={"detail": detail})

    @app.middleware("http")
    async def no_store(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        if request.url.path.startswith("/api/"):
            response.headers["Cache-Control"] = "no-store"
        return response

    def signed_in(request: Request) -> bool:
        """The request may see everything (the gate let the other routes through already)."""
        return authorized(header_map(request.scope), token=settings.token,
                          required=settings.auth_required)

    def check_kind(kind: str, kinds: tuple[str, ...]) -> None:
        if kind not in kinds:
            raise HTTPException(404, f"unknown kind {kind!r}; known: {', '.join(kinds)}")

    @app.get("/api/health")
    async def health(request: Request) -> dict[str, Any]:
        latest = live.latest or {}
        answer = {"ok": True, "engine_up": bool(latest.get("engine_up"))}
        return {**answer, "engine_url": settings.engine_url} if signed_in(request) else answer

    @app.get("/api/info")
    async def info(request: Request) -> dict[str, Any]:
        if not signed_in(request):
            # Enough for the page to ask for the token; nothing about the engine or the runs.
            return {"auth_required": True, "authorized": False, "exposed_on": settings.exposed_on,
                    "run_kinds": list(RUN_KINDS), "history_kinds": list(HISTORY_KINDS)}
        card = await asyncio.to_thread(engine_models)
        return {
            "engine_url": settings.engine_url,
            "model": settings.model or card.get("id"),
            "max_model_len": card.get("max_model_len"),
            "max_num_seqs": settings.max_num_seqs,
            "auth_required": settings.auth_required,
            "authorized": True,
            "exposed_on": settings.exposed_on,
            "run_kinds": list(RUN_KINDS),
            "history_kinds": list(HISTORY_KINDS),
            "active_run": runs.active,
            "poll_interval": settings.poll_interval,
        }

    @app.get("/api/router")
    async def router() -> dict[str, Any]:
        """The router's /v1/health (resident model, every model's state, queue, recent swaps),
        or {"running": false} when no router answers."""
        headers = ({"Authorization": f"Bearer {settings.router_token}"}
                   if settings.router_token else {})
        try:
            client = await engine_client()
            response = await client.get(settings.router_url.rstrip("/") + "/v1/health",
                                        headers=headers, timeout=1.0)
            data = response.json()
        except (httpx.HTTPError, ValueError):
            return {"running": False, "url": settings.router_url}
        if not isinstance(data, dict) or "loaded" not in data:
            return {"running": False, "url": settings.router_url}
        return {"running": True, "url": settings.router_url, **_json_safe(data)}

    @app.get("/api/boots")
    async def boots() -> dict[str, Any]:
        """The last boots `up` recorded (serve.boot_history), newest last: the boot card."""
        records, skipped = await asyncio.to_thread(read_boots_in, settings.history_dir, BOOTS_SHOWN)
        return {"skipped": skipped, "boots": [
            {"recorded": r.recorded, "profile": r.profile, "slot": r.slot,
             **{k: v for k, v in r.boot.as_json().items() if k != "notes"}} for r in records]}

    @app.get("/api/metrics")
    async def metrics() -> Any:
        latest = live.latest or await poll_once()
        return JSONResponse(_clean(latest))

    @app.get("/api/metrics/history")
    async def metrics_history(limit: int = 900) -> Any:
        return JSONResponse({"points": _clean(live.history(max(0, limit)))})

    @app.get("/api/runs")
    async def all_runs() -> dict[str, Any]:
        return {"active": runs.active, "runs": runs.states()}

    @app.get("/api/runs/{kind}")
    async def run_state(kind: str) -> dict[str, Any]:
        check_kind(kind, RUN_KINDS)
        return runs.state(kind)

    @app.post("/api/runs/{kind}", status_code=202)
    async def start_run(kind: str, options: RunOptions | None = None) -> Any:
        check_kind(kind, RUN_KINDS)
        # Fail fast before any thread hop: the claim itself is atomic in RunManager.
        if runs.active is not None:
            raise HTTPException(409, str(RunBusyError(runs.active)))
        opts = options.model_dump(exclude_none=True) if options else {}
        try:
            state = await asyncio.to_thread(runs.start, kind, opts)
        except RunBusyError as exc:
            raise HTTPException(409, str(exc)) from exc
        except RunError as exc:
            raise HTTPException(503, str(exc)) from exc
        return JSONResponse(state, status_code=202)

    @app.post("/api/runs/{kind}/cancel")
    async def cancel_run(kind: str) -> dict[str, Any]:
        check_kind(kind, RUN_KINDS)
        try:
            return await asyncio.to_thread(runs.cancel, kind)
        except RunNotActiveError as exc:
            raise HTTPException(409, str(exc)) from exc

    def history_file(kind: str) -> Path:
        check_kind(kind, HISTORY_KINDS)
        return history.history_path(settings.history_dir, kind)

    @app.get("/api/history/{kind}")
    async def history_list(kind: str, request: Request) -> Any:
        path = history_file(kind)
        tag = _file_tag(path)
        if request.headers.get("if-none-match") == tag:
            return Response(status_code=304, headers={"ETag": tag})
        def listing() -> list[dict[str, Any]]:
            records = history.read_records(path, include_rotated=True)
            return [_clean(_shorten(_typed_rows(kind, r, f"{path.name} record "
                                                         f"{r.get('id', f'#{n}')}")))
                    for n, r in enumerate(records, start=1)]

        body = {"kind": kind, "records": await asyncio.to_thread(listing)}
        return JSONResponse(body, headers={"ETag": tag})

    def find_record(path: Path, record_id: str) -> dict[str, Any]:
        for record in history.read_records(path, include_rotated=True):
            if history.record_matches(record, record_id):
                return record
        raise HTTPException(404, f"no record {record_id!r} in {path.name}")

    @app.get("/api/history/{kind}/{record_id}")
    async def history_download(kind: str, record_id: str) -> Any:
        record = await asyncio.to_thread(find_record, history_file(kind), record_id)
        safe = "".join(ch for ch in record_id if ch.isalnum() or ch in "-_")[:64] or "record"
        return Response(
            json.dumps(_clean(record), indent=2, ensure_ascii=False) + "\n",
            media_type="application/json",
            headers={"Content-Disposition": f'attachment; filename="{kind}-{safe}.json"'},
        )

    @app.delete("/api/history/{kind}/{record_id}")
    async def history_delete(kind: str, record_id: str) -> dict[str, Any]:
        path = history_file(kind)
        if not await asyncio.to_thread(history.delete_record, path, record_id):
            raise HTTPException(404, f"no record {record_id!r} in {path.name}")
        return {"deleted": record_id}

    @app.post("/api/history/{kind}/clear")
    async def history_clear(kind: str) -> dict[str, Any]:
        return {"removed": await asyncio.to_thread(history.clear, history_file(kind))}

    # Last, so the API routes win: the page and its assets.
    app.mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="static")
    # Added last, so it is the outermost layer: it answers before anything reads the body.
    app.add_middleware(Gate, token=settings.token, required=settings.auth_required)
    return app
