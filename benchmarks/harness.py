"""The end-to-end benchmark's runs: start a private pipeline per side (cache on, cache off), drive
it with the workload, collect samples, server counters and what the machine was doing.

Every side is one ``omni-serve`` in a process of its own (:class:`ServerProcess`), on a private
copy of the stage config: its own pipeline name, ``ipc://`` socket paths under
``/tmp/omni_cache/bench-<pid>-<side>/`` and HTTP port 0, so it never clashes with a server that is
already running on the machine (``make serve``) or with another benchmark. All sides are started
first and stay alive for the whole run; the measured requests then go in rounds
(:func:`run_rounds`): in each round every side serves the round's requests, one side after the
other, the order alternating from round to round, so that each side's figures are paired with the
other side's from the same minutes (this machine's speed drifts by 10-30% over tens of seconds)
and both sides share the machine with the same idle processes. The client runs in this process,
the servers do not: nothing of one side's HTTP handling competes with the client for this
process's interpreter.

The side's processes are in :mod:`benchmarks.side_processes`, the machine's view in
:mod:`benchmarks.machine_monitor`, the pooled result in :mod:`benchmarks.harness_results`; the
classes and functions of ``__all__`` are this module's public surface, wherever they are defined.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import profiles
from benchmarks.client import Driver, Sample, counter_deltas, scrape_metrics, served_model
from benchmarks.machine_monitor import Monitor, machine_info
from benchmarks.side_processes import CpuBurners, ManagedServer, ServerProcess, private_config, socket_dir
from benchmarks.vllm_serve_side import VLLM_SIDE, VllmServeProcess
from benchmarks.workloads import Session

__all__ = ["CpuBurners", "ManagedServer", "Monitor", "ServerProcess", "machine_info", "private_config", "run_rounds"]


def command_line(module: str = "benchmarks") -> str:
    return shlex.join([".venv/bin/python", "-m", module, *sys.argv[1:]])


def _progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr (or a minimal stand-in when tqdm is missing or the bar is off)."""
    if enabled:
        with contextlib.suppress(ImportError):
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True, leave=True)

    class _Quiet:
        def update(self, n: int = 1) -> None: ...
        def set_postfix_str(self, s: str) -> None: ...
        def close(self) -> None: ...

    return _Quiet()


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def warm_up(
    url: str,
    model: str,
    warmup: list[Session],
    *,
    api_key: str | None,
    label: str,
    audio: bool = True,
    one_message: bool = False,
) -> list[dict[str, Any]]:
    """Send the warm-up sessions (not measured); fails when one of them fails."""
    driver = Driver(url, model, api_key=api_key, audio=audio, one_message=one_message)
    warm = asyncio.run(driver.warmup(warmup))
    bad = [w for w in warm if not w.ok]
    if bad:
        raise RuntimeError(f"{label}: the warm-up request failed: {bad[0].error}")
    return [w.to_dict() for w in warm]


def measure(
    url: str,
    model: str,
    sessions: list[Session],
    *,
    api_key: str | None,
    concurrency: int | None,
    rate: float | None,
    label: str,
    progress: bool,
    monitor: Monitor | None = None,
    processes: Callable[[], dict] | None = None,
    profile: profiles.Recorder | None = None,
    request_timeout_s: float = 600.0,
    audio: bool = True,
    one_message: bool = False,
    stagger_s: float = 0.0,
) -> dict[str, Any]:
    """Run the measured sessions against ``url``: samples, counters, resources of ``processes``
    (name -> pid), and a py-spy profile of them when ``profile`` is given. ``stagger_s``: the
    closed loop's clients open k * stagger_s apart (:class:`client.Driver`)."""
    total = sum(s.turns for s in sessions)
    errors = 0
    bar = _progress(total, f"{label:>9}", progress)

    def on_done(s: Sample) -> None:
        nonlocal errors
        errors += not s.ok
        bar.update(1)
        ttfa = f"{s.ttfa_s * 1000:.0f} ms" if s.ttfa_s is not None else "-"
        bar.set_postfix_str(f"last TTFA {ttfa}" + (f", {errors} error(s)" if errors else ""))

    driver = Driver(
        url,
        model,
        api_key=api_key,
        concurrency=concurrency,
        rate=rate,
        request_timeout_s=request_timeout_s,
        audio=audio,
        one_message=one_message,
        on_done=on_done,
        stagger_s=stagger_s,
    )
    before = asyncio.run(scrape_metrics(url, api_key))
    pids = processes() if processes is not None else {}
    with profile.record(pids) if profile is not None else contextlib.nullcontext():
        if monitor is not None and pids:
            monitor.begin(pids)
        samples = asyncio.run(driver.run(sessions))
        resources = monitor.end() if monitor is not None and pids else None
    after = asyncio.run(scrape_metrics(url, api_key))
    bar.close()
    samples.sort(key=lambda s: (s.start_s, s.id))
    return {
        "model": model,
        "duration_s": driver.t_end - driver.t_base,
        "samples": [s.to_dict() for s in samples],
        "counters": counter_deltas(before, after),
        "resources": resources,
    }


