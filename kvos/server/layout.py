"""The layout of a state directory (``kvos serve --state-dir DIR``) and its manifests.

Under ``DIR/<state key>/``, where the key hashes the model's fingerprint and the session settings (so the
state of another model or budget sits beside this one and is ignored, with a log line)::

    model.json                         what the key stands for (fingerprint, settings)
    <owner>/<session hash>/manifest    a session: owner, id, request count, branches (latest first), and
                                       each branch's token history (for routing by prefix)
    <owner>/<session hash>/<branch>/   a branch: its snapshot (snap-N.snap) and chunk files (*.kvchunk)

A manifest is a checksummed file (:mod:`kvos.memory.container`, magic ``KVOSENT\\0``) with an empty payload.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import time
from pathlib import Path
from typing import Any

from kvos.memory import container

MAGIC = b"KVOSENT\x00"
VERSION = 1
MANIFEST = "manifest"
_SAFE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_log = logging.getLogger("kvos.server.state")


def _hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """A session's manifest (owner, session_id, served, generation, branches, histories, saved_at), its
    digest verified; ValueError or OSError when it cannot be read."""
    header, _ = container.unpack(path.read_bytes(), MAGIC, VERSION)
    return header


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Replace a manifest atomically: the commit point of a session's snapshot."""
    container.write_atomic(path, container.pack(MAGIC, VERSION, manifest, []))


def entry_name(session_name: str) -> tuple[str, str]:
    """(owner, session id) of a manager session name: ``owner/id``, or ``owner/id#bN`` for a branch."""
    owner, rest = session_name.split("/", 1)
    return owner, re.sub(r"#b\d+$", "", rest)


class StateLayout:
    """Paths under one state key, and the start-up sweep."""

    def __init__(self, root: Path, fingerprint: str, setup: dict[str, Any], ttl_s: float) -> None:
        """``setup``: the session settings the state is valid under; ``ttl_s``: sessions idle longer go."""
        self.key = _hash(json.dumps([fingerprint, setup], sort_keys=True))[:16]
        self.root, self.base, self.ttl_s = root, root / self.key, ttl_s
        self.base.mkdir(parents=True, exist_ok=True)
        info = {"fingerprint": fingerprint, "setup": setup, "version": VERSION}
        (self.base / "model.json").write_text(json.dumps(info, indent=1))

    def entry_dir(self, owner: str, session_id: str) -> Path:
        owner_part = owner if _SAFE.fullmatch(owner) else _hash(owner)
        return self.base / owner_part / _hash(session_id)

    def owner_dir(self, owner: str) -> Path:
        return self.entry_dir(owner, "").parent

    def branch_dir(self, session_name: str) -> Path:
        """The directory of a manager session (``owner/id`` or a branch ``owner/id#bN``)."""
        return self.entry_dir(*entry_name(session_name)) / _hash(session_name)

    def expired(self, manifest: Path) -> bool:
        return time.time() - manifest.stat().st_mtime > self.ttl_s

    def sweep(self) -> int:
        """Delete sessions without a manifest (ended before their first snapshot) or idle past the TTL;
        the number of sessions kept. Reads no manifest: one stat per session."""
        kept = 0
        for owner_dir in (d for d in self.base.iterdir() if d.is_dir()):
            for entry in (d for d in owner_dir.iterdir() if d.is_dir()):
                manifest = entry / MANIFEST
                if manifest.exists() and not self.expired(manifest):
                    kept += 1
                else:
                    shutil.rmtree(entry, ignore_errors=True)
        _log.info("state dir %s: %d stored sessions (each loaded on its first request)", self.base, kept)
        return kept

    def log_others(self) -> None:
        """One warning per state of another model or settings found beside this one (left as it is)."""
        for other in sorted(d for d in self.root.iterdir() if d.is_dir() and d.name != self.key):
            try:
                info = json.loads((other / "model.json").read_text())
            except (OSError, ValueError):
                info = {}
            _log.warning(
                "state dir %s: ignoring %s, the state of another model or settings (%s)",
                self.root,
                other.name,
                info.get("setup", "unknown"),
            )
