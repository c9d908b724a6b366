"""Where kvos keeps what it downloads and builds (torch-free: ``kvos pull`` and ``--help`` read it)."""

from __future__ import annotations

import os
from pathlib import Path


def kvos_home() -> Path:
    """Where kvos keeps what it downloads: ``$KVOS_HOME``, else ``~/.cache/kvos``."""
    return Path(os.environ.get("KVOS_HOME") or Path.home() / ".cache" / "kvos")
