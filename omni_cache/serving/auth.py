"""The API key: its environment variable and the bearer-token check of every route but /health.

No web framework here: ``omni-serve``'s command line reads :data:`API_KEY_ENV` without loading
the HTTP stack.
"""

from __future__ import annotations

import hmac

#: The environment form of ``omni-serve --api-key``.
API_KEY_ENV = "OMNI_CACHE_API_KEY"


def bearer_token_problem(authorization: str, api_key: str | None) -> str | None:
    """Why a request with this ``Authorization`` header is refused (401), or None if it may pass.

    No ``api_key`` set: every request passes. The comparison takes the same time whatever the
    token (``hmac.compare_digest``).
    """
    if not api_key:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return "missing API key: send 'Authorization: Bearer <key>'"
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return "incorrect API key provided"
    return None
