"""API-key checks: `Authorization: Bearer <key>` against the configured keys.

Keys are compared in constant time against every configured key (no early exit) and are never
logged. With no keys configured the gateway is open.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from fastapi import Request

from gateway.errors import UNAUTHENTICATED, GatewayError


class ApiKeyChecker:
    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = [key.encode() for key in keys if key]

    @property
    def is_enabled(self) -> bool:
        return bool(self._keys)

    def is_valid(self, given: str) -> bool:
        given_bytes = given.encode()
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(given_bytes, key)
        return matched

    def check(self, authorization: str | None) -> None:
        """Raises a 401 GatewayError unless `authorization` carries a valid key."""
        if not self.is_enabled:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise GatewayError(UNAUTHENTICATED, "missing API key: send 'Authorization: Bearer <key>'")
        if not self.is_valid(token.strip()):
            raise GatewayError(UNAUTHENTICATED, "invalid API key")

    async def __call__(self, request: Request) -> None:
        """FastAPI dependency form."""
        self.check(request.headers.get("authorization"))
