"""Request streams for the end-to-end benchmark (``python -m benchmarks``).

A workload is a list of :class:`Session` s: a session is one request (``shared-prefix``,
``zero-reuse``, ``image``, ``video``) or one conversation of several turns (``multi-turn``), whose turns are sent one
after the other, each resending the whole history including the previous answers. Every session
is built from a seeded ``random.Random``, so both sides of a run (cache on / off) and repeated runs
with the same flags send exactly the same prompts at the same times.

Sizes are in thinker tokens. The tiny thinker's tokenizer is byte-level, so one ASCII character
is one token; the chat template adds a few tokens per message (:data:`TEMPLATE`), which the
builders subtract so that, for ``shared-prefix``, the prompt is exactly ``shared + unique``
tokens, the first ``shared`` of them identical across requests. The actual prompt length of every
request is recorded from the server's ``usage.prompt_tokens`` (for a model with another tokenizer
the sizes are approximate and the JSON shows by how much).

Arrivals (:func:`arrival_times`): ``--rate R`` starts sessions at the times of a Poisson process of
rate R (exponential gaps, seeded), ``--concurrency C`` keeps C sessions in flight (a closed loop).
"""

from __future__ import annotations

import base64
import io
import math
import random
from dataclasses import dataclass, field

__all__ = [
    "ALPHABET",
    "KINDS",
    "TEMPLATE",
    "Session",
    "arrival_times",
    "build_workload",
    "content_sizes",
    "image_data_url",
    "video_data_url",
    "messages_for",
    "parse_mix",
    "prompt_tokens_expected",
    "random_text",
    "split_rounds",
]

KINDS = ("shared-prefix", "multi-turn", "zero-reuse")
WORKLOADS = (*KINDS, "image", "video", "mixed")

#: Pixels per vision token of Qwen3-Omni's encoder (16-pixel patches, 2 x 2 merged).
PIXELS_PER_IMAGE_TOKEN = 32

#: One token per character with the tiny byte-level tokenizer.
ALPHABET = "abcdefghijklmnopqrstuvwxyz     .,"

#: Tokens the tiny chat template adds (stage_configs/tiny_omni.yaml's thinker,
#: omni_cache.tiny.checkpoints.CHAT_TEMPLATE): ``<|im_start|>ROLE\n CONTENT <|im_end|>\n`` per message,
#: plus ``<|im_start|>assistant\n`` as the generation prompt.
TEMPLATE = {
    "system": 10,  # <|im_start|> + "system\n" (7) + <|im_end|> + "\n"
    "user": 8,  # <|im_start|> + "user\n" (5) + <|im_end|> + "\n"
    "assistant": 13,  # <|im_start|> + "assistant\n" (10) + <|im_end|> + "\n"
    "generation": 11,  # <|im_start|> + "assistant\n"
    "user_head": 6,  # <|im_start|> + "user\n": part of the shared prefix of a shared-prefix request
}


def random_text(rng: random.Random, n: int) -> str:
    """``n`` ASCII characters (``n`` tokens of the byte-level tokenizer)."""
    return "".join(rng.choice(ALPHABET) for _ in range(max(0, n)))


@dataclass
class Session:
    """One unit of the request stream: a request, or a conversation of ``len(users)`` turns."""

    index: int
    kind: str
    system: str
    users: list[str]
    max_tokens: int
    warmup: bool = False
    #: Seconds after the start of the measured phase (rate mode; None in concurrency mode).
    arrival_s: float | None = None
    #: An image (data: URL) sent before the text of the first user message (``image``).
    image: str | None = None
    #: A video (data: URL) sent there likewise (``video``).
    video: str | None = None
    #: An audio clip (base64 WAV, ``input_audio``) sent there likewise (benchmarks.routing).
    audio: str | None = None

    @property
    def turns(self) -> int:
        return len(self.users)

    def request_id(self, turn: int) -> str:
        return f"{'w' if self.warmup else ''}{self.index}.{turn}"


@dataclass
class Sizes:
    num_requests: int = 32
    shared_tokens: int = 4000
    unique_tokens: int = 100
    turns: int = 3
    max_tokens: int = 32
    mix: dict[str, float] = field(default_factory=lambda: {"shared-prefix": 2.0, "multi-turn": 1.0, "zero-reuse": 1.0})


def messages_for(session: Session, turn: int, answers: list[str]) -> list[dict[str, str]]:
    """The chat messages of ``turn`` (0-based): the system prompt, then every earlier user turn
    followed by the answer the server gave to it, then this turn's user message."""
    if len(answers) < turn:
        raise ValueError(f"turn {turn} needs the answers of the {turn} earlier turn(s)")
    msgs = [{"role": "system", "content": session.system}] if session.system else []
    for k in range(turn + 1):
        content: str | list = session.users[k]
        if k == 0 and session.image is not None:
            content = [
                {"type": "image_url", "image_url": {"url": session.image}},
                {"type": "text", "text": session.users[0]},
            ]
        elif k == 0 and session.video is not None:
            content = [
                {"type": "video_url", "video_url": {"url": session.video}},
                {"type": "text", "text": session.users[0]},
            ]
        elif k == 0 and session.audio is not None:
            content = [
                {"type": "input_audio", "input_audio": {"data": session.audio, "format": "wav"}},
                {"type": "text", "text": session.users[0]},
            ]
        msgs.append({"role": "user", "content": content})
        if k < turn:
            msgs.append({"role": "assistant", "content": answers[k]})
    return msgs


