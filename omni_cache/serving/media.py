"""Images, audio clips and videos in chat requests: OpenAI content parts -> decoded arrays, with
limits.

Three content-part types carry media, as in OpenAI's chat API (the third as in vLLM's):

* ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``: PNG, JPEG, WebP,
  GIF (first frame) or BMP, decoded by Pillow into ``uint8 [H, W, 3]`` RGB. ``http(s)://`` URLs
  are fetched (by httpx) only from the hosts ``server.media.allowed_url_hosts`` lists (none by
  default), without following redirects (one could lead to another host), within
  ``fetch_timeout_s`` for the whole download and ``max_item_bytes`` on the wire and inflated
  (:mod:`omni_cache.serving.media_fetch`: awaited on the event loop by :meth:`MediaDecoder.fetch_all`
  before :meth:`MediaDecoder.read_all` runs in a thread); ``file://`` and every other scheme are
  refused.
* ``{"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav" | "mp3"}}``:
  decoded by libsndfile (``soundfile``), mixed down to mono and resampled with libsoxr to the
  thinker's feature-extractor rate (16 kHz for Qwen3-Omni), ``float32 [n]``.
* ``{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}``: any container and
  codec FFmpeg reads; ``http(s)://`` URLs as for images. Checked from its header and decoded by
  :mod:`omni_cache.serving.video` into its sampled frames ``uint8 [T, H, W, 3]``, and, with
  ``use_audio_in_video``, its sound track as an audio item right after it (``in_video``).

Everything is checked before it is decoded in full: the encoded size
(``server.media.max_item_bytes``), the number of items (``max_items``), an image's pixel count from
its header (``max_image_pixels``), a clip's duration and sample rate from its header
(``max_audio_seconds``, 1 kHz to 384 kHz). A violation is a :class:`MediaError` (HTTP 400 naming
the content part). Nothing here is unpickled; the decoders are maintained libraries.

Reading and decoding are two steps, so that what an item will hold is known before it is decoded:
:meth:`MediaDecoder.read_all` takes each part's bytes (base64, or the fetch) and checks its header,
which gives its decoded size (:attr:`EncodedItem.decoded_bytes`: an image's pixels x 3, a clip's
samples at the target rate x 4); the server reserves that much of ``server.max_media_bytes_in_flight``
(omni_cache/runtime/request_path/admission.py) and only then :meth:`MediaDecoder.decode_all` decodes.

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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from omni_cache.config.server_schema import MediaConfig
from omni_cache.models.preprocessor import QWEN2_VL, too_short, too_thin
from omni_cache.runtime.request_path.requests import AUDIO, IMAGE, VIDEO, MediaItem
from omni_cache.serving import media_fetch, video
from omni_cache.serving.media_fetch import is_remote

if TYPE_CHECKING:
    from omni_cache.serving.chat_request import MediaPart

#: Sample rates a clip may have (Hz): below, it is not audio; above, resampling costs too much.
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1000, 384000
AUDIO_FORMATS = ("wav", "mp3")
#: Content-part types that name a modality this server does not take.
REFUSED_PARTS = {"input_video": "video", "file": "file"}
#: base64 characters decoded per call (a multiple of 4). One binascii call holds the GIL for its
#: whole input (~2 ms per MiB), and items are decoded on worker threads while the event loop's
#: thread waits for the GIL: a 16 MiB item in one call held it ~33 ms, in slices ~2 ms at a time.
B64_SLICE_CHARS = 1 << 20


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

    kind: str  # IMAGE | AUDIO | VIDEO
    data: bytes
    param: str
    digest: str
    #: The bytes its decoded array will hold (uint8 RGB pixels, float32 samples at the rate; a
    #: video's sampled frames and, with its sound track, the track's samples).
    decoded_bytes: int
    fmt: str = ""  # audio: "wav" | "mp3"
    header: video.VideoHeader | None = None  # a video's
    #: A video whose sound track goes to the thinker with it (use_audio_in_video).
    with_audio: bool = False


@dataclass
class MediaDecoder:
    limits: MediaConfig = field(default_factory=MediaConfig)
    #: The rate clips are resampled to (the thinker's feature extractor's).
    audio_sample_rate: int = 16000
    #: Where decoded items are kept between requests (None: decode every time).
    cache: DecodedCache | None = None
    #: Videos' sound tracks go to the thinker with them: None follows
    #: ``server.media.use_audio_in_video`` where it can be honoured; True is the request's
    #: (a MediaError where it cannot); False leaves them out.
    use_audio_in_video: bool | None = None
    #: vLLM's video loader for the entry stage's model (omni_cache/models/preprocessor.py
    #: ``video_sampler``): the server samples frames as it does.
    video_sampler: str = QWEN2_VL
    #: http(s) URLs' bodies, downloaded on the event loop by :meth:`fetch_all` before
    #: :meth:`read_all` reads them in a worker thread.
    fetched: dict[str, bytes] = field(default_factory=dict)
    #: Runs a compressed download's inflating off the event loop (``await off_loop(fn, *args)``:
    #: the server's media threads, omni_cache/thread_pools.py); None: asyncio's default
    #: executor.
    off_loop: Callable[..., Awaitable[Any]] | None = None

    def read_all(self, parts: Sequence[MediaPart]) -> list[EncodedItem]:
        """A request's media parts read and checked from their headers, in order (nothing
        decoded); MediaError for the first that cannot be used."""
        if len(parts) > self.limits.max_items:
            raise MediaError(
                f"the request has {len(parts)} images, audio clips and videos; at most "
                f"{self.limits.max_items} are accepted (server.media.max_items)",
                "messages",
            )
        items = [
            self.read_image(p.part["image_url"].get("url") or "", p.param + ".image_url.url")
            if p.kind == IMAGE
            else self.read_video(p.part["video_url"].get("url") or "", p.param + ".video_url.url")
            if p.kind == VIDEO
            else self.read_audio(
                p.part["input_audio"].get("data") or "",
                p.part["input_audio"].get("format") or "",
                p.param + ".input_audio",
            )
            for p in parts
        ]
        self._pick_sound_tracks(items)
        return items

    def _pick_sound_tracks(self, items: list[EncodedItem]) -> None:
        """Mark the videos whose sound tracks go along. vLLM's Qwen3-Omni reads
        ``use_audio_in_video`` per request and then pairs every video with one audio item: it
        holds only when every video has a track and no ``input_audio`` part is sent beside them."""
        videos = [i for i in items if i.kind == VIDEO]
        wanted = self.limits.use_audio_in_video if self.use_audio_in_video is None else self.use_audio_in_video
        if not videos or not wanted:
            return
        problem = (
            "the request also has input_audio parts"
            if any(i.kind == AUDIO for i in items)
            else next((f"{i.param} has no sound track" for i in videos if not i.header.has_audio), None)
        )
        if problem is None:
            for item in videos:
                item.with_audio = True
                item.decoded_bytes = video.decoded_bytes(item.header, self._frames(item), self.audio_sample_rate, True)
        elif self.use_audio_in_video:
            raise MediaError(
                f"use_audio_in_video cannot be honoured: {problem} (a request's videos "
                "all bring their sound tracks, and no other audio)",
                "mm_processor_kwargs.use_audio_in_video",
            )

    def decode_all(self, items: Sequence[EncodedItem]) -> list[MediaItem]:
        """Items :meth:`read_all` returned, decoded in order (through the decoded-item cache);
        a video with its sound track is two items, its frames and then its track."""
        out: list[MediaItem] = []
        for item in items:
            out.append(self._cached(item))
            if item.with_audio:
                out.append(self._cached(self._track_of(item)))
        return out

    def read_video(self, url: str, param: str) -> EncodedItem:
        data = self._url_bytes(url, param, "video_url", self.limits.max_video_bytes)
        try:
            header = video.probe(data, self.limits)
            frames = len(video.sampled_indices(header, self.limits, self.video_sampler))
        except video.VideoProblem as e:
            raise MediaError(str(e), param) from None
        if thin := too_thin("video", header.width, header.height):
            raise MediaError(thin, param)
        lim = self.limits
        sampling = f"{lim.video_fps:g}:{lim.video_min_frames}:{lim.video_max_frames}:{self.video_sampler}"
        digest = _digest(VIDEO, 0, data, sampling)
        return EncodedItem(
            VIDEO,
            data,
            param,
            digest,
            video.decoded_bytes(header, frames, self.audio_sample_rate, False),
            header=header,
        )

    def _track_of(self, item: EncodedItem) -> EncodedItem:
        """The (already reserved) sound-track item of a video read with its track."""
        return EncodedItem(
            AUDIO,
            item.data,
            item.param,
            _digest("video-audio", self.audio_sample_rate, item.data),
            0,
            header=item.header,
        )

    def _frames(self, item: EncodedItem) -> int:
        return len(video.sampled_indices(item.header, self.limits, self.video_sampler))

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
            raise MediaError(
                f"image is {w}x{h} pixels; at most {self.limits.max_image_pixels} "
                "pixels are accepted (server.media.max_image_pixels)",
                param,
            )
        if thin := too_thin("image", w, h):
            raise MediaError(thin, param)
        return EncodedItem(IMAGE, data, param, _digest(IMAGE, 0, data), w * h * 3)

    def read_audio(self, data_b64: str, fmt: str, param: str) -> EncodedItem:
        import soundfile as sf

        if fmt not in AUDIO_FORMATS:
            raise MediaError(
                f"input_audio.format {fmt!r} is not supported (supported: {', '.join(AUDIO_FORMATS)})",
                param + ".format",
            )
        data = self._b64(data_b64, param + ".data")
        try:
            info = sf.info(io.BytesIO(data))
        except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as e:
            raise MediaError(_undecodable_audio(fmt, e), param) from None
        if not MIN_SAMPLE_RATE <= info.samplerate <= MAX_SAMPLE_RATE:
            raise MediaError(
                f"audio sample rate {info.samplerate} Hz is outside {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz", param
            )
        if info.frames / info.samplerate > self.limits.max_audio_seconds:
            raise MediaError(
                f"audio is {info.frames / info.samplerate:.1f} s long; at most "
                f"{self.limits.max_audio_seconds:g} s are accepted "
                "(server.media.max_audio_seconds)",
                param,
            )
        samples = -(-info.frames * self.audio_sample_rate // info.samplerate)  # at the target rate
        if short := too_short("audio", samples, self.audio_sample_rate):
            raise MediaError(short, param)
        return EncodedItem(AUDIO, data, param, _digest(AUDIO, self.audio_sample_rate, data), samples * 4, fmt)

    def _decode(self, item: EncodedItem) -> MediaItem:
        if item.kind == VIDEO:
            return self._decode_video(item)
        if item.header is not None:  # a video's sound track
            return self._decode_track(item)
        return self._decode_image(item) if item.kind == IMAGE else self._decode_audio(item)

    def _decode_video(self, item: EncodedItem) -> MediaItem:
        try:
            indices = video.sampled_indices(item.header, self.limits, self.video_sampler)
            frames = video.decode_frames(item.data, item.header, self.limits, self.video_sampler, len(indices))
        except video.VideoProblem as e:
            raise MediaError(str(e), item.param) from None
        return MediaItem(
            VIDEO,
            frames,
            fps=video.sampled_fps(item.header, frames.shape[0]),
            frame_indices=tuple(indices),
            source_fps=item.header.fps,
            source_frames=item.header.frames,
        )

    def _decode_track(self, item: EncodedItem) -> MediaItem:
        try:
            track = video.decode_track(item.data, item.header, self.audio_sample_rate)
        except video.VideoProblem as e:
            raise MediaError(str(e), item.param) from None
        if short := too_short("the video's sound track", len(track), self.audio_sample_rate):
            raise MediaError(short, item.param)
        return MediaItem(AUDIO, track, self.audio_sample_rate, in_video=True)

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
            raise MediaError(_undecodable_audio(fmt, e), param) from None
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
        return self._url_bytes(url, param, "image_url", self.limits.max_item_bytes)

    def _url_bytes(self, url: str, param: str, part: str, limit: int) -> bytes:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        kind = part.partition("_")[0]
        if scheme == "data":
            head, sep, payload = url.partition(",")
            if not sep or not head.endswith(";base64"):
                raise MediaError(f"a data: URL must be base64 (data:{kind}/<type>;base64,...)", param)
            return self._b64(payload, param, limit)
        if scheme in ("http", "https"):
            try:
                media_fetch.check_host(url, param, part, self.limits)
            except media_fetch.FetchError as e:
                raise MediaError(str(e), e.param) from None
            if url not in self.fetched:  # a caller's mistake, not the client's
                raise RuntimeError(f"{url} was not fetched: await MediaDecoder.fetch_all first")
            return self.fetched[url]
        raise MediaError(
            f"{part} scheme {scheme + ':' if scheme else '(none)'} is not accepted; send a data: URL (base64)", param
        )

    def _b64(self, text: str, param: str, limit: int | None = None) -> bytes:
        limit = self.limits.max_item_bytes if limit is None else limit
        # 4 base64 characters carry 3 bytes: refuse before decoding what is too large anyway.
        if len(text) > (limit + 2) // 3 * 4 + 4:
            raise MediaError(self._too_large(limit), param)
        try:
            data = _b64decode_sliced(text)
        except (binascii.Error, ValueError):
            raise MediaError("not valid base64", param) from None
        if not data:
            raise MediaError("the media item is empty", param)
        if len(data) > limit:
            raise MediaError(self._too_large(limit), param)
        return data

    # ---- downloads (on the event loop) ----------------------------------------------------------
    async def fetch_all(self, parts: Sequence[MediaPart]) -> None:
        """Download the http(s) URLs of a request's image and video parts into :attr:`fetched`,
        all at once, before :meth:`read_all` reads them in a worker thread; MediaError for the
        first that cannot be fetched (the others are cancelled)."""
        urls: dict[str, tuple[str, str, int]] = {}
        for p in parts:
            if p.kind in (IMAGE, VIDEO):
                part = "image_url" if p.kind == IMAGE else "video_url"
                limit = self.limits.max_item_bytes if p.kind == IMAGE else self.limits.max_video_bytes
                urls.setdefault(p.part[part].get("url") or "", (p.param + f".{part}.url", part, limit))
        await self.fetch_urls(urls)

    async def fetch_urls(self, urls: dict[str, tuple[str, str, int]]) -> None:
        """``{url: (param, part, limit)}``: the http(s) ones not fetched yet, downloaded at once."""
        remote = {url: how for url, how in urls.items() if is_remote(url) and url not in self.fetched}
        try:
            self.fetched.update(
                await media_fetch.fetch_all(remote, self.limits, self._too_large, self.off_loop or asyncio.to_thread)
            )
        except media_fetch.FetchError as e:
            raise MediaError(str(e), e.param) from None

    def _too_large(self, limit: int | None = None) -> str:
        if limit is not None and limit == self.limits.max_video_bytes != self.limits.max_item_bytes:
            return f"video larger than {limit} bytes (server.media.max_video_bytes)"
        return f"media item larger than {self.limits.max_item_bytes} bytes (server.media.max_item_bytes)"


def _undecodable_image(e: Exception) -> str:
    from PIL import UnidentifiedImageError

    # PIL's UnidentifiedImageError names the file it read, here an in-memory buffer's repr
    # ("<_io.BytesIO object at 0x7f...>"): an address of the server's, no use to the client.
    why = "no image format was recognised" if isinstance(e, UnidentifiedImageError) else f"{type(e).__name__}: {e}"
    return f"image could not be decoded ({why}); send PNG, JPEG, WebP, GIF or BMP"


def _b64decode_sliced(text: str) -> bytes:
    """``base64.b64decode(text, validate=True)``, B64_SLICE_CHARS characters per call (the GIL is
    free between calls). Accepts and refuses exactly what the one call would: every slice but the
    last is whole quads, and padding that ends one of those is data after padding in the whole."""
    if len(text) <= B64_SLICE_CHARS:
        return base64.b64decode(text, validate=True)
    pieces = []
    for start in range(0, len(text), B64_SLICE_CHARS):
        piece = text[start : start + B64_SLICE_CHARS]
        if start + B64_SLICE_CHARS < len(text) and piece.endswith("="):
            raise binascii.Error("excess data after padding")
        pieces.append(base64.b64decode(piece, validate=True))
    return b"".join(pieces)


def _digest(kind: str, rate: int, data: bytes, sampling: str = "") -> str:
    """What decides an item's decoded array: its kind, the rate a clip is resampled to, a video's
    frame sampling, its bytes (a format field is not needed: the decoders read the format from
    the bytes)."""
    h = hashlib.sha256(f"{kind}:{rate}:{sampling}:".encode() if sampling else f"{kind}:{rate}:".encode())
    h.update(data)
    return h.hexdigest()


def _undecodable_audio(fmt: str, e: Exception) -> str:
    """Why a clip could not be read, in libsndfile's words: its error's text begins with the file
    it opened, here an in-memory buffer's repr ("Error opening <_io.BytesIO object at 0x7f...>:"),
    an address of the server's that tells the client nothing."""
    why = getattr(e, "error_string", None) or str(e)
    return f"audio could not be decoded as {fmt} ({why})"
