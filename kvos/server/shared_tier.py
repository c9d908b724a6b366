"""The shared tier of the state directory (``kvos serve --store valkey://...``): sessions any replica can
continue.

Every replica keeps its own state directory (:mod:`kvos.server.state`) and publishes each snapshot it
commits to one Valkey (or Redis) server, where another replica finds it when a request for that session
lands there (a restart elsewhere, a rebalance, a dead replica). Keys, under ``kvos:<state key>:`` (the state
key hashes the model's fingerprint and the session settings, so another model or budget never matches)::

    b:<digest>            a file's bytes (a snapshot or a chunk file), addressed by their blake2b-256: two
                          sessions or replicas that write the same K/V store it once
    e:<owner>:<session>   a session's entry (JSON): its generation, its manifest, the digest of every file
                          of every branch; owner and session id are hashed into the key
    g:<owner>:<session>   its generation, the version check: an entry is replaced only by the writer of the
                          generation it read (a Lua script), so two replicas never both write it unseen
    p:<chain hash>        a session holding a token prefix: for every 64 tokens of each branch's history,
                          the hash chain of the owner and the prefix's tokens -> the session id (a request
                          with no session, or a new session sharing an agent's system prompt, finds it by
                          its own prompt's hashes: one read of at most prompt/64 keys)

Every key carries the session TTL, refreshed on each write (a blob by every entry that names it), so Valkey's
own ``maxmemory`` and eviction policy bound the bytes. A blob Valkey evicted, or one whose bytes do not match
their digest, is never served: the file is left missing, and the snapshot's restore recomputes the chunk
from its tokens (or, for a missing snapshot, the session is prefilled again from the client's conversation).

While Valkey cannot be reached the replica keeps serving from its own tiers: every call returns "down" or
nothing at once, a warning is logged once per outage, :attr:`ValkeyTier.errors` counts the failures (the
``kvos_store_tier_*`` metrics), and a call after :data:`RETRY_S` tries again. A call Valkey answers with an
error (out of memory under ``maxmemory`` with ``noeviction``, a user the ACL does not allow) fails alone, the
same way, logged and counted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

_log = logging.getLogger("kvos.server.state")

RETRY_S = 2.0  # after a failure, calls return at once for this long before trying Valkey again
TIMEOUT_S = 5.0  # socket and connect timeout of a call
PREFIX_STEP = 64  # tokens between two entries of the prefix index
# KEYS: generation, entry. ARGV: the generation the writer read, the new one, the entry, the TTL. Returns -1
# when written, else the generation found (the writer's copy is stale).
_COMMIT = """
local found = tonumber(redis.call('GET', KEYS[1]) or '0')
if found ~= tonumber(ARGV[1]) then return found end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[4])
redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
return -1
"""

Published = Literal["written", "conflict", "down"]
DOWN: Any = object()  # what a call returns while Valkey cannot be reached


def digest(data: bytes) -> str:
    """A blob's address: the hex blake2b-256 of its bytes."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def _hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def prefix_hashes(owner: str, tokens: list[int]) -> list[tuple[int, str]]:
    """(length, hash) of every prefix of ``tokens`` whose length is a multiple of :data:`PREFIX_STEP`: a
    chain that starts from the owner, so another key's identical prompt never meets it."""
    chain, out = hashlib.blake2b(owner.encode(), digest_size=16).digest(), []
    for end in range(PREFIX_STEP, len(tokens) + 1, PREFIX_STEP):
        step = b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[end - PREFIX_STEP : end])
        chain = hashlib.blake2b(chain + step, digest_size=16).digest()
        out.append((end, chain.hex()))
    return out


@dataclass
class TierEntry:
    """A session as the tier holds it: ``manifest`` (the state directory's, see
    :mod:`kvos.server.layout`), and per branch directory name the digest of each of its files."""

    generation: int
    manifest: dict[str, Any]
    files: dict[str, dict[str, str]]