def prompt_tokens_expected(session: Session, turn: int, answers: list[str]) -> int | None:
    """The prompt length the tiny template and byte-level tokenizer give (UTF-8 bytes + template
    tokens; an answer may hold non-ASCII text); None for a prompt with an image, video or clip."""
    if session.image is not None or session.video is not None or session.audio is not None:
        return None
    n = TEMPLATE["system"] + _nbytes(session.system) + TEMPLATE["generation"]
    for k in range(turn):
        n += TEMPLATE["user"] + _nbytes(session.users[k]) + TEMPLATE["assistant"] + _nbytes(answers[k])
    return n + TEMPLATE["user"] + _nbytes(session.users[turn])


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def content_sizes(shared: int, unique: int) -> tuple[int, int]:
    """(system chars, user chars) so that the prompt is ``shared + unique`` tokens and its first
    ``shared`` tokens are the system message plus the user message's header."""
    sys_chars = shared - TEMPLATE["system"] - TEMPLATE["user_head"]
    user_chars = unique - (TEMPLATE["user"] - TEMPLATE["user_head"]) - TEMPLATE["generation"]
    if sys_chars < 1:
        raise ValueError(
            f"--shared-tokens {shared} is shorter than the chat template's "
            f"{TEMPLATE['system'] + TEMPLATE['user_head'] + 1} tokens"
        )
    if user_chars < 1:
        raise ValueError(
            f"--unique-tokens {unique} is shorter than the chat template's "
            f"{TEMPLATE['user'] - TEMPLATE['user_head'] + TEMPLATE['generation'] + 1} tokens"
        )
    return sys_chars, user_chars


def parse_mix(text: str) -> dict[str, float]:
    """``"shared-prefix=2,multi-turn=1,zero-reuse=1"`` -> weights (missing kinds weigh 0)."""
    out: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in KINDS:
            raise ValueError(f"--mix: expected KIND=WEIGHT with KIND one of {', '.join(KINDS)}, got {part!r}")
        try:
            w = float(value)
        except ValueError:
            raise ValueError(f"--mix: weight of {name!r} is not a number: {value!r}") from None
        if w < 0:
            raise ValueError(f"--mix: weight of {name!r} is negative")
        out[name] = w
    if not out or sum(out.values()) <= 0:
        raise ValueError("--mix: at least one weight must be > 0")
    return out


