"""``Direction``, the copy direction: the one name the scheduler side (torch-free) and the
transfer layer both use. A bottom module (imports nothing of kvmgr), so neither imports the
other for it. Public as ``kvmgr.scheduler.Direction`` and
``kvmgr.transfer.Direction``.
"""

from __future__ import annotations

import enum

__all__ = ["Direction"]


class Direction(enum.Enum):
    """Copy direction.

    Hashed by identity (``object.__hash__``, a C slot) rather than by ``Enum.__hash__``
    (``hash(self._name_)``, a Python call per dict lookup): a step looks directions up in about
    ten dicts (layouts, streams, events, queues). Members are singletons compared by identity,
    so equal members still hash equal; pickling goes by name and is unaffected.
    """

    D2H = "d2h"  #: GPU -> CPU: a store (swap-out)
    H2D = "h2d"  #: CPU -> GPU: a load (swap-in)

    __hash__ = object.__hash__
