"""A pipeline's identity as its stages announce it: a hash of its shape.

Every stage process puts it in its ``StageReady`` (with the wire's ``PROTOCOL_VERSION``), and the
orchestrator refuses a stage whose hash differs from its own: a stage started by hand from another
config (another pipeline, stages in another order, another model or hand-off) would otherwise be
taken as one of this pipeline's. The hash covers what every process of one pipeline agrees on
whatever host it runs on: the pipeline's name and each stage's name, kind, model, inputs, hand-off,
final output and submodel. It leaves out what legitimately differs between the server's view and a
hand-started stage's (addresses, ``external``, ``env``, the server's command-line overrides such
as ``--no-prefix-cache``)."""

from __future__ import annotations

import hashlib

import msgspec

from omni_cache.config.schema import PipelineConfig

__all__ = ["pipeline_hash"]


def pipeline_hash(config: PipelineConfig) -> str:
    """16 hex digits of sha256 over the pipeline's shape (see the module doc)."""
    shape = {
        "name": config.name,
        "stages": [
            {
                "name": s.name,
                "kind": s.kind,
                "model": s.model,
                "inputs": s.inputs,
                "handoff": s.handoff,
                "final_output": s.final_output,
                "submodel": s.submodel,
            }
            for s in config.stages
        ],
    }
    return hashlib.sha256(msgspec.json.encode(msgspec.to_builtins(shape))).hexdigest()[:16]
