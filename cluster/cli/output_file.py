"""Files the commands write (a profile, a deployment file, a result): checked before
the work that produces them, their missing folders made when written."""

from __future__ import annotations

import os
from pathlib import Path


def output_problem(path: Path) -> str | None:
    """Why a file could not be written at `path` once its missing folders are made, or None."""
    if path.is_dir():
        return "it is a directory; name a file"
    folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    if not folder.is_dir():
        return f"{folder} is a file, not a directory"
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"{path if path.exists() else folder} is not writable"
    return None


def write_output(path: Path, text: str) -> None:
    """Writes `text` to `path`, making its missing folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