def drive(
    url: str,
    model: str | None,
    warmup: list[Session],
    sessions: list[Session],
    *,
    api_key: str | None,
    concurrency: int | None,
    rate: float | None,
    label: str,
    progress: bool,
    request_timeout_s: float = 600.0,
    audio: bool = True,
    one_message: bool = False,
    stagger_s: float = 0.0,
) -> dict[str, Any]:
    """Warm up, then run the measured sessions against a running server (``--url``)."""
    model = model or asyncio.run(served_model(url, api_key))
    warm = warm_up(url, model, warmup, api_key=api_key, label=label, audio=audio, one_message=one_message)
    out = measure(
        url,
        model,
        sessions,
        api_key=api_key,
        concurrency=concurrency,
        rate=rate,
        label=label,
        progress=progress,
        request_timeout_s=request_timeout_s,
        audio=audio,
        one_message=one_message,
        stagger_s=stagger_s,
    )
    return {**out, "warmup": warm}


def cache_of(side: str) -> bool:
    """Whether a side runs with the prefix cache: ``on``, ``on2``, ... do, ``off``, ``off2``, ...
    do not (two sides of the same setting measure the machine's own spread: an A/A run)."""
    return side.startswith("on")


def compared_sides(sides: Sequence[str]) -> tuple[str, str] | None:
    """The two sides whose ratios a run reports, (first, second): ``on`` and ``off`` when both ran
    (speedup = off / on), else the two sides of a two-side run in the order given."""
    if "on" in sides and "off" in sides:
        return "on", "off"
    return (sides[0], sides[1]) if len(sides) == 2 else None


#: How the sides take turns: ``alternate`` (the order of ``--sides`` in even rounds, reversed in
#: odd ones: A B, B A, A B, ...) or ``same`` (A B, A B, ...).
ORDERS = ("alternate", "same")


