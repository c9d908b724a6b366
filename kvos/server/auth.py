"""Who a request is: the bearer key it sends, and whether that key is an admin's.

Without keys (``kvos serve`` with no ``--api-key`` nor ``--admin-key``) every request is ``local``, the one
owner of every session. With keys, every /v1 request and every /metrics scrape needs one: a request's sessions
belong to its key (named by a digest of it, never the key itself), /v1/sessions and /metrics show a key only
its own sessions (and pool-wide totals), and an admin key (``--admin-key``) sees every key's sessions and may
delete any of them.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass


@dataclass(frozen=True)
class Identity:
    """A request's owner (the key's digest, or ``local`` without keys) and whether it may see all."""

    owner: str
    admin: bool

    def scope(self) -> str | None:
        """The owner whose sessions this identity sees; None: every owner's."""
        return None if self.admin else self.owner


LOCAL = Identity("local", admin=False)  # without keys: the one owner, so its own sessions are all of them


def key_id(key: str) -> str:
    """A key's public name: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class Keys:
    """The server's API keys and admin keys."""

    def __init__(self, api_keys: list[str] | None = None, admin_keys: list[str] | None = None) -> None:
        self.keys = {key_id(k): (k, False) for k in api_keys or []}
        self.keys.update({key_id(k): (k, True) for k in admin_keys or []})

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def identify(self, authorization: str) -> Identity | None:
        """The identity of an ``Authorization`` header's bearer key; None when it is missing or unknown.
        Without keys, everyone is :data:`LOCAL`."""
        if not self.keys:
            return LOCAL
        token = authorization[7:].strip() if authorization.lower().startswith("bearer ") else ""
        digest = key_id(token)
        known = self.keys.get(digest)
        if not token or known is None or not hmac.compare_digest(known[0].encode(), token.encode()):
            return None
        return Identity(digest, admin=known[1])
