"""The hit ratio of the simulator's results (private to ``kvmgr.sim``).

Offers:
    TokenRatio   mixin: ``ratio`` = ``hit_tokens / prompt_tokens`` of a result class
"""

from __future__ import annotations

__all__ = ["TokenRatio"]


class TokenRatio:
    """Mixin of a result with ``prompt_tokens`` and ``hit_tokens`` (ints) fields."""

    __slots__ = ()
    prompt_tokens: int
    hit_tokens: int

    @property
    def ratio(self) -> float:
        """``hit_tokens / prompt_tokens`` (0.0 without prompt tokens)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
