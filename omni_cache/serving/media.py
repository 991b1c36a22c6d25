"""Images and audio clips in chat requests: OpenAI content parts -> decoded arrays, with limits.

Two content-part types carry media, as in OpenAI's chat API:

* ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``: PNG, JPEG, WebP,
  GIF (first frame) or BMP, decoded by Pillow into ``uint8 [H, W, 3]`` RGB. ``http(s)://`` URLs
  are fetched (by httpx) only from the hosts ``server.media.allowed_url_hosts`` lists (none by
  default), without following redirects (one could lead to another host), within
  ``fetch_timeout_s`` for the whole download and ``max_item_bytes``; ``file://`` and every other
  scheme are refused.
* ``{"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav" | "mp3"}}``:
  decoded by libsndfile (``soundfile``), mixed down to mono and resampled with libsoxr to the
  thinker's feature-extractor rate (16 kHz for Qwen3-Omni), ``float32 [n]``.

Video parts (``video_url``, ``input_video``) are refused: the thinker stage takes images and audio.
Everything is checked before it is decoded in full: the encoded size
(``server.media.max_item_bytes``), the number of items (``max_items``), an image's pixel count from
its header (``max_image_pixels``), a clip's duration and sample rate from its header
(``max_audio_seconds``, 1 kHz to 384 kHz). A violation is a :class:`MediaError` (HTTP 400 naming
the content part). Nothing here is unpickled; the decoders are maintained libraries.

Reading and decoding are two steps, so that what an item will hold is known before it is decoded:
:meth:`MediaDecoder.read_all` takes each part's bytes (base64, or the fetch) and checks its header,
which gives its decoded size (:attr:`EncodedItem.decoded_bytes`: an image's pixels x 3, a clip's
samples at the target rate x 4); the server reserves that much of ``server.max_media_bytes_in_flight``
(omni_cache/runtime/admission.py) and only then :meth:`MediaDecoder.decode_all` decodes.

Every item gets a ``digest``: sha256 of what decides its decoded array (kind, target rate, encoded
bytes). It keys :class:`DecodedCache` (``server.media.decoded_cache_bytes``: a repeated image is not
decoded again) and travels to the thinker as the item's vLLM ``multi_modal_uuids`` entry, so vLLM
neither hashes the pixels again nor runs its processor for an item it has seen (its processor cache
and prefix-cache keys use the UUID). Clients cannot set it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import numpy as np

from omni_cache.config.schema import MediaConfig
from omni_cache.runtime.requests import AUDIO, IMAGE, MediaItem

if TYPE_CHECKING:
    from omni_cache.serving.chat_request import MediaPart

#: Sample rates a clip may have (Hz): below, it is not audio; above, resampling costs too much.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1000, 384000
AUDIO_FORMATS = ("wav", "mp3")
#: Content-part types that name a modality this server does not take.
REFUSED_PARTS = {"video_url": "video", "input_video": "video", "file": "file"}


class MediaError(ValueError):
    """A media item that cannot be used; ``param`` names the content part (OpenAI's error field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class DecodedCache:
    """Decoded items by digest, least recently used dropped first, at most ``max_bytes`` of
    arrays (an item larger than that is not kept). Shared by the server's request threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self._items: OrderedDict[str, MediaItem] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_decode(self, digest: str, decode: Callable[[], MediaItem]) -> MediaItem:
        with self._lock:
            item = self._items.get(digest)
            if item is not None:
                self._items.move_to_end(digest)
                self.hits += 1
                return item
        item = decode()  # outside the lock: decoding takes milliseconds to seconds
        item.digest = digest
        item.array.setflags(write=False)
        size = item.array.nbytes
        with self._lock:
            if size <= self.max_bytes and digest not in self._items:
                self._items[digest] = item
                self.nbytes += size
                while self.nbytes > self.max_bytes:
                    _, old = self._items.popitem(last=False)
                    self.nbytes -= old.array.nbytes
        return item

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class EncodedItem:
    """One image or clip of a request, read and checked from its header, not decoded yet."""

    kind: str  # IMAGE | AUDIO
    data: bytes
    param: str
    digest: str
    #: The bytes its decoded array will hold (uint8 RGB pixels, float32 samples at the rate).
    decoded_bytes: int
    fmt: str = ""  # audio: "wav" | "mp3"


@dataclass
class MediaDecoder:
    limits: MediaConfig = field(default_factory=MediaConfig)
    #: The rate clips are resampled to (the thinker's feature extractor's).
    audio_sample_rate: int = 16000
    #: Where decoded items are kept between requests (None: decode every time).
    cache: DecodedCache | None = None

    def read_all(self, parts: Sequence[MediaPart]) -> list[EncodedItem]:
        """A request's media parts read and checked from their headers, in order (nothing
        decoded); MediaError for the first that cannot be used."""
        if len(parts) > self.limits.max_items:
            raise MediaError(f"the request has {len(parts)} images and audio clips; at most "
                             f"{self.limits.max_items} are accepted (server.media.max_items)", "messages")
        return [self.read_image(p.part.image_url.url, p.param + ".image_url.url") if p.kind == IMAGE
                else self.read_audio(p.part.input_audio.data, p.part.input_audio.format,
                                     p.param + ".input_audio")
                for p in parts]

    def decode_all(self, items: Sequence[EncodedItem]) -> list[MediaItem]:
        """Items :meth:`read_all` returned, decoded in order (through the decoded-item cache)."""
        return [self._cached(item) for item in items]

    def image(self, url: str, param: str) -> MediaItem:
        """One image part read and decoded."""
        return self._cached(self.read_image(url, param))

    def audio(self, data_b64: str, fmt: str, param: str) -> MediaItem:
        """One audio part read and decoded."""
        return self._cached(self.read_audio(data_b64, fmt, param))

    def read_image(self, url: str, param: str) -> EncodedItem:
        from PIL import Image, UnidentifiedImageError

        data = self._image_bytes(url, param)
        try:
            with Image.open(io.BytesIO(data)) as img:
                w, h = img.size  # from the header: nothing decoded yet
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise MediaError(_undecodable_image(e), param) from None
        if w * h > self.limits.max_image_pixels:
            raise MediaError(f"image is {w}x{h} pixels; at most {self.limits.max_image_pixels} "
                             "pixels are accepted (server.media.max_image_pixels)", param)
        return EncodedItem(IMAGE, data, param, _digest(IMAGE, 0, data), w * h * 3)

    def read_audio(self, data_b64: str, fmt: str, param: str) -> EncodedItem:
        import soundfile as sf

        if fmt not in AUDIO_FORMATS:
            raise MediaError(f"input_audio.format {fmt!r} is not supported (supported: "
                             f"{', '.join(AUDIO_FORMATS)})", param + ".format")
        data = self._b64(data_b64, param + ".data")
        try:
            info = sf.info(io.BytesIO(data))
        except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as e:
            raise MediaError(f"audio could not be decoded as {fmt} ({e})", param) from None
        if not MIN_SAMPLE_RATE <= info.samplerate <= MAX_SAMPLE_RATE:
            raise MediaError(f"audio sample rate {info.samplerate} Hz is outside "
                             f"{MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz", param)
        if info.frames / info.samplerate > self.limits.max_audio_seconds:
            raise MediaError(f"audio is {info.frames / info.samplerate:.1f} s long; at most "
                             f"{self.limits.max_audio_seconds:g} s are accepted "
                             "(server.media.max_audio_seconds)", param)
        samples = -(-info.frames * self.audio_sample_rate // info.samplerate)  # at the target rate
        return EncodedItem(AUDIO, data, param, _digest(AUDIO, self.audio_sample_rate, data),
                           samples * 4, fmt)

    def _decode(self, item: EncodedItem) -> MediaItem:
        return self._decode_image(item) if item.kind == IMAGE else self._decode_audio(item)

    def _decode_image(self, item: EncodedItem) -> MediaItem:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(item.data)) as img:
                # convert() copies even an RGB image: only one that is not RGB is converted
                rgb = np.asarray(img if img.mode == "RGB" else img.convert("RGB"), dtype=np.uint8)
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise MediaError(_undecodable_image(e), item.param) from None
        if rgb.ndim != 3 or rgb.shape[0] == 0 or rgb.shape[1] == 0:
            raise MediaError("image has no pixels", item.param)
        return MediaItem(IMAGE, np.ascontiguousarray(rgb))

    def _decode_audio(self, item: EncodedItem) -> MediaItem:
        import soundfile as sf

        fmt, param = item.fmt, item.param
        try:
            samples, rate = sf.read(io.BytesIO(item.data), dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as e:
            raise MediaError(f"audio could not be decoded as {fmt} ({e})", param) from None
        if samples.shape[0] == 0:
            raise MediaError("audio has no samples", param)
        mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
        if rate != self.audio_sample_rate:
            import soxr

            mono = soxr.resample(mono, rate, self.audio_sample_rate)
        return MediaItem(AUDIO, np.ascontiguousarray(mono, dtype=np.float32), self.audio_sample_rate)

    def _cached(self, encoded: EncodedItem) -> MediaItem:
        if self.cache is None or self.cache.max_bytes == 0:
            item = self._decode(encoded)
            item.digest = encoded.digest
            return item
        return self.cache.get_or_decode(encoded.digest, lambda: self._decode(encoded))

    # ---- bytes ---------------------------------------------------------------------------------
    def _image_bytes(self, url: str, param: str) -> bytes:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "data":
            head, sep, payload = url.partition(",")
            if not sep or not head.endswith(";base64"):
                raise MediaError("a data: URL must be base64 (data:image/<type>;base64,...)", param)
            return self._b64(payload, param)
        if scheme in ("http", "https"):
            return self._fetch(url, param)
        raise MediaError(f"image_url scheme {scheme + ':' if scheme else '(none)'} is not accepted; "
                         "send a data: URL (base64)", param)

    def _b64(self, text: str, param: str) -> bytes:
        # 4 base64 characters carry 3 bytes: refuse before decoding what is too large anyway.
        if len(text) > (self.limits.max_item_bytes + 2) // 3 * 4 + 4:
            raise MediaError(self._too_large(), param)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("not valid base64", param) from None
        if not data:
            raise MediaError("the media item is empty", param)
        return data

    def _fetch(self, url: str, param: str) -> bytes:
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        if host not in self.limits.allowed_url_hosts:
            raise MediaError(f"image_url from host {host or '(none)'!r} is not fetched (this server "
                             "fetches only from server.media.allowed_url_hosts); send a data: URL",
                             param)
        try:
            # httpx's timeouts bound each operation (connect, each read); a server trickling a
            # byte at a time would pass them all. The deadline bounds the whole download.
            return asyncio.run(asyncio.wait_for(self._download(url, param), self.limits.fetch_timeout_s))
        except TimeoutError:
            raise MediaError(f"image URL could not be fetched within {self.limits.fetch_timeout_s:g} s "
                             "(server.media.fetch_timeout_s)", param) from None
        except httpx.HTTPError as e:
            raise MediaError(f"image URL could not be fetched ({type(e).__name__}: {e})", param) from None

    async def _download(self, url: str, param: str) -> bytes:
        """The body of a 200 answer at ``url``, refused once it exceeds ``max_item_bytes``."""
        limit = self.limits.max_item_bytes
        async with (httpx.AsyncClient(follow_redirects=False, timeout=self.limits.fetch_timeout_s) as client,
                    client.stream("GET", url) as resp):
            if resp.is_redirect:
                raise MediaError(f"image URL could not be fetched (redirect to "
                                 f"{resp.headers.get('location', '?')} refused: it could lead off "
                                 "server.media.allowed_url_hosts)", param)
            if resp.status_code != 200:
                raise MediaError(f"image URL could not be fetched (HTTP {resp.status_code} "
                                 f"{resp.reason_phrase})", param)
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise MediaError(self._too_large(), param)
            data = bytearray()
            async for chunk in resp.aiter_bytes():  # decompressed: the limit is on what is kept
                data += chunk
                if len(data) > limit:
                    raise MediaError(self._too_large(), param)
            return bytes(data)

    def _too_large(self) -> str:
        return (f"media item larger than {self.limits.max_item_bytes} bytes "
                "(server.media.max_item_bytes)")


def _undecodable_image(e: Exception) -> str:
    return f"image could not be decoded ({type(e).__name__}: {e}); send PNG, JPEG, WebP, GIF or BMP"


def _digest(kind: str, rate: int, data: bytes) -> str:
    """What decides an item's decoded array: its kind, the rate a clip is resampled to, its bytes
    (a format field is not needed: the decoders read the format from the bytes)."""
    h = hashlib.sha256(f"{kind}:{rate}:".encode())
    h.update(data)
    return h.hexdigest()