class ValkeyTier:
    """One Valkey database shared by the replicas of one model and settings (see the module docstring)."""

    def __init__(self, url: str, namespace: str, ttl_s: float) -> None:
        """``url``: ``valkey://[user:password@]host:port/db`` (``valkeys://`` for TLS; ``redis://`` and
        ``rediss://`` too); ``namespace``: the state key; ``ttl_s``: the session TTL."""
        import valkey

        scheme, sep, rest = url.partition("://")
        schemes = {"valkey": "redis", "valkeys": "rediss", "redis": "redis", "rediss": "rediss"}
        if not sep or scheme not in schemes:
            raise ValueError(f"--store {url!r}: expected valkey://[user:password@]host:port/db")
        self.url = url
        self.client = valkey.Valkey.from_url(
            f"{schemes[scheme]}://{rest}", socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self.unreachable = (valkey.exceptions.ConnectionError, valkey.exceptions.TimeoutError, OSError)
        self.failing = valkey.exceptions.ValkeyError  # e.g. OOM under maxmemory with noeviction, a bad ACL
        self.prefix, self.ttl = f"kvos:{namespace}:", max(1, int(ttl_s))
        self._commit = self.client.register_script(_COMMIT)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.up = True
        self.errors = 0  # failed calls (Valkey unreachable or failing)
        self.conflicts = 0  # snapshots refused because another replica wrote the session meanwhile
        self.missing_blobs = 0  # files an entry names that Valkey no longer has (evicted) or that were bad

    # ---------------------------------------------------------------- keys
    def _session(self, kind: str, owner: str, session_id: str) -> str:
        return f"{self.prefix}{kind}:{_hash(owner)}:{_hash(session_id)}"

    def _blob(self, address: str) -> str:
        return f"{self.prefix}b:{address}"

    def _prefix(self, chain: str) -> str:
        return f"{self.prefix}p:{chain}"

    # ------------------------------------------------------------- health
    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, or :data:`DOWN` while Valkey is down (marked on a failure, tried again after
        RETRY_S)."""
        if time.monotonic() < self._down_until:
            return DOWN
        try:
            result = fn(*args)
        except self.unreachable as e:
            with self._lock:
                self.errors += 1
                self._down_until = time.monotonic() + RETRY_S
                if self.up:
                    _log.warning("store %s unreachable (%s: %s): serving from local tiers", self.url, what, e)
                self.up = False
            return DOWN
        except self.failing as e:  # it answered, with an error: this call failed, the next one may not
            with self._lock:
                self.errors += 1
            _log.warning("store %s: %s failed (%s)", self.url, what, e)
            return DOWN
        if not self.up:
            with self._lock:
                self.up = True
            _log.warning("store %s reachable again", self.url)
        return result

    def ping(self) -> bool:
        """Whether Valkey answers now (a call, even within RETRY_S of a failure)."""
        self._down_until = 0.0
        return self._call("ping", self.client.ping) is True

    # ------------------------------------------------------------- writes
    def publish(
        self, owner: str, session_id: str, read: int, entry: TierEntry, paths: dict[str, Path]
    ) -> Published:
        """Put ``entry`` (generation ``read + 1``) if the tier's generation of the session is still ``read``.
        ``paths``: digest -> a local file with those bytes (uploaded unless Valkey holds the digest)."""
        if self._call("publish", self._put_blobs, paths) is DOWN:
            return "down"
        keys = [self._session(kind, owner, session_id) for kind in ("g", "e")]
        body = json.dumps({"generation": entry.generation, "manifest": entry.manifest, "files": entry.files})
        found = self._call("publish", self._commit, keys, [read, entry.generation, body, self.ttl])
        if found is DOWN:
            return "down"
        if int(found) != -1:
            self.conflicts += 1
            _log.warning(
                "session %s: another replica wrote generation %s since this one read %d: this copy is stale "
                "and not published",
                session_id,
                found,
                read,
            )
            return "conflict"
        histories = entry.manifest.get("histories", [])
        self._call("publish", self._index, owner, session_id, histories)
        return "written"

    def _index(self, owner: str, session_id: str, histories: list[list[int]]) -> None:
        """Point every 64-token prefix of each branch's history at the session (see the module docstring)."""
        pipe = self.client.pipeline(transaction=False)
        for history in histories:
            for _, chain in prefix_hashes(owner, history):
                pipe.set(self._prefix(chain), session_id, ex=self.ttl)
        pipe.execute()

    def _put_blobs(self, paths: dict[str, Path]) -> None:
        """Refresh the TTL of every blob Valkey holds; upload the others."""
        addresses = sorted(paths)
        pipe = self.client.pipeline(transaction=False)
        for address in addresses:
            pipe.expire(self._blob(address), self.ttl)
        held = pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        for address, there in zip(addresses, held, strict=True):
            if not there:
                pipe.set(self._blob(address), paths[address].read_bytes(), ex=self.ttl)
        pipe.execute()

    def forget(self, owner: str, session_id: str) -> None:
        """Delete a session's entry (its blobs expire with their TTL: other sessions may share them)."""
        keys = [self._session("g", owner, session_id), self._session("e", owner, session_id)]
        self._call("forget", self.client.delete, *keys)  # its prefix pointers lead nowhere now: skipped

    # -------------------------------------------------------------- reads
    def generation(self, owner: str, session_id: str) -> int | None:
        """The tier's generation of a session (0: none); None while Valkey is down."""
        found = self._call("generation", self.client.get, self._session("g", owner, session_id))
        return None if found is DOWN else int(found or 0)

    def entry(self, owner: str, session_id: str) -> TierEntry | None:
        """A session's entry, or None (none, unreadable, another owner's, or Valkey down)."""
        raw = self._call("entry", self.client.get, self._session("e", owner, session_id))
        if raw is DOWN or raw is None:
            return None
        try:
            body = json.loads(raw)
            found = TierEntry(int(body["generation"]), dict(body["manifest"]), dict(body["files"]))
        except (ValueError, KeyError, TypeError) as e:
            _log.warning("session %s: its entry in %s cannot be read (%s)", session_id, self.url, e)
            return None
        if found.manifest.get("owner") != owner or found.manifest.get("session_id") != session_id:
            return None
        return found

    def holder(self, owner: str, tokens: list[int]) -> tuple[str, int] | None:
        """The session of ``owner`` that published the longest prefix of ``tokens`` (a multiple of 64
        tokens) and that prefix's length; None when none did (or Valkey is down)."""
        chains = prefix_hashes(owner, tokens)
        if not chains:
            return None
        found = self._call("holder", self.client.mget, [self._prefix(c) for _, c in chains])
        if found is DOWN:
            return None
        for (length, _), sid in zip(reversed(chains), reversed(found), strict=True):
            if sid is not None:
                return (sid.decode() if isinstance(sid, bytes) else str(sid)), length
        return None

    def materialise(self, entry: TierEntry, directory: Path) -> int:
        """Write ``entry``'s files into ``directory`` (a branch directory per branch; what is there is
        replaced): each blob checked against its digest; a blob Valkey no longer has, or a bad one, is left
        out (logged, counted). Returns the number of files written; OSError from the local disk."""
        wanted = [(b, name, address) for b, files in entry.files.items() for name, address in files.items()]
        blobs = self._call("materialise", self._get_blobs, [a for _, _, a in wanted])
        if blobs is DOWN:
            raise OSError(f"store {self.url} unreachable")
        written = 0
        for (branch, name, address), data in zip(wanted, blobs, strict=True):
            if data is None or digest(data) != address:
                self.missing_blobs += 1
                _log.warning("file %s/%s: not in the store or damaged: recomputed when needed", branch, name)
                continue
            target = directory / branch / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            written += 1
        return written

    def _get_blobs(self, addresses: list[str]) -> list[bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for address in addresses:
            pipe.get(self._blob(address))
        return list(pipe.execute())

    def close(self) -> None:
        self.client.close()
