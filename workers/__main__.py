"""Start one stage process by hand (possibly on another host):

    .venv/bin/python -m workers --stage-config x.yaml --stage NAME [--replica I] [--orchestrator ADDR]

It binds the stage's address (or its `bind_address`) from the config, connects to its downstream
stages' addresses and announces itself to the orchestrator every heartbeat interval, so a pipeline
can span machines when the config uses tcp:// addresses, and `omni-serve` finds stages started
before or after it (mark them `external`). `omni-serve` starts its own stages the same way.
The stage's `env:` is applied to this process before any model library is imported, and only
this stage's model path is checked (`--no-path-check` skips that too).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage-config", required=True, help="pipeline YAML")
    parser.add_argument("--stage", required=True, help="name of the stage to run")
    parser.add_argument(
        "--replica",
        type=int,
        default=0,
        help="which replica of the stage to run (0 .. its replicas - 1): it binds that replica's address",
    )
    parser.add_argument(
        "--orchestrator", default=None, help="orchestrator inbox address (default: the config's control address)"
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer our parent")
    parser.add_argument("--checkpoint-dir", default=None, help="where tiny:* checkpoints live")
    parser.add_argument(
        "--no-prefix-cache", action="store_true", help="turn off vLLM prefix caching and the hidden-state cache"
    )
    parser.add_argument(
        "--no-path-check",
        action="store_true",
        help="do not require this stage's model path (or the stage key file) to exist",
    )
    parser.add_argument("--log-level", default=os.environ.get("OMNI_CACHE_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format=f"%(asctime)s [{args.stage}] %(levelname)s %(name)s: %(message)s"
    )

    from omni_cache.config import ConfigError, load_config
    from omni_cache.config.errors import IssueCollector
    from omni_cache.config.stage_addresses import check_hand_started

    try:
        # Only this stage's model must exist here: the others run on their own hosts.
        config = load_config(args.stage_config, check_paths=False if args.no_path_check else {args.stage})
        # The addresses a config leaves unset are chosen by a server when it starts: a stage
        # started from the file cannot know them (a spawned one's file has them filled in).
        issues = IssueCollector(args.stage_config)
        check_hand_started(config, {args.stage}, issues, announces_to_config=args.orchestrator is None)
        issues.raise_if_any()
        if args.checkpoint_dir:
            config.checkpoint_dir = args.checkpoint_dir
        stage = config.stage(args.stage)
        if not 0 <= args.replica < stage.replicas:
            print(
                f"python -m workers: --replica: stage {stage.name!r} has {stage.replicas} "
                f"replica(s) (0 .. {stage.replicas - 1}), got {args.replica}",
                file=sys.stderr,
            )
            return 2
    except ConfigError as exc:
        for issue in exc.issues:
            print(f"python -m workers: config error: {issue}", file=sys.stderr)
        return 2
    except KeyError as exc:
        print(f"python -m workers: --stage: {exc.args[0]}", file=sys.stderr)
        return 2
    # The stage's env (thread counts, KV cache size, ...) must be set before torch/vLLM load;
    # omni-serve sets it for the stages it spawns, a stage started by hand sets it here.
    os.environ.update(stage.env)
    if args.orchestrator is None:
        args.orchestrator = config.server.control_address
    die_with_parent(args.parent_pid)

    from workers.stage_process import serve_stage

    return serve_stage(
        config,
        args.stage,
        orchestrator=args.orchestrator,
        parent_pid=args.parent_pid,
        prefix_cache=False if args.no_prefix_cache else None,
        replica=args.replica,
    )


def die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to SIGTERM us when the parent exits, so a crashed server leaves no orphans."""
    if not parent_pid or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def exit_without_teardown(code: int) -> None:
    """End the stage process once :func:`main` has returned: its sockets are closed and its
    requests answered or failed by then, so what the interpreter's own teardown would still do is
    process-local work the OS undoes anyway: vLLM's exit handlers (``EngineCore.shutdown``: two
    full garbage collections and a process group this process alone joined) and the freeing of
    the model, the KV cache and every module. That took 2-5 s per stage on a 2-core host, during
    which the process still held its memory and a supervisor waited on it. Logs and stdio are
    flushed first; an exception out of :func:`main` still goes the usual way (traceback, exit 1)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
