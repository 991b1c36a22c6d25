"""Authenticated, encrypted stage traffic: ZMQ CURVE with keys derived from one shared secret.

Every process of a pipeline (the orchestrator and each stage, on whatever host) reads the same
secret file (``server.stage_auth_key_file``). From it each derives the same CURVE key pair:

* every socket that binds (a stage's inbox, the orchestrator's inbox) is a CURVE server with that
  secret key, and a ZAP handler in its process accepts only clients presenting that public key;
* every socket that connects is a CURVE client with that key pair and that server key.

So a peer without the secret can neither complete a handshake (no frame of it reaches a stage or
the orchestrator) nor read the latents and requests on the wire (CURVE encrypts them). There is
one pipeline-wide identity, not one per host: whoever has the file is a member.

    python -m omni_cache.wire.stage_auth new-key FILE    # writes a fresh secret, mode 0600
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import sys
from pathlib import Path

import zmq
import zmq.auth.thread

#: A secret shorter than this is refused: it would be guessable offline.
MIN_SECRET_CHARS = 32
_KDF_LABEL = b"omni_cache stage CURVE key v1\0"


class StageAuthError(ValueError):
    """The secret file is missing, unreadable or too short."""


class _OnlyOurKey:
    """ZAP credentials provider: accept exactly one client public key."""

    def __init__(self, public_key: bytes) -> None:
        self.public_key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return secrets.compare_digest(key, self.public_key)  # both Z85-encoded


class StageAuth:
    """The pipeline's CURVE key pair, derived from a shared secret."""

    def __init__(self, secret: str) -> None:
        secret = secret.strip()
        if len(secret) < MIN_SECRET_CHARS:
            raise StageAuthError(
                f"the secret has {len(secret)} characters, at least {MIN_SECRET_CHARS} are needed "
                "(python -m omni_cache.wire.stage_auth new-key FILE writes one)"
            )
        # Any 32 bytes are a Curve25519 secret key (the scalar is clamped when used).
        raw = hashlib.sha256(_KDF_LABEL + secret.encode()).digest()
        self.secret_key = zmq.utils.z85.encode(raw)
        self.public_key = zmq.curve_public(self.secret_key)
        self._authenticators: list[zmq.auth.thread.ThreadAuthenticator] = []

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> StageAuth:
        p = Path(path).expanduser()
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise StageAuthError(f"cannot read the stage key file {str(p)!r}: {e.strerror or e}") from None
        try:
            return cls(text)
        except StageAuthError as e:
            raise StageAuthError(f"stage key file {str(p)!r}: {e}") from None

    def secure(self, sock: zmq.Socket, *, bind: bool) -> None:
        """Make ``sock`` a CURVE server (``bind``) or client; call before bind/connect."""
        if bind:
            sock.curve_server = True
            sock.curve_secretkey = self.secret_key
            sock.curve_publickey = self.public_key
        else:
            sock.curve_serverkey = self.public_key
            sock.curve_secretkey = self.secret_key
            sock.curve_publickey = self.public_key

    def guard(self, ctx: zmq.Context) -> None:
        """Start the ZAP handler of ``ctx``'s process: without it libzmq lets any CURVE client in.
        Once per context, before its first binding socket (an asyncio context is shadowed: the
        handler thread needs a plain socket on the same libzmq context)."""
        plain = ctx if type(ctx) is zmq.Context else zmq.Context.shadow(ctx.underlying)
        auth = zmq.auth.thread.ThreadAuthenticator(plain)
        auth.start()
        auth.configure_curve_callback("*", _OnlyOurKey(self.public_key))
        self._authenticators.append(auth)

    def stop(self) -> None:
        """Stop the ZAP handlers (before the context is terminated)."""
        for auth in self._authenticators:
            auth.stop()
        self._authenticators.clear()


def load_stage_auth(config: object) -> StageAuth | None:
    """The pipeline's StageAuth when ``server.stage_auth_key_file`` is set, else None."""
    path = getattr(getattr(config, "server", None), "stage_auth_key_file", None)
    return StageAuth.from_file(path) if path else None


def new_secret() -> str:
    """A fresh random secret (64 characters)."""
    return secrets.token_urlsafe(48)


def write_secret(path: str | os.PathLike[str], secret: str) -> Path:
    """Write ``secret`` to ``path``, a new file readable by this user only (refusing to overwrite)."""
    p = Path(path).expanduser()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return p


def new_key(path: str | os.PathLike[str]) -> Path:
    """Write a fresh random secret to ``path`` (mode 0600, refusing to overwrite)."""
    return write_secret(path, new_secret())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omni_cache.wire.stage_auth", description="stage authentication keys"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    nk = sub.add_parser("new-key", help="write a fresh shared secret (mode 0600) to FILE")
    nk.add_argument("file")
    args = parser.parse_args(argv)
    try:
        print(
            f"wrote {new_key(args.file)}; copy it to every host of the pipeline and set "
            "server.stage_auth_key_file to its path"
        )
    except FileExistsError:
        print(f"python -m omni_cache.wire.stage_auth: {args.file} exists, not overwritten", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
