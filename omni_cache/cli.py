"""``omni-serve``: load and validate a stage config, print what it describes, then serve it.

    omni-serve --stage-config stage_configs/tiny_omni.yaml --check

exits 0 after printing the pipeline's summary when the config is valid, and 2 with
``omni-serve: config error: <file>: <key path>: <message>`` on stderr when it is not. Without
``--check`` the pipeline is started by ``omni_cache.serving.server.serve(config, args)``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from omni_cache.config import CHECKPOINTS_ENV, ConfigError, ConfigIssue, PipelineConfig, checkpoint_root, load_config
from omni_cache.config.addresses import run_root
from omni_cache.config.replicas import replica_name, stage_replicas
from omni_cache.serving.auth import API_KEY_ENV

PROG = "omni-serve"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: The module whose ``serve(config, args)`` runs the pipeline, imported only to serve (``--check``
#: needs no web framework).
SERVER_MODULE = "omni_cache.serving.server"

EXIT_OK = 0
EXIT_CONFIG_ERROR = 2


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer port, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {value}")
    return value


def _log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.lower()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Serve a multi-stage omni model pipeline (thinker -> talker -> decoder, each stage "
            "its own process) described by one YAML stage config."
        ),
        epilog=(
            "exit status: 0 served / config valid (--check), 1 serving not available, 2 invalid config or arguments"
        ),
    )
    parser.add_argument(
        "--stage-config",
        required=True,
        metavar="PATH",
        help="YAML file describing the pipeline's stages (e.g. stage_configs/tiny_omni.yaml)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="validate the config, print its summary and exit (0 when valid, 2 when not)",
    )
    parser.add_argument(
        "--no-path-check",
        action="store_true",
        help="do not require filesystem 'model' paths to exist (for a config meant for another host)",
    )
    parser.add_argument("--host", metavar="H", default=None, help="HTTP listen address (overrides server.host)")
    parser.add_argument(
        "--port",
        metavar="P",
        type=_port,
        default=None,
        help="HTTP port, 0 for any free one (overrides server.port)",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require this bearer token from clients (default: ${API_KEY_ENV}; unset = no auth)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        default=None,
        help=(
            "where tiny:* checkpoints are generated (overrides the config's checkpoint_dir; "
            f"without either: ${CHECKPOINTS_ENV}, else ~/.cache/omni_cache/checkpoints)"
        ),
    )
    parser.add_argument(
        "--external-stages",
        metavar="NAMES",
        default=None,
        help=(
            "comma-separated stages started by hand (python -m workers), possibly on other hosts, "
            "or 'all': omni-serve does not spawn them, it waits for them to announce themselves "
            "(sets their 'external' key)"
        ),
    )
    parser.add_argument(
        "--ray-address",
        metavar="ADDR",
        default=None,
        help=(
            "place every stage replica (but external ones) on this Ray cluster, 'auto' (the one "
            "this host joined with ray start) or the head's HOST:PORT; each replica runs under a "
            "Ray actor placed by its stage's 'ray' resources (overrides server.ray_address)"
        ),
    )
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn off prefix caching (vLLM APC and the hidden-state cache) in every stage",
    )
    parser.add_argument(
        "--log-level",
        metavar="L",
        type=_log_level,
        default="info",
        help=f"logging level: {', '.join(LOG_LEVELS)} (default: info)",
    )
    return parser


def apply_overrides(config: PipelineConfig, args: argparse.Namespace) -> PipelineConfig:
    """Apply the command line's --host/--port/--checkpoint-dir/--no-prefix-cache to ``config``."""
    if getattr(args, "host", None):
        config.server.host = args.host
    if getattr(args, "port", None) is not None:
        config.server.port = args.port
    if getattr(args, "ray_address", None):
        config.server.ray_address = args.ray_address
    if getattr(args, "checkpoint_dir", None):
        config.checkpoint_dir = args.checkpoint_dir
    if getattr(args, "no_prefix_cache", False):
        for stage in config.stages:
            if stage.kind == "autoregressive":  # a generation stage has no prefix cache
                stage.prefix_cache = False
    external = getattr(args, "external_stages", None)
    if external:
        names = [n.strip() for n in external.split(",") if n.strip()]
        known = [s.name for s in config.stages]
        if names == ["all"]:
            names = known
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ConfigError(
                ConfigIssue(
                    "--external-stages",
                    None,
                    f"unknown stage(s) {', '.join(map(repr, unknown))} (stages: {', '.join(known)}, or 'all')",
                )
            )
        for stage in config.stages:
            if stage.name in names:
                stage.external = True
    return config


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def format_summary(config: PipelineConfig, *, source: str | None = None, api_key: str | None = None) -> str:
    """A human-readable description of the pipeline: server, checkpoints, and every stage."""
    s = config.server
    lines = [f"pipeline: {config.name}"]
    if source:
        lines.append(f"  config:       {source}")
    lines.append(f"  server:       http://{s.host}:{s.port} (model name {s.served_model_name!r})")
    lines.append(f"  api key:      {'required' if api_key else 'none (no authentication)'}")
    lines.append("  stage auth:   " + (f"CURVE, key file {s.stage_auth_key_file}" if s.stage_auth_key_file else "none"))
    lines.append(f"  limits:       request timeout {s.request_timeout_s:g} s, max message {_mib(s.max_message_bytes)}")
    if any(st.replicas > 1 for st in config.stages):
        note = (
            (" (the thinker replica holding the longest prefix, as its engine reports; else least_loaded)")
            if s.routing == "prefix"
            else ""
        )
        lines.append(f"  routing:      {s.routing}{note}")
    if any(st.model.startswith("tiny:") for st in config.stages):
        lines.append(f"  checkpoints:  {checkpoint_root(config)} (tiny:* models)")
    try:
        order = config.topological_order()
    except ValueError:
        order = list(config.stages)
    lines.append(f"  stages:       {' -> '.join(st.name for st in order)}")
    for st in order:
        lines.append(f"stage {st.name}:")
        lines.append(f"  kind:         {st.kind}")
        lines.append(f"  model:        {st.model}" + (f" (its {st.submodel})" if st.submodel else ""))
        if st.inputs:
            lines.append(f"  inputs:       {', '.join(st.inputs)} (handoff {st.handoff})")
        else:
            lines.append("  inputs:       client request (entry stage)")
        if config.placed_by_ray(st):
            res = st.ray
            asks = f"{res.num_cpus:g} CPU, {res.num_gpus:g} GPU" if res is not None else "1 CPU, 0 GPU"
            lines.append(
                f"  placed by:    Ray ({s.ray_address}): one actor per replica, asking "
                + asks
                + "; address: its node's IP, a port it picks"
                + (f" (the configured {st.address} is not used)" if st.address else "")
            )
            if res is not None:
                for i in range(st.replicas):
                    if res.for_replica(i):
                        lines.append(
                            f"  resources:    {replica_name(st.name, i, st.replicas)}: "
                            + ", ".join(f"{k}={v:g}" for k, v in res.for_replica(i).items())
                        )
        elif st.address is None and not st.replica_addresses:
            lines.append(
                f"  address:      chosen at start: ipc://{run_root()}/<name>-<pid>-<random>/"
                f"{st.name}.sock (this server's own)"
            )
        else:
            lines.append(f"  address:      {st.address}" + (f" (binds {st.bind_address})" if st.bind_address else ""))
            if st.ray is not None and not st.external:
                lines.append("  ray:          used only with --ray-address / server.ray_address")
        if st.replicas > 1 and not config.placed_by_ray(st):
            lines.append(
                f"  replicas:     {st.replicas}: "
                + (
                    ", ".join(f"{r.name} at {r.address}" for r in stage_replicas(st))
                    if st.address or st.replica_addresses
                    else ", ".join(replica_name(st.name, i, st.replicas) for i in range(st.replicas))
                    + " (each its own socket in that directory)"
                )
            )
        if st.external:
            lines.append(
                f"  started:      by hand (external: python -m workers ... --stage {st.name}), not by omni-serve"
            )
        if st.kind == "autoregressive":
            cache = "on" if st.prefix_cache else "off"
            if st.prefix_cache:
                cache += f" (latent cache on {st.latent_cache_device})"
            lines.append(f"  prefix cache: {cache}")
            lines.append(f"  latents:      {st.latents.describe()}")
            engine = st.engine_args.to_vllm_kwargs() if st.engine_args else {}
            if engine:
                lines.append("  engine args:  " + ", ".join(f"{k}={v}" for k, v in engine.items()))
            sp = st.sampling
            lines.append(
                f"  sampling:     temperature={sp.temperature:g}, top_p={sp.top_p:g}, "
                f"max_tokens={sp.max_tokens}" + (f", seed={sp.seed}" if sp.seed is not None else "")
            )
        else:
            lines.append("  prefix cache: n/a (generation stage)")
            g = st.generation
            if g is not None:
                lines.append(
                    f"  generation:   max_batch_size={g.max_batch_size}, chunk_size={g.chunk_size}, device={g.device}"
                )
        if st.pacing is not None:
            pace = st.pacing
            lines.append(
                f"  pacing:       {'on' if pace.enabled else 'measured only'}, "
                f"lead {pace.lead_s:g} s"
                + (f", {pace.token_audio_s:g} s of audio per token" if pace.token_audio_s else "")
                + (f", {pace.ahead_batch_size} windows a batch ahead of time" if pace.ahead_batch_size else "")
                + (f", never more than {pace.max_lead_s:g} s ahead" if pace.max_lead_s else "")
            )
        if st.env:
            lines.append("  env:          " + ", ".join(f"{k}={v}" for k, v in st.env.items()))
        lines.append(f"  final output: {st.final_output or 'none (feeds the next stage)'}")
    return "\n".join(lines)


def _config_error(err: ConfigError) -> int:
    for issue in err.issues or [str(err)]:
        print(f"{PROG}: config error: {issue}", file=sys.stderr)
    return EXIT_CONFIG_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_CONFIG_ERROR)

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    check_paths = not args.no_path_check
    try:
        # The overrides come before the checks: a Ray address, say, changes what is required.
        config = load_config(args.stage_config, check_paths=check_paths, overrides=lambda c: apply_overrides(c, args))
    except ConfigError as e:
        return _config_error(e)

    print(format_summary(config, source=args.stage_config, api_key=args.api_key), flush=True)
    if args.check:
        print("config OK", flush=True)
        return EXIT_OK

    from omni_cache.runtime.supervision.stage_forker import prestart

    forkers = prestart(config)  # they import vLLM while the server module below does
    try:
        server = importlib.import_module(SERVER_MODULE)
        result = server.serve(config, args, forkers)
    finally:
        if forkers is not None:
            forkers.close()
    return int(result) if isinstance(result, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
