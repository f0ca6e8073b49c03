"""What strata processes left in /dev/shm and the temporary folder: one reading for every test that looks.

A parallel run (./tools/test.sh runs two pytest workers) has the other worker's live engines making segments
and pool folders at any moment, so a new name is a leftover only when its owner is one of the processes the
test names or is gone; one that vanishes while it is read was never left."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

SHM = Path("/dev/shm")


def segments_now() -> set[str]:
    return {p.name for p in SHM.glob("strata.*")}


def pool_folders_now() -> set[Path]:
    from coordinator.pool.channel import POOL_DIR_PREFIX

    return set(Path(tempfile.gettempdir()).glob(POOL_DIR_PREFIX + "*"))


def _segment_left(name: str, ours: set[int], settle_s: float = 2.0) -> bool:
    """Owned by one of ``ours`` or by a dead process; a header not yet written (a live process between its
    ftruncate and its header) is read again until ``settle_s`` has passed."""
    from shm.segments import SegmentError, owner_alive, read_header

    deadline = time.monotonic() + settle_s
    while True:
        if not (SHM / name).exists():
            return False  # removed while looked at: its owner cleaned up
        try:
            header = read_header("/" + name)
        except SegmentError:
            if time.monotonic() >= deadline:
                return (SHM / name).exists()
            time.sleep(0.05)
            continue
        return header.owner_pid in ours or not owner_alive(header)


def segments_left(before: set[str], ours: set[int] = frozenset()) -> list[str]:
    """The segments made since ``before`` that ``ours`` own or whose owner has died."""
    return sorted(n for n in segments_now() - before if _segment_left(n, set(ours)))


def _folder_owner(folder: Path) -> int | None:
    from coordinator.pool.channel import OWNER_FILE

    try:
        return int(json.loads((folder / OWNER_FILE).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def pool_folders_left(before: set[Path], ours: set[int] = frozenset()) -> list[str]:
    """The pool folders made since ``before`` that ``ours`` own or whose coordinator has died."""
    from coordinator.pool.channel import pool_dir_owner_alive

    return sorted(str(d) for d in pool_folders_now() - before
                  if d.exists() and (_folder_owner(d) in ours or not pool_dir_owner_alive(d)))
