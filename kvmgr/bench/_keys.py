"""Fresh distinct keys for the host-path benchmarks (``kvmgr bench host``, ``kvmgr bench vllm``).

Private to ``kvmgr.bench``.
"""

from __future__ import annotations

import attrs

__all__ = ["FreshKeys"]


@attrs.define
class FreshKeys:
    """Distinct 8-byte keys on demand (key ``i`` is ``i`` little-endian; every ``take`` gives
    keys not given before)."""

    _next: int = attrs.field(default=0, init=False)

    def take(self, n: int) -> list[bytes]:
        """The next ``n`` keys."""
        start, self._next = self._next, self._next + n
        return [i.to_bytes(8, "little") for i in range(start, start + n)]