def build_workload(name: str, sizes: Sizes, seed: int) -> tuple[list[Session], list[Session]]:
    """(warm-up sessions, measured sessions) of workload ``name``.

    * ``shared-prefix``: every request = one system prompt shared by all (``shared`` tokens with
      the template) + ``unique`` tokens of its own.
    * ``zero-reuse``: requests of the same length, all distinct (nothing to hit).
    * ``multi-turn``: ceil(num_requests / turns) conversations of ``turns`` turns, each with its own
      ``shared``-token opening (not shared across conversations, so the only reuse is the
      conversation's own history) and ``unique`` new tokens per turn; turn k resends turns < k and
      their answers.
    * ``image``: every request = one image of about ``shared`` vision tokens (Qwen3-Omni's
      encoder: one token per 32 x 32 pixels), the same for all, followed by a question of its own
      of ``unique`` characters; no system prompt.
    * ``video``: likewise one video, the same for all (:func:`video_data_url`: 2 s of 96 x 64 at
      8 fps with a sound track; Qwen3-Omni reads it as 4 sampled frames, 2 x 280 vision tokens,
      and its track interleaved: ~600 tokens whatever ``shared``).
    * ``mixed``: sessions of the three kinds drawn with ``sizes.mix`` weights until
      ``num_requests`` requests; its shared-prefix sessions share one system prompt.

    Warm-up (not measured, same on both sides): one request of the workload's shape, whose
    system prompt is the shared one where the workload has one, so the cache-on side starts like a
    server that has already seen its shared prefix.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOADS)}")
    if sizes.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if sizes.turns < 1:
        raise ValueError("--turns must be >= 1")
    sys_chars, user_chars = content_sizes(sizes.shared_tokens, sizes.unique_tokens)
    rng = random.Random(f"omni_cache-e2e/{name}/{seed}")
    shared_system = random_text(rng, sys_chars)
    shared_image = image_data_url(sizes.shared_tokens, seed) if name == "image" else None
    shared_video = video_data_url(seed) if name == "video" else None

    def make(index: int, kind: str, warmup: bool = False) -> Session:
        if kind == "shared-prefix":
            return Session(index, kind, shared_system, [random_text(rng, user_chars)], sizes.max_tokens, warmup)
        if kind == "image":
            return Session(
                index, kind, "", [random_text(rng, user_chars)], sizes.max_tokens, warmup, image=shared_image
            )
        if kind == "video":
            return Session(
                index, kind, "", [random_text(rng, user_chars)], sizes.max_tokens, warmup, video=shared_video
            )
        if kind == "zero-reuse":
            return Session(
                index, kind, random_text(rng, sys_chars), [random_text(rng, user_chars)], sizes.max_tokens, warmup
            )
        turns = 1 if warmup else sizes.turns
        return Session(
            index,
            kind,
            random_text(rng, sys_chars),
            [random_text(rng, user_chars) for _ in range(turns)],
            sizes.max_tokens,
            warmup,
        )

    sessions: list[Session] = []
    if name == "mixed":
        kinds = [k for k in KINDS if sizes.mix.get(k, 0) > 0]
        weights = [sizes.mix[k] for k in kinds]
        total = 0
        while total < sizes.num_requests:
            kind = rng.choices(kinds, weights)[0]
            s = make(len(sessions), kind)
            if kind == "multi-turn" and total + s.turns > sizes.num_requests:
                s.users = s.users[: sizes.num_requests - total]
            sessions.append(s)
            total += s.turns
        warm_kind = "shared-prefix" if "shared-prefix" in kinds else kinds[0]
    elif name == "multi-turn":
        total = 0
        while total < sizes.num_requests:
            s = make(len(sessions), name)
            s.users = s.users[: sizes.num_requests - total]
            sessions.append(s)
            total += s.turns
        warm_kind = name
    else:
        sessions = [make(i, name) for i in range(sizes.num_requests)]
        warm_kind = name
    warmup = [make(0, warm_kind, warmup=True)]
    return warmup, sessions


def split_rounds(sessions: list[Session], rounds: int) -> list[list[Session]]:
    """``sessions`` in ``rounds`` consecutive groups, each closed once it holds its share of the
    requests (turns); every group holds at least one session."""
    if not 1 <= rounds <= len(sessions):
        raise ValueError(f"cannot split {len(sessions)} session(s) into {rounds} round(s)")
    share = sum(s.turns for s in sessions) / rounds
    out: list[list[Session]] = [[]]
    turns = 0
    for k, s in enumerate(sessions):
        left = len(sessions) - k  # this one included
        if out[-1] and len(out) < rounds and (turns >= share * len(out) or left == rounds - len(out)):
            out.append([])
        out[-1].append(s)
        turns += s.turns
    return out


def image_data_url(tokens: int, seed: int) -> str:
    """A square PNG (data: URL) of about ``tokens`` vision tokens: smooth colour bands with a
    seeded phase, so it compresses well and differs between seeds."""
    from PIL import Image

    side = max(1, round(math.sqrt(tokens))) * PIXELS_PER_IMAGE_TOKEN
    phase = random.Random(f"omni_cache-e2e/image/{seed}").random() * 2 * math.pi
    row = bytes(int(127 + 120 * math.sin(phase + x / 37.0)) for x in range(side))
    img = Image.merge(
        "RGB",
        [
            Image.frombytes("L", (side, 1), row).resize((side, side)),
            Image.frombytes("L", (1, side), row).resize((side, side)),
            Image.new("L", (side, side), 96),
        ],
    )
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def video_data_url(seed: int, seconds: float = 2.0, fps: int = 8, width: int = 96, height: int = 64) -> str:
    """An MP4 (data: URL) of moving colour bands with a seeded phase and a sine-tone sound track
    (AAC, 16 kHz), written with PyAV."""
    import os
    import tempfile

    import av
    import numpy as np

    phase = random.Random(f"omni_cache-e2e/video/{seed}").random() * 2 * math.pi
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        with av.open(path, "w", format="mp4") as c:
            v = c.add_stream("mpeg4", rate=fps)
            v.width, v.height, v.pix_fmt = width, height, "yuv420p"
            a = c.add_stream("aac", rate=16000)
            a.layout = "mono"
            x = np.arange(width)[None, :, None]
            for i in range(int(seconds * fps)):
                band = 127 + 120 * np.sin(phase + (x + 4 * i) / 9.0 + np.arange(3) * 2.0)
                img = np.broadcast_to(band, (height, width, 3)).astype(np.uint8)
                for p in v.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")):
                    c.mux(p)
            for p in v.encode():
                c.mux(p)
            n = int(seconds * 16000)
            tone = (0.3 * np.sin(2 * np.pi * 330 * np.arange(n) / 16000 + phase)).astype(np.float32)
            for off in range(0, n, 1024):
                frame = av.AudioFrame.from_ndarray(tone[None, off : off + 1024], format="fltp", layout="mono")
                frame.sample_rate, frame.pts = 16000, off
                for p in a.encode(frame):
                    c.mux(p)
            for p in a.encode():
                c.mux(p)
        with open(path, "rb") as f:
            return "data:video/mp4;base64," + base64.b64encode(f.read()).decode("ascii")
    finally:
        os.remove(path)


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Start times (s) of ``n`` sessions of a Poisson process with ``rate`` per second; the first
    one at 0 (the measured phase starts with a request)."""
    if rate <= 0:
        raise ValueError("--rate must be > 0")
    rng = random.Random(f"omni_cache-e2e/arrivals/{seed}")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out
