"""Tenant scopes of the engines' prefix caches: every request carries a cache salt derived
from its API key (and the client's own `cache_salt`, which narrows the scope further), so
KV cached for one key is never reused for another, and no usage field or timing tells one
tenant whether another sent a prompt. Without API keys, only an explicit `cache_salt`
scopes a request; the rest share one cache."""

from __future__ import annotations

import hashlib


def cache_salt(api_key: str | None, requested_salt: str | None) -> str:
    """The salt the engines scope the request's prefix cache by; "" is the shared scope.
    A digest, so the key itself never travels past the gateway."""
    if not api_key and not requested_salt:
        return ""
    material = b"\0".join([b"microserving-cache-salt-v1", (api_key or "").encode(),
                           (requested_salt or "").encode()])
    return hashlib.sha256(material).hexdigest()[:32]


def bearer_key(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None
