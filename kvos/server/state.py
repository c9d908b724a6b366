"""A server's state directory (``kvos serve --state-dir DIR``): sessions that outlive the process.

Where things go is :mod:`kvos.server.layout`'s. Saved chunks are written as they are saved (each branch's
store writes through); a branch's history and resident chunks are written by
:func:`kvos.session.snapshot.save` when the server snapshots the session (every ``--state-interval`` seconds
while it is idle and changed, and at shutdown). The manifest is the commit point: it is replaced atomically
once every branch's snapshot is written, then files no snapshot names are deleted. Until then a chunk file
the last snapshot names is kept even when its store lets go of it, so after ``kill -9`` the last snapshot
and every file it names are on disk.

Sessions are loaded lazily, on their first request (by owner and session id, or by the longest shared prefix
for requests without one); start-up only sweeps the directory.

With a shared tier (``kvos serve --store valkey://...``, :mod:`kvos.server.shared_tier`) every committed
snapshot is also published there, under a version check, and a session this replica does not hold, or holds
an older copy of than the tier's, is first brought from the tier into this directory and then loaded as
after a restart.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from kvos.errors import KvosError, SnapshotError
from kvos.memory.store import ChunkStore
from kvos.model.fingerprint import model_fingerprint
from kvos.model.tokenizer import Tokenizer
from kvos.model.transformer import Transformer
from kvos.server.layout import MANIFEST, StateLayout, entry_name, read_manifest, write_manifest
from kvos.server.shared_tier import TierEntry, ValkeyTier, digest
from kvos.session import snapshot
from kvos.session.config import SessionConfig
from kvos.session.manager import MemoryManager
from kvos.session.prompt import common_prefix
from kvos.session.session import Session

_log = logging.getLogger("kvos.server.state")


class StateDir:
    """Where a server's sessions are written and read back (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        model_fingerprint: str,
        setup: dict[str, Any],
        ttl_s: float,
        ram_bytes: int | None = None,
        tier_url: str | None = None,
    ) -> None:
        """``setup``: the session settings a snapshot is only valid under (budget, chunk size, ...);
        ``ttl_s``: sessions idle longer are deleted; ``ram_bytes``: each store's RAM cap; ``tier_url``: the
        shared tier's (``valkey://...``), None without one."""
        self.layout = StateLayout(root, model_fingerprint, setup, ttl_s)
        self.base, self.ram_bytes = self.layout.base, ram_bytes
        self.tier = ValkeyTier(tier_url, self.layout.key, ttl_s) if tier_url else None
        self._synced: dict[tuple[str, str], int] = {}  # the tier generation this replica's copy is
        self._digests: dict[Path, str] = {}  # a file's digest, computed once (files are never rewritten)
        self._lock = threading.RLock()
        self._committed: dict[Path, set[str]] = {}  # branch dir -> files its last committed snapshot names
        self._signatures: dict[tuple[str, str], tuple[Any, ...]] = {}
        self._histories: dict[Path, tuple[str, list[list[int]]]] = {}  # manifest -> (id, branch histories)
        self._generation: dict[tuple[str, str], int] = {}
        self.layout.sweep()
        self.layout.log_others()

    @classmethod
    def for_model(
        cls,
        root: Path,
        model: Transformer,
        tokenizer: Tokenizer,
        config: SessionConfig,
        ttl_s: float,
        tier_url: str | None = None,
    ) -> StateDir:
        """The state dir of ``model`` served with the session settings ``config`` (and ``tier_url``'s
        shared tier)."""
        setup = {
            "budget": config.budget.max_active_tokens,
            "policy": config.budget.policy,
            "position_mode": config.position_mode,
            "chunk_tokens": config.chunk_tokens,
            "sink_count": config.sink_count,
        }
        fingerprint = model_fingerprint(model, tokenizer)
        return cls(root, fingerprint, setup, ttl_s, config.store_ram_bytes, tier_url)

    def store_factory(self, session_name: str) -> ChunkStore:
        """A branch's chunk store: writes every saved chunk to the branch's directory at once."""
        directory = self.layout.branch_dir(session_name)
        release = lambda path: self._release(directory, path)  # noqa: E731
        return ChunkStore(self.ram_bytes, directory, write_through=True, release=release)

    def _release(self, directory: Path, path: Path) -> None:
        """A store let go of a file: deleted now, unless the last committed snapshot names it."""
        with self._lock:
            if path.name not in self._committed.get(directory, set()):
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ write
    def save(self, owner: str, session_id: str, served: int, branches: list[Session]) -> bool:
        """Snapshot a session (its branches, latest first) unless nothing changed since its last snapshot;
        under the scheduler, while the session is idle. True when written; a failed write is logged and
        leaves the last snapshot in place."""
        key = (owner, session_id)
        signature = _signature(served, branches)
        if self._signatures.get(key) == signature:
            return False
        with self._lock:
            try:
                self._write(owner, session_id, served, branches)
            except (OSError, KvosError, ValueError) as e:  # a full disk, a saved chunk gone bad
                _log.warning("session %s: snapshot not written (%s); the last one stays", session_id, e)
                return False
            self._signatures[key] = signature
        return True

    def _write(self, owner: str, session_id: str, served: int, branches: list[Session]) -> None:
        key, entry = (owner, session_id), self.layout.entry_dir(owner, session_id)
        generation = self._generation.get(key, 0) + 1
        named: dict[Path, set[str]] = {}
        rows = []
        for session in branches:
            directory = self.layout.branch_dir(session.session_id)
            directory.mkdir(parents=True, exist_ok=True)
            name = f"snap-{generation:08d}{snapshot.SUFFIX}"
            snap = snapshot.save(session, directory, name)
            named[directory] = {name, *snap.files.values(), *session.saved_files()}
            rows.append({"id": session.session_id, "dir": directory.name, "snapshot": name})
        histories = [s.token_ids() for s in branches]
        manifest = {"owner": owner, "session_id": session_id, "served": served, "generation": generation}
        manifest.update(branches=rows, histories=histories, saved_at=time.time())
        read = self._synced.get(key, 0)
        manifest["tier_generation"] = read
        write_manifest(entry / MANIFEST, manifest)  # the commit point
        self._generation[key] = generation
        self._histories[entry / MANIFEST] = (session_id, histories)
        self._collect(entry, named)
        if self.tier is not None:
            self._publish(key, read, manifest, named)

    def _publish(
        self, key: tuple[str, str], read: int, manifest: dict[str, Any], named: dict[Path, set[str]]
    ) -> None:
        """Publish a committed snapshot to the tier as generation ``read + 1`` (see the module docstring);
        on success the local manifest records that generation."""
        assert self.tier is not None
        files: dict[str, dict[str, str]] = {}
        paths: dict[str, Path] = {}
        for directory, names in named.items():
            for name in sorted(names):
                path = directory / name
                if not path.exists():
                    continue  # a saved chunk's file its store let go of: not part of the snapshot
                if path not in self._digests:
                    self._digests[path] = digest(path.read_bytes())
                files.setdefault(directory.name, {})[name] = self._digests[path]
                paths[self._digests[path]] = path
        published = TierEntry(read + 1, {**manifest, "tier_generation": read + 1}, files)
        if self.tier.publish(*key, read, published, paths) == "written":
            self._synced[key] = read + 1
            entry = self.layout.entry_dir(*key)
            write_manifest(entry / MANIFEST, published.manifest)

    def stale(self, owner: str, session_id: str) -> bool:
        """Whether the tier holds a newer copy of a session this replica holds live (another replica served
        it since): the live copy is then dropped and the tier's loaded. False without a tier or while it is
        down."""
        if self.tier is None:
            return False
        found = self.tier.generation(owner, session_id)
        return found is not None and found > self._synced.get((owner, session_id), 0)

    def _collect(self, entry: Path, named: dict[Path, set[str]]) -> None:
        """After a commit: delete what the new snapshots do not name (older snapshots, files stores let go
        of, branches dropped since), and remember what they do."""
        for child in entry.iterdir():
            if child.is_dir() and child not in named:
                shutil.rmtree(child, ignore_errors=True)
                self._committed.pop(child, None)
            elif child.is_file() and child.name != MANIFEST:  # a temporary file of an interrupted write
                child.unlink(missing_ok=True)
        for directory, names in named.items():
            self._committed[directory] = names
            for path in directory.iterdir():
                if path.name not in names:
                    path.unlink(missing_ok=True)
                    self._digests.pop(path, None)

    # ------------------------------------------------------------------- read
    def load(self, owner: str, session_id: str, manager: MemoryManager) -> tuple[list[Session], int] | None:
        """A stored session's branches (latest first, swapped out: their K/V come back from disk at their
        first use) and its request count; None when there is none, or when it cannot be used (logged; the
        client's conversation is then re-prefilled)."""
        key, entry = (owner, session_id), self.layout.entry_dir(owner, session_id)
        with self._lock:
            try:
                if self.tier is not None:
                    self._pull(key, entry)
                manifest = self._manifest(entry)
                if manifest is None:
                    return None
                branches = self._branches(key, entry, manifest, manager)
            except (OSError, KvosError, KeyError, TypeError, ValueError) as e:
                _log.warning(
                    "session %s: its saved state cannot be used (%s): re-prefilled from the "
                    "conversation the client sends",
                    session_id,
                    e,
                )
                self.forget(owner, session_id)
                return None
            self._generation[key] = int(manifest["generation"])
            self._synced[key] = int(manifest.get("tier_generation", 0))
            self._signatures[key] = _signature(int(manifest["served"]), branches)
        tokens = sum(s.history_tokens for s in branches)
        _log.info(
            "session %s: restored from %s (%d branches, %d tokens)", session_id, entry, len(branches), tokens
        )
        return branches, int(manifest["served"])

    def _pull(self, key: tuple[str, str], entry: Path) -> None:
        """Replace the local copy of a session with the tier's when the tier's is newer (or the only one)."""
        assert self.tier is not None
        found = self.tier.entry(*key)
        if found is None:
            return
        path = entry / MANIFEST
        local = read_manifest(path) if path.exists() else None
        if local is not None and int(local.get("tier_generation", 0)) >= found.generation:
            return
        self._drop_local(entry)
        entry.mkdir(parents=True, exist_ok=True)
        self.tier.materialise(found, entry)
        write_manifest(path, found.manifest)
        _log.info("session %s: generation %d taken from the shared tier", key[1], found.generation)

    def _drop_local(self, entry: Path) -> None:
        """Delete a session's local files and what this object remembers of them."""
        (entry / MANIFEST).unlink(missing_ok=True)
        self._histories.pop(entry / MANIFEST, None)
        for directory in [d for d in self._committed if d.parent == entry]:
            del self._committed[directory]
        for path in [p for p in self._digests if p.parent.parent == entry]:
            del self._digests[path]
        shutil.rmtree(entry, ignore_errors=True)

    def _branches(
        self, key: tuple[str, str], entry: Path, manifest: dict[str, Any], manager: MemoryManager
    ) -> list[Session]:
        """Every branch of a manifest restored into ``manager``, or none (SnapshotError)."""
        snaps = []
        for row in manifest["branches"]:
            snap = snapshot.load(entry / str(row["dir"]) / str(row["snapshot"]))
            name = snap.session_id
            if name != row["id"] or entry_name(name) != key or name in manager.sessions:
                raise SnapshotError(f"snapshot of {name!r} does not belong to session {key[1]!r}")
            snaps.append(snap)
        branches: list[Session] = []
        try:
            for row, snap in zip(manifest["branches"], snaps, strict=True):
                branches.append(self._restore(entry / str(row["dir"]), snap, manager))
        except BaseException:
            for session in branches:
                manager.close(session.session_id)
            raise
        return branches

    def _restore(self, directory: Path, snap: snapshot.SessionSnapshot, manager: MemoryManager) -> Session:
        names = {*snap.files.values()}
        for path in directory.iterdir():  # written after the snapshot, before the process ended
            if path.suffix != snapshot.SUFFIX and path.name not in names:
                path.unlink(missing_ok=True)
        self._committed[directory] = names | {p.name for p in directory.glob(f"*{snapshot.SUFFIX}")}
        session = manager.session(snap.session_id)
        try:
            snapshot.restore(snap, session, directory)
        except SnapshotError:
            manager.close(snap.session_id)
            raise
        return session

    def _manifest(self, entry: Path) -> dict[str, Any] | None:
        """The entry's manifest, verified; None when it has none or it is older than the TTL."""
        path = entry / MANIFEST
        if not path.exists():
            return None
        if self.layout.expired(path):
            shutil.rmtree(entry, ignore_errors=True)
            return None
        return read_manifest(path)

    def match(self, owner: str, probe: list[int], min_tokens: int, live: set[str]) -> str | None:
        """The id of the stored session of ``owner`` (not among ``live``) sharing the longest prefix with
        ``probe``, at least ``min_tokens``; None when none does. Reads each manifest once."""
        best, best_len = None, min_tokens - 1
        owner_dir = self.layout.owner_dir(owner)
        with self._lock:
            candidates = list(owner_dir.glob(f"*/{MANIFEST}")) if owner_dir.is_dir() else []
            if self.tier is not None:
                best, best_len = self._match_tier(owner, probe, live, candidates, best_len)
            for path in candidates:
                if path not in self._histories:
                    try:
                        header = read_manifest(path)
                        self._histories[path] = (str(header["session_id"]), list(header["histories"]))
                    except (OSError, ValueError, KeyError):
                        continue  # unreadable: found (and logged) if it is asked for by id
                sid, histories = self._histories[path]
                shared = max((common_prefix(probe, h) for h in histories), default=0)
                if sid not in live and shared > best_len:
                    best, best_len = sid, shared
        return best

    def _match_tier(
        self, owner: str, probe: list[int], live: set[str], local: list[Path], best_len: int
    ) -> tuple[str | None, int]:
        """:meth:`match` through the tier's prefix index: the session of ``owner`` that published the
        longest prefix of ``probe``, when this replica has no copy of it and it shares more than
        ``best_len`` tokens (counted exactly on its entry's histories)."""
        assert self.tier is not None
        found = self.tier.holder(owner, probe)
        if found is None or found[1] <= best_len:
            return None, best_len
        sid = found[0]
        if sid in live or self.layout.entry_dir(owner, sid) in {p.parent for p in local}:
            return None, best_len  # held here: the local manifests decide
        entry = self.tier.entry(owner, sid)
        histories = entry.manifest.get("histories", []) if entry is not None else []
        shared = max((common_prefix(probe, h) for h in histories), default=0)
        return (sid, shared) if shared > best_len else (None, best_len)

    def has(self, owner: str, session_id: str) -> bool:
        """Whether a session is stored (loaded or not), here or in the tier."""
        if (self.layout.entry_dir(owner, session_id) / MANIFEST).exists():
            return True
        return self.tier is not None and bool(self.tier.generation(owner, session_id))

    def forget(self, owner: str, session_id: str, everywhere: bool = True) -> None:
        """Delete a session's state (it was deleted, expired or cannot be used); ``everywhere``: the tier's
        copy too (not for a session that expired here: another replica may be serving it)."""
        entry = self.layout.entry_dir(owner, session_id)
        with self._lock:
            self._drop_local(entry)  # the manifest first: a crash now leaves a sweepable orphan
            self._signatures.pop((owner, session_id), None)
            self._generation.pop((owner, session_id), None)
            self._synced.pop((owner, session_id), None)
            if self.tier is not None and everywhere:
                self.tier.forget(owner, session_id)


def _signature(served: int, branches: list[Session]) -> tuple[Any, ...]:
    """What changes whenever a session does: requests, history, paging events, residency."""
    return (
        served,
        tuple(
            (
                s.session_id,
                s.history_tokens,
                sum(s.event_counts().values()),
                s.swapped,
                s.active_tokens,
            )
            for s in branches
        ),
    )
