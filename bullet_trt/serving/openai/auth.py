"""The API key check: with a key set, every /v1 request needs ``Authorization: Bearer <key>``."""
from __future__ import annotations

import hmac

from fastapi import Request

from bullet_trt.serving.openai.errors import OpenAIError


def api_key_check(api_key: str | None):
    """A FastAPI dependency; without a key it lets every request through."""

    async def check(request: Request) -> None:
        if not api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise OpenAIError(401, "invalid API key: send it as 'Authorization: Bearer <key>'",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check
