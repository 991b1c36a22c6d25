"""A fake stage process that speaks the stage protocol over real ZMQ (no vLLM, no model).

Started by the orchestrator exactly like ``python -m workers`` (same arguments), for
tests/test_server_unit.py:

* entry stage (an "echo thinker"): answers a Submit with the prompt's byte tokens (ids < 256),
  one StageOutput per token, the last one with ``finished=True``: the first ``FAKE_TOKEN_DELAY``
  seconds after the Submit, the next ones on steps of one clock (a step every
  ``FAKE_TOKEN_DELAY``), every request's output of a step sent with the others as one
  StageOutputs, as a real stage sends an engine step's (workers/outbox.py); "prefix cache": the
  longest common prefix with any earlier prompt, rounded down to blocks of 4. Forwards every token
  to its downstream stages when "audio" is asked for (the first in a StreamStart, as
  workers/ar_runner.py opens a stream).
  Prompts containing ``HANG`` never finish; ``STALL`` stops after 2 tokens unless the request
  was resumed (``Submit.resumed_tokens``: the answer goes on after the tokens the prompt ends
  with, which the first output carries again, as workers/ar_runner.py sends them);
  ``FAIL`` answers a StageError (status 500); ``REFUSE`` the StageError a real stage's runner
  makes of a check vLLM files with a parameter (workers/runner.py ``error_message``: 400, param
  ``top_logprobs``);
  ``SLOWSTART`` delays the first token by ``SLOW_FIRST_TOKEN_S``; ``UTF8BAD`` answers with
  ``UTF8BAD_ANSWER`` (invalid and incomplete UTF-8), decoded like vLLM's incremental detokenizer:
  bytes held back while incomplete (empty text), U+FFFD for invalid ones, and a sequence still
  incomplete at the end is never written.
  With ``return_latents`` it sends a "hidden" tensor [prompt + output tokens, 4].
* ``FAKE_SAMPLE_RATE`` is the sample rate the "decoder" reports (default 24000).
* ``FAKE_START_DELAY`` (s) delays StageReady; ``FAKE_EXIT_AT_START=N`` exits with N at start.
* With ``OMNI_CACHE_TIMELINE_DIR`` set (omni_cache/timeline.py) it marks a request's ``input``
  (its Submit, or a decoder's first upstream output), ``out0`` (its first output, as sent) and
  a decoder's ``audio_out``, in a file named for its stage, as the real stages do.
* other stages (a "decoder"): 240 samples (10 ms at 24 kHz) of a sine per upstream token, sent to
  the orchestrator as an "audio" frame every ``FAKE_DECODER_WINDOW`` tokens (default 1) and at
  the end; a finished header once upstream finished.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import collections
import hashlib
import os
import threading
import time

import numpy as np
import torch
import zmq
import zmq.asyncio

from omni_cache.config import load_config
from omni_cache.config.addresses import control_address
from omni_cache.config.identity import pipeline_hash
from omni_cache.config.replicas import stage_replicas
from omni_cache.timeline import Timeline
from omni_cache.wire.messages import (
    MESSAGE_TYPES,
    Abort,
    Hold,
    Shutdown,
    StageError,
    StageOutput,
    StageOutputs,
    StageStats,
    StatsQuery,
    StreamStart,
    Submit,
)
from omni_cache.wire.stage_auth import load_stage_auth
from omni_cache.wire.transport import AsyncReceiver, AsyncSender, Codec
from workers.announcer import Announcer
from workers.runner import error_message

SAMPLE_RATE = int(os.environ.get("FAKE_SAMPLE_RATE", "24000"))  # what the "decoder" claims
WINDOW = int(os.environ.get("FAKE_DECODER_WINDOW", "1"))  # upstream tokens per audio message
SAMPLES_PER_TOKEN = 240
BLOCK = 4
SEEN_PROMPTS = 256  # prompts the prefix-cache counters remember
SLOW_FIRST_TOKEN_S = 0.5
UTF8BAD_ANSWER = b"\xe2\x82 ok \xff\xfe end \xf0\x9f\x98"


class Refused(ValueError):
    """A request check's failure naming the field at fault, as vLLM's VLLMValidationError does."""

    def __init__(self, message: str, *, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(0.25)


class FakeStage:
    def __init__(self, config, stage, orchestrator: str, replica: int = 0) -> None:
        self.config = config
        self.stage = stage
        self.name = stage.name
        self.replica = stage_replicas(stage)[replica]  # its own inbox; downstream: replica 0 only
        self.ctx = zmq.asyncio.Context()
        codec = Codec(MESSAGE_TYPES, max_message_bytes=config.server.max_message_bytes)
        self.auth = load_stage_auth(config)  # server.stage_auth_key_file: CURVE like real stages
        if self.auth is not None:
            self.auth.guard(self.ctx)
        self.inbox = AsyncReceiver(
            self.ctx, self.replica.bind_address or self.replica.address, codec, bind=True, auth=self.auth
        )
        self.orch = AsyncSender(self.ctx, orchestrator, codec, auth=self.auth)
        self.down = [AsyncSender(self.ctx, d.address, codec, auth=self.auth) for d in config.downstream(stage.name)]
        self.orchestrator, self.codec = orchestrator, codec
        self.timeline = Timeline(self.name)
        self.tasks: dict[str, asyncio.Task] = {}
        self.decoding: dict[str, int] = {}  # decoder: request -> seq
        self.spoken: dict[str, str] = {}  # decoder: request -> the text it was given
        self.pending_audio: dict[str, list[np.ndarray]] = {}  # decoder: request -> a window's waves
        #: This step's outputs to the orchestrator, sent together as a real stage sends an engine
        #: step's (workers/outbox.py), and the future set once they are sent.
        self.step_out: list[tuple[StageOutput, dict | None]] = []
        self.step_sent: asyncio.Future | None = None
        self.flushes: set[asyncio.Task] = set()  # (the loop keeps only weak references to tasks)
        self.aborted: set[str] = set()
        #: Requests held for their client (wire Hold): set again when it takes the answer again,
        #: or when the hold's lease lapses (the timer, replaced by each renewal).
        self.held: dict[str, asyncio.Event] = {}
        self.leases: dict[str, asyncio.TimerHandle] = {}
        #: The last SEEN_PROMPTS distinct prompts by their bytes' digest, for the prefix-cache
        #: counters (a real engine forgets too; it also holds a repeated prompt's blocks once).
        self.seen: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self.delay = float(os.environ.get("FAKE_TOKEN_DELAY", "0.01"))
        self.counters = {
            k: 0.0
            for k in (
                "requests",
                "errors",
                "queue_depth",
                "prefix_cache_queried_tokens",
                "prefix_cache_hit_tokens",
                "latent_rows_served",
                "client_holds",
                "client_hold_lapses",
                "tokens_sent",  # the fake thinker's tokens, as sent
            )
        }

    async def run(self) -> None:
        await asyncio.sleep(float(os.environ.get("FAKE_START_DELAY", "0")))
        max_len = self.stage.engine_args.max_model_len if self.stage.engine_args else 0
        # Heartbeats as a real stage sends them (workers/announcer.py), first one queued.
        announcer = Announcer(
            zmq.Context.shadow(self.ctx.underlying),
            self.codec,
            self.orchestrator,
            self.name,
            interval_s=self.config.server.heartbeat_interval_s,
            max_model_len=max_len or 0,
            auth=self.auth,
            replica=self.replica.index,
            config_hash=pipeline_hash(self.config),
        )
        await self.orch.send(announcer.message)
        announcer.start()
        try:
            await self._serve()
        finally:
            # As workers/stage_process.py does: its socket closed, the process exits on Shutdown
            # (else the context's term at exit waited for it until the orchestrator's SIGTERM,
            # a whole shutdown grace per stop).
            announcer.stop()

    async def _serve(self) -> None:
        while True:
            item = await self.inbox.recv()
            if item is None:
                continue
            msg, tensors = item
            if isinstance(msg, (Submit, StageOutput)):
                self.timeline.mark(msg.request_id, "input")
            if isinstance(msg, Submit):
                self.counters["requests"] += 1
                task = asyncio.create_task(self.think(msg))
                self.tasks[msg.request_id] = task
                task.add_done_callback(lambda _t, rid=msg.request_id: self._ended(rid))
            elif isinstance(msg, StageOutput):
                await self.decode(msg)
            elif isinstance(msg, Abort):
                self.aborted.add(msg.request_id)
                task = self.tasks.pop(msg.request_id, None)
                if task is not None:
                    task.cancel()
            elif isinstance(msg, Hold):
                self.hold(msg)
            elif isinstance(msg, StatsQuery):
                self.counters["queue_depth"] = float(len(self.tasks) + len(self.decoding))
                await self.orch.send(
                    StageStats(stage=self.name, replica=self.replica.index, counters=dict(self.counters))
                )
            elif isinstance(msg, Shutdown):
                return

    def _ended(self, request_id: str) -> None:
        self.tasks.pop(request_id, None)
        self.held.pop(request_id, None)
        if (lease := self.leases.pop(request_id, None)) is not None:
            lease.cancel()

    def hold(self, msg: Hold) -> None:
        """As a real stage (workers/runner.py): a thinker request held for its client writes
        nothing until let go, or until its lease lapses without being said again."""
        rid = msg.request_id
        if rid not in self.tasks:
            return
        if (lease := self.leases.pop(rid, None)) is not None:
            lease.cancel()
        if msg.held and msg.lease_s > 0:
            self.leases[rid] = asyncio.get_running_loop().call_later(msg.lease_s, self._let_go, rid, True)
        if msg.held and rid not in self.held:
            self.counters["client_holds"] += 1
            self.held[rid] = asyncio.Event()
        elif not msg.held:
            self._let_go(rid, False)

    def _let_go(self, rid: str, lapsed: bool) -> None:
        self.leases.pop(rid, None)
        if (going := self.held.pop(rid, None)) is not None:
            self.counters["client_hold_lapses"] += lapsed
            going.set()

    def _cached(self, prompt: list[int]) -> int:
        """The prompt's longest common prefix with a recent one, in whole blocks. Compared with
        numpy over a bounded history of distinct prompts, a repeated one found by its digest
        alone: a Python loop over every prompt ever seen blocked this stage's loop for seconds
        under benchmarks/hostile.py (16 prompts of 20,000 tokens every few seconds), and so did
        comparing each of them with the 256 copies of itself before it (~0.1 s a batch on a Zen
        3); with it every other request's first text: a tail of the fake, not of the server."""
        new = np.asarray(prompt, dtype=np.int64)
        digest = hashlib.blake2b(new.tobytes(), digest_size=16).digest()
        best = len(new) if digest in self.seen else 0
        if not best:
            for old in self.seen.values():
                m = min(len(old), len(new))
                differ = np.flatnonzero(old[:m] != new[:m])
                best = max(best, int(differ[0]) if len(differ) else m)
        self.seen[digest] = new
        self.seen.move_to_end(digest)
        while len(self.seen) > SEEN_PROMPTS:
            self.seen.popitem(last=False)
        return min(best // BLOCK * BLOCK, max(0, len(prompt) - 1))

    async def think(self, sub: Submit) -> None:
        rid = sub.request_id
        k = sub.resumed_tokens
        prompt = list(sub.prompt_token_ids)
        tail = prompt[len(prompt) - k :] if k else []
        prompt = prompt[: len(prompt) - k]
        ids = np.asarray(prompt, dtype=np.int64)
        raw = ids[ids < 256].astype(np.uint8).tobytes()
        cached = self._cached(prompt)
        self.counters["prefix_cache_queried_tokens"] += len(prompt)
        self.counters["prefix_cache_hit_tokens"] += cached
        self.counters["latent_rows_served"] += cached
        if b"FAIL" in raw:
            self.counters["errors"] += 1
            await self.orch.send(
                StageError(request_id=rid, stage=self.name, message="fake failure requested", status=500)
            )
            return
        if b"REFUSE" in raw:
            await self.orch.send(error_message(self.name, rid, Refused("fake refusal", parameter="top_logprobs")))
            return
        if b"HANG" in raw:
            await asyncio.sleep(3600)
        answer = UTF8BAD_ANSWER if b"UTF8BAD" in raw else raw
        out = list(answer[k : k + sub.sampling.max_tokens])
        if b"STALL" in raw and not k:
            out = out[:2]
        flush_at_end = b"UTF8BAD" not in raw
        audio = "audio" in sub.modalities
        seq = 0
        if sub.return_latents:
            rows = torch.arange(len(prompt) * 4, dtype=torch.float32).reshape(-1, 4)
            await self.orch.send(
                StageOutput(request_id=rid, stage=self.name, seq=seq, latent_start=0), {"hidden": rows}
            )
            seq += 1
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        reason = "length" if len(out) >= sub.sampling.max_tokens else "stop"
        stall = b"STALL" in raw and not k

        def out_msgs():
            """(token ids, last) per output, made as they are sent: a list of 20,000 of them made
            up front held this stage's loop (and every other request's tokens) for milliseconds
            per long answer, 16 at once under benchmarks/hostile.py."""
            if not out:
                yield [], True
            for i, t in enumerate(out):
                yield (tail + [t] if i == 0 else [t]), i == len(out) - 1 and not stall

        for i, (toks, last) in enumerate(out_msgs()):
            # The first token a whole delay after the Submit (its prefill); the next ones on steps
            # of one clock, so every request's token of a step goes in that step's message.
            first = SLOW_FIRST_TOKEN_S if b"SLOWSTART" in raw else self.delay
            await asyncio.sleep(first if i == 0 else self._to_next_step())
            if (held := self.held.get(rid)) is not None:
                await held.wait()
            new = toks[len(tail) :] if i == 0 else toks  # vLLM's text covers new tokens only
            text = decoder.decode(bytes(new), final=last and flush_at_end)
            msg = StageOutput(
                request_id=rid,
                stage=self.name,
                seq=seq,
                token_ids=toks,
                text=text,
                finished=last,
                finish_reason=reason if last else None,
                num_prompt_tokens=len(prompt),
                num_cached_tokens=cached,
            )
            tensors = None
            if sub.return_latents and toks:
                pos = len(prompt) + i
                tensors = {"hidden": torch.full((1, 4), float(pos))}
                msg.latent_start = pos
            self.timeline.mark(rid, "out0")  # (only the first is written)
            await self._in_this_step(msg, tensors)
            self.counters["tokens_sent"] += len(new)
            if audio:  # after the orchestrator has it, as from a real stage; a full decoder holds this request only
                fwd = StageOutput(request_id=rid, stage=self.name, seq=seq, token_ids=toks, text=text, finished=last)
                if i == 0:
                    fwd = StreamStart.opening(fwd, modalities=list(sub.modalities), sampling=sub.sampling)
                for d in self.down:
                    await d.send(fwd)
            seq += 1
        if stall:
            await asyncio.sleep(3600)

    def _to_next_step(self) -> float:
        """Seconds to the next step of this stage's clock (a step every FAKE_TOKEN_DELAY)."""
        return self.delay - time.monotonic() % self.delay if self.delay > 0 else 0.0

    def _in_this_step(self, msg: StageOutput, tensors: dict | None) -> asyncio.Future:
        """Queue ``msg`` with this step's outputs; done once they are sent. They go once every
        request woken at this step has queued its own (those run in this turn of the loop; the
        flush in the next)."""
        self.step_out.append((msg, tensors))
        if self.step_sent is None:
            self.step_sent = asyncio.get_running_loop().create_future()
            task = asyncio.ensure_future(self._flush())
            self.flushes.add(task)
            task.add_done_callback(self.flushes.discard)
        # Shielded: an aborted request's task, cancelled while it waits, must not cancel the
        # future every other request of the step waits on.
        return asyncio.shield(self.step_sent)

    async def _flush(self) -> None:
        """Send a step's outputs to the orchestrator: those without tensors in one StageOutputs
        when there are several, each with tensors alone."""
        outs, sent = self.step_out, self.step_sent
        self.step_out, self.step_sent = [], None
        try:
            plain = [m for m, t in outs if not t]
            if len(plain) > 1:
                await self.orch.send(StageOutputs(stage=self.name, outputs=plain))
            for m, t in outs:
                if t or len(plain) == 1:
                    await self.orch.send(m, t)
        finally:
            if not sent.done():
                sent.set_result(None)

    async def decode(self, up: StageOutput) -> None:
        rid = up.request_id
        if rid in self.aborted:
            return
        seq = self.decoding.setdefault(rid, 0)
        # What it was given to speak, reported with its last output (the answer's transcript).
        self.spoken[rid] = self.spoken.get(rid, "") + up.text
        pend = self.pending_audio.setdefault(rid, [])
        for tok in up.token_ids:
            t = np.arange(SAMPLES_PER_TOKEN, dtype=np.float32) / SAMPLE_RATE
            pend.append(0.5 * np.sin(2 * np.pi * (200 + 4 * tok) * t).astype(np.float32))
        if pend and (len(pend) >= WINDOW or up.finished):
            wave = np.concatenate(pend)
            pend.clear()
            self.timeline.mark(rid, "audio_out")  # (only the first is written)
            await self.orch.send(
                StageOutput(request_id=rid, stage=self.name, seq=seq, sample_rate=SAMPLE_RATE),
                {"audio": torch.from_numpy(wave)},
            )
            seq += 1
        self.decoding[rid] = seq
        if up.finished:
            self.decoding.pop(rid, None)
            self.pending_audio.pop(rid, None)
            self.counters["requests"] += 1
            await self.orch.send(
                StageOutput(
                    request_id=rid,
                    stage=self.name,
                    seq=seq,
                    finished=True,
                    sample_rate=SAMPLE_RATE,
                    input_text=self.spoken.pop(rid, ""),
                )
            )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stage-config", required=True)
    p.add_argument("--stage", required=True)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--orchestrator", default=None)  # default: the config's control address
    p.add_argument("--parent-pid", type=int, default=None)  # None: started by hand
    p.add_argument("--checkpoint-dir")
    p.add_argument("--no-prefix-cache", action="store_true")
    args = p.parse_args()
    if args.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    config = load_config(args.stage_config, check_paths=False)
    stage = config.stage(args.stage)
    if args.orchestrator is None:
        args.orchestrator = control_address(config)
        assert args.orchestrator, "a stage started by hand needs server.control_address"
    print(f"fake stage {stage.name} up (pid {os.getpid()})", flush=True)
    if os.environ.get("FAKE_EXIT_AT_START"):
        print("fake stage: cannot load the model", flush=True)
        return int(os.environ["FAKE_EXIT_AT_START"])
    asyncio.run(FakeStage(config, stage, args.orchestrator, args.replica).run())
    print(f"fake stage {stage.name} shut down", flush=True)
    return 0


if __name__ == "__main__":
    # As a real stage ends (logs and stdio flushed, no interpreter teardown: torch's cost ~0.5 s
    # of CPU per stage on a loaded 2-core machine, for nothing a test reads).
    from workers.__main__ import exit_without_teardown

    exit_without_teardown(main())
