"""Media URLs (``http(s)://`` image and video parts) downloaded on the event loop, within bounds.

A download is awaited on the server's event loop (httpx's async client), never run through
``asyncio.run`` in a worker thread, where it held one of the threads that parse and tokenize
every request for up to ``server.media.fetch_timeout_s``. Its bytes are counted as they arrive on
the wire: the request asks for ``Accept-Encoding: identity`` and reads the raw stream, since
httpx's decoded stream inflates a gzip / br / zstd body before it can be measured (a 1 MiB gzip
body can inflate to 1 GiB). A server that compresses anyway has its body, already bounded on the
wire, inflated on a worker thread to at most the same limit (gzip and deflate; other encodings are
refused). A gzip body whose trailer declares more than the limit is refused before a byte of it
is inflated: inflating a bomb to the limit (16 MiB by default) was a fifth of the server's CPU
under benchmarks/hostile.py's attack. The TLS context every download's client uses is built once,
on a worker thread, however many downloads start together: httpx builds one per client by
default, loading the CA bundle (90-450 ms on the event loop per download on a loaded 2-core host,
measured with benchmarks/hostile.py's URL attacks)."""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from omni_cache.config.server_schema import MediaConfig

__all__ = [
    "FetchError",
    "check_host",
    "fetch",
    "fetch_all",
    "gzip_declared_size",
    "inflate_bounded",
    "is_remote",
    "tls_context",
]


class FetchError(ValueError):
    """A URL that cannot be fetched; ``param`` names the content part."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def is_remote(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme.lower() in ("http", "https")


def check_host(url: str, param: str, part: str, limits: MediaConfig) -> None:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in limits.allowed_url_hosts:
        raise FetchError(
            f"{part} from host {host or '(none)'!r} is not fetched (this server "
            "fetches only from server.media.allowed_url_hosts); send a data: URL",
            param,
        )


async def fetch_all(
    urls: dict[str, tuple[str, str, int]],
    limits: MediaConfig,
    too_large: Callable[[int], str],
    off_loop: Callable[..., Awaitable[Any]] = asyncio.to_thread,
) -> dict[str, bytes]:
    """``{url: (param, part, limit)}`` -> ``{url: body}``, downloaded at once; the first failure
    raises and the other downloads are cancelled (nothing keeps running for a refused request).
    ``off_loop(fn, *args)`` runs a compressed body's inflating (the server's media threads)."""
    tasks = {asyncio.ensure_future(fetch(url, *how, limits, too_large, off_loop)): url for url, how in urls.items()}
    if not tasks:
        return {}
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
    return {url: task.result() for task, url in tasks.items()}  # the first failure raises


async def fetch(
    url: str,
    param: str,
    part: str,
    limit: int,
    limits: MediaConfig,
    too_large: Callable[[int], str],
    off_loop: Callable[..., Awaitable[Any]] = asyncio.to_thread,
) -> bytes:
    """The body at an allowed http(s) ``url``, within ``fetch_timeout_s`` for all of it and
    ``limit`` bytes on the wire and inflated; FetchError naming ``param`` otherwise."""
    check_host(url, param, part, limits)
    try:
        # httpx's timeouts bound each operation (connect, each read); a server trickling a
        # byte at a time would pass them all. The deadline bounds the whole download.
        async with asyncio.timeout(limits.fetch_timeout_s):
            raw, encoding = await _download(url, param, limit, limits.fetch_timeout_s, too_large)
    except TimeoutError:
        raise FetchError(
            f"{part} could not be fetched within {limits.fetch_timeout_s:g} s (server.media.fetch_timeout_s)", param
        ) from None
    except httpx.HTTPError as e:
        raise FetchError(f"{part} could not be fetched ({type(e).__name__}: {e})", param) from None
    if encoding in ("", "identity"):
        return raw
    inflated = await off_loop(inflate_bounded, raw, encoding, limit, param)
    if inflated is None:
        raise FetchError(too_large(limit) + f" once its {encoding} body is inflated", param)
    return inflated


_tls: ssl.SSLContext | None = None
#: The build in progress and the loop it runs for (a test may serve from several loops in turn).
_building: tuple[asyncio.AbstractEventLoop, asyncio.Future[ssl.SSLContext]] | None = None


async def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context (its CA bundle), built once off the event loop: the downloads
    that start before it is ready wait for the same build (each made its own before: 16 at once
    under benchmarks/hostile.py's first attack, 13% of the server's CPU samples)."""
    global _tls, _building
    if _tls is not None:
        return _tls
    loop = asyncio.get_running_loop()
    if _building is None or _building[0] is not loop:
        _building = (loop, asyncio.ensure_future(asyncio.to_thread(httpx.create_ssl_context)))
    try:
        context = await asyncio.shield(_building[1])  # a cancelled download leaves it to the others
    except Exception:
        _building = None  # the next download tries again
        raise
    _tls = _tls or context
    return _tls


async def _download(
    url: str, param: str, limit: int, timeout_s: float, too_large: Callable[[int], str]
) -> tuple[bytes, str]:
    """The raw body of a 200 answer at ``url`` (refused once it passes ``limit`` bytes) and its
    Content-Encoding."""
    async with (
        httpx.AsyncClient(follow_redirects=False, timeout=timeout_s, verify=await tls_context()) as client,
        client.stream("GET", url, headers={"Accept-Encoding": "identity"}) as resp,
    ):
        if resp.is_redirect:
            raise FetchError(
                f"media URL could not be fetched (redirect to {resp.headers.get('location', '?')} refused: "
                "it could lead off server.media.allowed_url_hosts)",
                param,
            )
        if resp.status_code != 200:
            raise FetchError(f"media URL could not be fetched (HTTP {resp.status_code} {resp.reason_phrase})", param)
        declared = resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise FetchError(too_large(limit), param)
        data = bytearray()
        async for chunk in resp.aiter_raw():  # as sent: counted before anything is inflated
            data += chunk
            if len(data) > limit:
                raise FetchError(too_large(limit), param)
        return bytes(data), resp.headers.get("content-encoding", "").strip().lower()


def gzip_declared_size(data: bytes) -> int | None:
    """What a gzip body's trailer says its last member inflates to (ISIZE: its bytes mod 2**32;
    None: not gzip). The whole body inflates to at least that much, unless the trailer lies, which
    zlib would refuse once it got there; a body of 4 GiB or more may declare less (the bounded
    inflation still stops it)."""
    if len(data) < 18 or data[:2] != b"\x1f\x8b":  # a header and a trailer at least
        return None
    return int.from_bytes(data[-4:], "little")


def inflate_bounded(data: bytes, encoding: str, limit: int, param: str | None = None) -> bytes | None:
    """A gzip / deflate body inflated to at most ``limit`` bytes (None when it holds more: zlib
    stops there, so a bomb never expands in memory; a gzip body whose trailer declares more is not
    inflated at all); FetchError for another encoding."""
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise FetchError(
            f"media URL answered with Content-Encoding {encoding!r}; only gzip and deflate are read "
            "(this server asks for identity)",
            param,
        )
    if encoding != "deflate" and (gzip_declared_size(data) or 0) > limit:
        return None
    try:
        out = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding != "deflate" else zlib.MAX_WBITS).decompress(
            data, limit + 1
        )
    except zlib.error as e:
        raise FetchError(f"media URL's {encoding} body could not be inflated ({e})", param) from None
    return None if len(out) > limit else out
