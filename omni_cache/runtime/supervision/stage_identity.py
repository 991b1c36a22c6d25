"""Whether an announcing stage speaks this server's protocol and runs this pipeline.

A stage started elsewhere from other code or another config would otherwise be taken silently:
msgspec fills a field an older stage does not send with its default and drops one it does not
know. Its ``StageReady`` carries ``protocol`` (omni_cache.wire.messages.PROTOCOL_VERSION) and
``config_hash`` (omni_cache.config.identity); one that differs is refused (the stage never
counts as up) and the refusal logged once per stage process with both values named."""

from __future__ import annotations

import logging

from omni_cache.wire.messages import PROTOCOL_VERSION, StageReady

logger = logging.getLogger("omni_cache.runtime.supervision.supervisor")

__all__ = ["StageIdentity", "identity_problem"]


def identity_problem(msg: StageReady, config_hash: str) -> str | None:
    """What differs between an announcement and this server (both values named), or None."""
    if msg.protocol != PROTOCOL_VERSION:
        theirs = str(msg.protocol) if msg.protocol else "none (code from before protocol versions)"
        return f"speaks stage protocol {theirs}, this server {PROTOCOL_VERSION}: start it from the same code"
    if msg.config_hash != config_hash:
        return (
            f"runs pipeline config {msg.config_hash or '(none)'}, this server {config_hash}: start it from the "
            "same stage config (its stages' names, kinds, models, inputs, hand-offs and outputs)"
        )
    return None


class StageIdentity:
    """This server's pipeline hash, and the stage processes already refused (logged once each)."""

    def __init__(self, config_hash: str) -> None:
        self.config_hash = config_hash
        self.refused: dict[tuple[str, str, int], str] = {}  # (replica, incarnation, pid) -> why

    def refusal(self, replica: str, msg: StageReady) -> str | None:
        """Why ``msg``'s stage is refused (logged the first time), or None: it is one of ours."""
        problem = identity_problem(msg, self.config_hash)
        if problem is None:
            return None
        key = (replica, msg.incarnation, msg.pid)
        if key not in self.refused:
            self.refused[key] = problem
            logger.error("stage %s (pid %d on %s) refused: it %s", replica, msg.pid, msg.host or "?", problem)
        return problem
