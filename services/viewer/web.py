"""The viewer's web server (aiohttp): the page, its static files and a small read-only JSON API.

aiohttp because it is asyncio-native, like the grpc.aio channels the viewer reads through (one
event loop, no thread hand-offs), well kept (aio-libs), and serves static files and JSON without
an ASGI server beside it. The page draws its charts with uPlot, vendored under ``static/vendor``
(no CDN: clusters are often offline).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import ssl
import sys
from pathlib import Path

import grpc
import pydantic
from aiohttp import web

from rlfleet.services.common import security
from rlfleet.services.common.errors import StartupError
from rlfleet.services.common.files import write_atomically
from rlfleet.services.common.logs import setup_logging
from rlfleet.services.common.upstream import upstream_settings
from rlfleet.services.credentials import upstream_files
from rlfleet.services.launch import written_address
from rlfleet.services.viewer.config import ViewerConfig, ViewerRun
from rlfleet.services.viewer.reader import BadQuery, Reader, is_refusal

log = logging.getLogger("rlfleet.viewer")
STATIC = Path(__file__).resolve().parent / "static"
TOKEN_COOKIE = "rlfleet_viewer_token"
READERS = web.AppKey("readers", dict)


def make_app(readers: dict[str, Reader] | Reader, access_tokens: dict[str, frozenset[str]] | None = None
             ) -> web.Application:
    """The viewer's app over ``readers``: one per run by name (a fleet that runs share), or one ``Reader``
    (a run): every read takes ``?run=NAME`` (default: the first)."""
    app = web.Application(middlewares=[_access(access_tokens)] if access_tokens else [])
    app[READERS] = readers if isinstance(readers, dict) else {"": readers}
    app.router.add_get("/", _index)
    app.router.add_get("/favicon.ico", _no_icon)
    app.router.add_get("/api/runs", _runs)
    app.router.add_get("/api/versions", _api(lambda r, q: r.versions(int(q.get("min_version") or 0))))
    app.router.add_get("/api/samples", _api(lambda r, q: r.samples(q)))
    app.router.add_get("/api/samples/{cursor:[0-9]+}", _sample)
    app.router.add_get("/api/stats", _api(lambda r, q: r.stats()))
    app.router.add_get("/api/status", _api(lambda r, q: r.status()))
    app.router.add_get("/api/failures", _api(lambda r, q: r.failures()))
    app.router.add_static("/static/", STATIC)
    return app


async def _no_icon(request: web.Request) -> web.Response:
    return web.Response(status=204)


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html")


async def _runs(request: web.Request) -> web.Response:
    return web.json_response({"runs": list(request.app[READERS])})


def _reader(request: web.Request) -> Reader:
    """The reader of the run the request names (``?run=``), or of the first run."""
    readers = request.app[READERS]
    run = request.query.get("run", "")
    if not run:
        return next(iter(readers.values()))
    if run not in readers:
        raise web.HTTPNotFound(text=json.dumps({"error": f"run: no run {run[:160]!r} here (runs: "
                                                         f"{', '.join(readers) or 'one, unnamed'})"}),
                               content_type="application/json")
    return readers[run]


def _api(read):
    async def handler(request: web.Request) -> web.Response:
        return await _answer(read(_reader(request), dict(request.query)))
    return handler


async def _sample(request: web.Request) -> web.Response:
    return await _answer(_reader(request).sample(int(request.match_info["cursor"])))


async def _answer(pending) -> web.Response:
    """The read's JSON, or an error the page can show: 400/404 for what it asked, 502 for an upstream
    that failed (its status code and message)."""
    try:
        return web.json_response(await pending)
    except BadQuery as exc:
        return web.json_response({"error": str(exc)}, status=400)
    except grpc.RpcError as exc:
        status = 404 if exc.code() == grpc.StatusCode.NOT_FOUND else 400 if is_refusal(exc) else 502
        return web.json_response({"error": f"{exc.code().name}: {exc.details()}"}, status=status)


def _access(tokens: dict[str, frozenset[str]]):
    """Every request carries one of ``tokens``: a bearer header, the session cookie, or ``?token=``
    (then kept in the cookie, and the address shown without it)."""

    def known(token: str | None) -> bool:
        return bool(token) and any(hmac.compare_digest(token, known) for known in tokens)

    @web.middleware
    async def middleware(request: web.Request, handler):
        header = request.headers.get("authorization", "")
        bearer = header[7:].strip() if header.lower().startswith("bearer ") else None
        offered = request.query.get("token")
        if known(offered):
            rest = request.rel_url.with_query({k: v for k, v in request.query.items() if k != "token"})
            response = web.Response(status=302, headers={"Location": str(rest)})
            response.set_cookie(TOKEN_COOKIE, offered, httponly=True, samesite="Strict", secure=request.secure)
            return response
        if known(bearer) or known(request.cookies.get(TOKEN_COOKIE)):
            return await handler(request)
        return web.json_response({"error": "UNAUTHENTICATED: open the viewer as /?token=TOKEN (a token of its "
                                           "access_tokens_file) or send authorization: Bearer TOKEN"}, status=401)

    return middleware


def ssl_context(config: ViewerConfig) -> ssl.SSLContext | None:
    if not (config.tls_cert_file or config.tls_key_file):
        return None
    if not (config.tls_cert_file and config.tls_key_file):
        missing = "tls_key_file" if config.tls_cert_file else "tls_cert_file"
        raise StartupError(f"{missing} is not set: tls_cert_file and tls_key_file go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"tls_cert_file {config.tls_cert_file} / tls_key_file {config.tls_key_file}: {exc}") \
            from None
    return context


def load_tokenizer(path: str | None):
    if path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise StartupError(f"tokenizer {path}: cannot load it ({exc})") from None


def in_suite(config: ViewerConfig) -> ViewerConfig:
    """``config`` with the addresses (and, for a secure suite, the credentials) of the ``rlfleet-suite``
    work directory ``suite_dir`` (each run's, for a suite started with ``--runs N``); StartupError if no
    trajectory service ever ran there."""
    from rlfleet.services.suite import SuiteOptions

    suite = Path(config.suite_dir)
    trajectory = written_address(suite / "trajectory", "trajectory")
    if trajectory is None:
        raise StartupError(f"suite_dir {suite}: no trajectory service has run there (no "
                           f"{suite / 'trajectory' / 'trajectory.port'}); start the suite, or rlfleet-suite --view")
    found: dict = {"trajectory_address": trajectory,
                   "collector_address": written_address(suite / "collector", "collector")}
    count = 1
    while (suite / f"trajectory-{count}").is_dir():
        count += 1
    if count > 1:  # the runs of a suite started with --runs N: each its store and collector
        options = SuiteOptions(model_dir="", runs=count)
        found["runs"] = {name: ViewerRun(trajectory_address=written_address(suite / store, "trajectory") or "",
                                         collector_address=written_address(suite / collector, "collector"))
                         for name, store, collector in zip(options.run_names(), options.run_keys("trajectory"),
                                                           options.run_keys("collector"))}
    credentials = suite / "credentials"
    if (credentials / "ca.pem").exists():
        found.update(upstream_files(credentials, "trainer", "reader"))
    return config.model_copy(update=found)


async def serve(config: ViewerConfig) -> None:
    if config.suite_dir:
        config = in_suite(config)
        log.info("suite %s: trajectory service at %s, collector at %s", config.suite_dir,
                 config.trajectory_address, config.collector_address or "(none has run)")
    settings = upstream_settings(config, config.max_message_bytes)
    tokens = security.read_tokens_file(config.access_tokens_file, "access_tokens_file") \
        if config.access_tokens_file else None
    context = ssl_context(config)
    if not security.is_loopback(config.host) and (context is None or tokens is None):
        log.warning("the viewer listens on %s without %s: anyone who reaches the port sees the samples",
                    config.host, "HTTPS and access tokens" if context is None and tokens is None
                    else "HTTPS" if context is None else "access tokens")
    tokenizer = load_tokenizer(config.tokenizer)
    runs = config.runs or {"": ViewerRun(trajectory_address=config.trajectory_address,
                                         collector_address=config.collector_address)}
    readers = {name: Reader(run.trajectory_address, run.collector_address, settings, tokenizer)
               for name, run in runs.items()}
    runner = web.AppRunner(make_app(readers, tokens), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, ssl_context=context)
    await site.start()
    port = runner.addresses[0][1]
    if config.port_file:
        write_atomically(config.port_file, str(port), mode=0o644)  # whole or absent: a launcher polls for it
    log.info("viewer serving on %s://%s:%d", "https" if context else "http", config.host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        for reader in readers.values():
            await reader.close()


def run(argv=None) -> None:
    try:
        config = ViewerConfig.load(argv)
    except pydantic.ValidationError as exc:
        _refuse(str(exc))
    setup_logging("viewer", config.log_level, config.log_format)
    try:
        asyncio.run(serve(config))
    except StartupError as exc:
        _refuse(str(exc))


def _refuse(why: str):
    print(f"rlfleet-viewer: refusing to start: {why}", file=sys.stderr)
    raise SystemExit(2)