def side_order(sides: list[str], round_index: int, order: str = "alternate") -> list[str]:
    """The order the sides run in round ``round_index`` (:data:`ORDERS`)."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; expected one of {', '.join(ORDERS)}")
    return list(sides) if order == "same" or round_index % 2 == 0 else list(sides)[::-1]


def restart_blocks(n_rounds: int, every: int) -> list[range]:
    """The rounds each start of the pipelines serves: blocks of ``every`` rounds (0: one start
    for all of them). A pipeline instance keeps for its life whatever its start gave it (where
    its memory landed, its heap's layout, how the scheduler paired its processes on the cores):
    in A/A runs one instance was a few percent faster than its twin in every round, and which
    one changed from start to start. Fresh instances every few rounds turn that edge into noise
    the rounds average over."""
    if every < 0:
        raise ValueError(f"restart every {every} rounds: want 0 (never) or more")
    step = every or max(n_rounds, 1)
    return [range(i, min(i + step, n_rounds)) for i in range(0, n_rounds, step)]


def block_round_order(sides: Sequence[str], block: int, round_in_block: int, order: str = "alternate") -> list[str]:
    """The sides' turns in a round of a start's block: :func:`side_order` counted from the block's
    own first round, shifted by one every other block. Counting from the round number instead let
    the first side of ``sides`` lead every block's first round and so go second, after the other
    side's two runs, in every block's second round: an idle pipeline's heap is given back to the
    system and faulted in again, and that side faulted 1.4-1.7x as often in those rounds."""
    return side_order(list(sides), block + round_in_block, order)


def start_order(sides: Sequence[str], block: int) -> list[str]:
    """The order the sides are started and warmed up in for ``block``: as given in even blocks,
    reversed in odd ones, so no side is always the one spawned and warmed first."""
    return list(sides) if block % 2 == 0 else list(sides)[::-1]


def _start_sides(
    stack: contextlib.ExitStack,
    tmp: str,
    config_path: str,
    sides: list[str],
    *,
    checkpoint_dir: str | None,
    stage_env: dict[str, str] | None,
    timeline_dir: str | None,
) -> dict[str, Any]:
    """Start every side's server at once (in the order of ``sides``) and wait until all serve;
    each is stopped when ``stack`` closes."""
    from omni_cache.timeline import TIMELINE_DIR_ENV

    servers: dict[str, Any] = {}
    # All sides start at once: no side's processes, and the memory they take, are always the
    # older ones (in A/A runs the side started first was the slower one in 5 runs of 5).
    for side in sides:
        stack.callback(shutil.rmtree, socket_dir(side), True)
        env = {TIMELINE_DIR_ENV: os.path.join(timeline_dir, side)} if timeline_dir else None
        path = private_config(config_path, tmp, side, stage_env)
        if side == VLLM_SIDE:  # the thinker's engine alone: `vllm serve` (benchmarks/vllm_serve_side.py)
            servers[side] = VllmServeProcess(path, checkpoint_dir=checkpoint_dir)
        else:
            servers[side] = ServerProcess(path, prefix_cache=cache_of(side), checkpoint_dir=checkpoint_dir, env=env)
        stack.push(servers[side])  # stopped on the way out, started or not
        servers[side].start()
    log(f"starting {', '.join(sides)} at once (stage logs hidden) ...")
    for side, srv in servers.items():
        srv.wait_ready()
        log(f"cache {side}: ready after {srv.startup_s:.1f} s at {srv.url}")
    return servers


def run_rounds(
    config_path: str,
    sides: list[str],
    warmup: list[Session],
    rounds: list[list[Session]],
    *,
    concurrency: int | None,
    rate: float | None,
    progress: bool,
    monitor: Monitor,
    checkpoint_dir: str | None = None,
    stage_env: dict[str, str] | None = None,
    audio: bool = True,
    one_message: bool = False,
    profile: profiles.Recorder | None = None,
    timeline_dir: str | None = None,
    cpu_burners: int = 0,
    order: str = "alternate",
    restart_every: int = 0,
    on_run: Callable[[dict[str, Any]], None] | None = None,
    stagger_s: float = 0.0,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start every side's pipeline (``omni-serve`` in a process of its own, cache on or off), warm
    each up, then run ``rounds``: round r's sessions on every side, in the order of ``sides`` for
    even r and reversed for odd r (counted within each start's block: :func:`block_round_order`).
    ``restart_every`` K > 0: the pipelines are stopped and started
    afresh every K rounds (:func:`restart_blocks`; the start and warm-up order alternating,
    :func:`start_order`); 0: they stay up until the last round has run. Returns the runs (one
    per side and round: samples, counters, resources) and per side its start-up times and first
    warm-up's samples. ``timeline_dir``: every side's processes write their request timelines
    (omni_cache.timeline) under ``timeline_dir/<side>``. ``cpu_burners``: that many
    :class:`CpuBurners` run while the rounds run. ``on_run`` sees each run as it
    ends."""
    runs: list[dict[str, Any]] = []
    info: dict[str, Any] = {side: {"startups_s": []} for side in sides}
    with contextlib.ExitStack() as outer:
        tmp = outer.enter_context(tempfile.TemporaryDirectory(prefix="omni_cache_bench_"))
        for b, block in enumerate(restart_blocks(len(rounds), restart_every)):
            with contextlib.ExitStack() as stack:
                servers = _start_sides(
                    stack,
                    tmp,
                    config_path,
                    start_order(sides, b),
                    checkpoint_dir=checkpoint_dir,
                    stage_env=stage_env,
                    timeline_dir=timeline_dir,
                )
                models = {side: asyncio.run(served_model(srv.url)) for side, srv in servers.items()}
                for side, srv in servers.items():
                    warm = warm_up(
                        srv.url,
                        models[side],
                        warmup,
                        api_key=None,
                        label=f"cache {side}",
                        audio=audio,
                        one_message=one_message,
                    )
                    info[side]["startups_s"].append(srv.startup_s)
                    info[side].setdefault("startup_s", srv.startup_s)
                    info[side].setdefault("warmup", warm)
                if cpu_burners:  # beside the rounds only, not the start-ups
                    log(f"{cpu_burners} CPU burner(s) on")
                    stack.enter_context(CpuBurners(cpu_burners))
                for r in block:
                    sessions = rounds[r]
                    for side in block_round_order(sides, b, r - block.start, order):
                        srv = servers[side]
                        log(f"round {r + 1}/{len(rounds)}, cache {side}: {sum(s.turns for s in sessions)} request(s)")
                        if profile is not None:
                            profile.tag = f"{side}-r{r}"
                        out = measure(
                            srv.url,
                            models[side],
                            sessions,
                            api_key=None,
                            concurrency=concurrency,
                            rate=rate,
                            label=f"cache {side}",
                            progress=progress,
                            monitor=monitor,
                            processes=srv.processes,
                            profile=profile,
                            audio=audio,
                            one_message=one_message,
                            stagger_s=stagger_s,
                        )
                        restarts = sum(int(c.get("restarts", 0)) for c in (out["counters"] or {}).values())
                        if restarts:
                            log(f"cache {side}: WARNING: {restarts} stage restart(s) during round {r + 1}")
                        for sample in out["samples"]:
                            sample["round"] = r
                        run = {"side": side, "round": r, "start": b, **out}
                        runs.append(run)
                        if on_run is not None:
                            on_run(run)
            log("pipelines stopped")
    return runs, info
