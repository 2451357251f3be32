"""Real filesystems for the disk tier's fault tests: a small tmpfs, and an ext4 image on a loop
device that can be frozen (``fsfreeze``: every write blocks until thawed, a stuck disk).

Fixtures (import them into a test module):
    small_tmpfs    ``mount(size_bytes) -> Path`` of a fresh tmpfs, unmounted after the test
    frozen_ext4    a loop-mounted ext4 directory with ``freeze()``/``thaw()`` (always thawed and
                   unmounted after the test)

Both need root (mounts). Without it, or where the kernel refuses, the tests skip saying so; with
``KVMGR_REQUIRE_MOUNTS=1`` (set by CI, which runs as root) they fail instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

__all__ = ["Ext4Mount", "frozen_ext4", "small_tmpfs"]


def _cannot(why: str) -> None:
    if os.environ.get("KVMGR_REQUIRE_MOUNTS") == "1":
        pytest.fail(f"KVMGR_REQUIRE_MOUNTS=1 but {why}")
    pytest.skip(why)


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    if os.geteuid() != 0:
        _cannot("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(size_bytes: int) -> Path:
        target = tmp_path / f"tmpfs{len(mounted)}"
        target.mkdir()
        done = _run("mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(target))
        if done.returncode:
            _cannot(f"mount -t tmpfs failed: {done.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        _run("umount", "-l", str(target))


class Ext4Mount:
    """An ext4 filesystem in an image file, mounted on a loop device at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.frozen = False

    def freeze(self) -> None:
        """``fsfreeze -f``: writes (and syncs) block until ``thaw``."""
        done = _run("fsfreeze", "-f", str(self.path))
        if done.returncode:
            _cannot(f"fsfreeze failed: {done.stderr.strip()}")
        self.frozen = True

    def thaw(self) -> None:
        """``fsfreeze -u`` (idempotent)."""
        if self.frozen:
            _run("fsfreeze", "-u", str(self.path))
            self.frozen = False


@pytest.fixture
def frozen_ext4(tmp_path: Path) -> Iterator[Ext4Mount]:
    if os.geteuid() != 0:
        _cannot("a loop mount needs root")
    for tool in ("mkfs.ext4", "fsfreeze", "mount"):
        if shutil.which(tool) is None:
            _cannot(f"needs {tool} (util-linux, e2fsprogs)")
    image, target = tmp_path / "ext4.img", tmp_path / "ext4"
    target.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    made = _run("mkfs.ext4", "-q", "-F", str(image))
    if made.returncode:
        _cannot(f"mkfs.ext4 failed: {made.stderr.strip()}")
    done = _run("mount", "-o", "loop", str(image), str(target))
    if done.returncode:
        _cannot(f"mount -o loop failed (no loop devices?): {done.stderr.strip()}")
    mount = Ext4Mount(target)
    try:
        yield mount
    finally:
        mount.thaw()
        if _run("umount", str(target)).returncode:
            _run("umount", "-l", str(target))  # (busy: detach now, free when released)
