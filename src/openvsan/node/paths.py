"""Where a node keeps its state: the data dir a command uses. Apart from node/config.py so that a CLI call
that only talks to a running node (`vsan volume list`) finds its control socket without loading the specs."""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    """Where state lives without [node].data_dir or --data-dir: $XDG_STATE_HOME/openvsan, else
    ~/.local/state/openvsan."""
    state = os.environ.get("XDG_STATE_HOME")
    base = Path(state) if state else Path.home() / ".local" / "state"
    return base / "openvsan"


def effective_data_dir(configured: Path | None, override: Path | None = None) -> Path:
    """The data dir a command uses: its --data-dir (`override`), else [node].data_dir (`configured`), else the
    default."""
    return (override or configured or default_data_dir()).expanduser().absolute()
