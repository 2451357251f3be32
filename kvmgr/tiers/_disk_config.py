"""``DiskTier``'s argument checks: ``ConfigError`` before any file is opened."""

from __future__ import annotations

import math
import os

from kvmgr.errors import ConfigError
from kvmgr.tiers._slot_files import ALIGN_BYTES

__all__ = ["check_config", "check_sizes"]

#: The most bytes one slot file may hold (``posix_fallocate`` takes a C ``off_t``).
MAX_FILE_BYTES = 2**62


def check_config(
    path: object,
    slot_bytes: object,
    num_slots: object,
    num_files: object,
    io_threads: object,
    deadline_s: object,
) -> None:
    """Raise ``ConfigError`` for a bad ``DiskTier`` argument (before anything is opened)."""
    if not isinstance(path, str | os.PathLike):
        raise ConfigError(f"DiskTier: expected path a str or PathLike, got {type(path).__name__}")
    for name, value in (("slot_bytes", slot_bytes), ("num_slots", num_slots),
                        ("num_files", num_files), ("io_threads", io_threads)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"DiskTier: expected {name} an int >= 1, got {value!r}")
    ok = isinstance(deadline_s, int | float) and not isinstance(deadline_s, bool)
    if not ok or not math.isfinite(deadline_s) or deadline_s <= 0:  # type: ignore[arg-type]
        raise ConfigError(f"DiskTier: expected deadline_s a finite number > 0, got {deadline_s!r}")


def check_sizes(
    slot_bytes: int, num_slots: int, num_files: int, direct: object, persist_index: object
) -> None:
    """Raise ``ConfigError``: more files than slots, a file over ``MAX_FILE_BYTES``, or
    ``direct`` / ``persist_index`` not a bool (after ``check_config``)."""
    for name, value in (("direct", direct), ("persist_index", persist_index)):
        if not isinstance(value, bool):
            raise ConfigError(f"DiskTier: expected {name} a bool, got {value!r}")
    if num_files > num_slots:
        raise ConfigError(f"DiskTier: num_files {num_files} > num_slots {num_slots}")
    per_file = -(-num_slots // num_files) * -(-slot_bytes // ALIGN_BYTES) * ALIGN_BYTES
    if per_file > MAX_FILE_BYTES:
        raise ConfigError(
            f"DiskTier: {num_slots} slots of {slot_bytes} B in {num_files} file(s) is "
            f"{per_file} bytes per file, over {MAX_FILE_BYTES}"
        )
