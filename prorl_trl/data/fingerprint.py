"""What a local data file held when a run started, so that a resume notices a file rewritten under the same name.

A full sha256 for files up to 64 MiB (GSM8K's train split: 4 MB, well under a second); above that the size plus
the sha256 of the first and last 4 MiB and 16 evenly spaced 256 KiB blocks, so that checking a file of many GB costs
a few reads (a change that keeps the size and touches none of those blocks is not seen: the fingerprint says
`sampled`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

FULL_HASH_LIMIT = 64 * 2**20
EDGE, BLOCK, BLOCKS = 4 * 2**20, 256 * 2**10, 16


def file_fingerprint(path: str | Path) -> str:
    """`size:<bytes>;sha256:<hex>` (whole file) or `size:<bytes>;sampled-sha256:<hex>` (large files)."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as file:
        if size <= FULL_HASH_LIMIT:
            for chunk in iter(lambda: file.read(2**20), b""):
                digest.update(chunk)
            return f"size:{size};sha256:{digest.hexdigest()}"
        offsets = [0] + [EDGE + i * (size - 2 * EDGE) // BLOCKS for i in range(BLOCKS)] + [size - EDGE]
        for offset in offsets:
            file.seek(offset)
            digest.update(file.read(EDGE if offset in (0, size - EDGE) else BLOCK))
    return f"size:{size};sampled-sha256:{digest.hexdigest()}"


def split_fingerprints(data: Any) -> dict[str, dict[str, str]]:
    """`{split: {"file": path, "fingerprint": ...}}` for the splits of a recipe's `data:` section read from local
    files (hub and generated data have none); a split whose file is missing is left out (validate reports it)."""
    from .builders import local_split_file

    found = {}
    for which in ("train", "validation"):
        try:
            path = local_split_file(data, which)
        except FileNotFoundError:
            continue
        if path is not None and path.is_file():
            found[which] = {"file": str(path), "fingerprint": file_fingerprint(path)}
    return found
