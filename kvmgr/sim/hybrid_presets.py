"""Hybrid model presets: a model's layers as cache groups, with their real bytes.

Offers:
    LayerGroup       layers of one kind: count, bytes per token (or per state), window
    HybridPreset     a model as layer groups; ``layout(block_size)`` -> ``GroupedLayout``
    HYBRID_PRESETS   the registry by name (a plain dict)
    get_hybrid       look one up; an unknown name lists the known ones

Figures come from the models' configs as the ``transformers`` 5.20 config classes default them
(and vLLM 0.33's state shapes), bf16 caches:

- ``gpt-oss-120b`` (``GptOssConfig`` defaults): 36 layers alternating sliding window (W = 128,
  the even layers) and full attention; 8 KV heads x 64 dims, K and V: 2,048 B per token per
  layer. 18 + 18 layers.
- ``gpt-oss-20b``: the same with 24 layers (openai/gpt-oss-20b ``config.json``): 12 + 12.
- ``gemma-3-27b`` (google/gemma-3-27b ``config.json``): 62 layers, every 6th full attention
  (10), the others a 1,024-token window (52); 16 KV heads x 128 dims: 8,192 B/token/layer.
- ``qwen3-next-80b`` (``Qwen3NextConfig`` defaults): 48 layers, every 4th full attention (12;
  2 KV heads x 256 dims: 2,048 B/token/layer), 36 Gated DeltaNet layers whose state (vLLM
  ``gated_delta_net_state_shape``) is a conv state of 3 x 8,192 and a recurrent state of 32 x
  128 x 128 values: 1,097,728 B per layer per state.
"""

from __future__ import annotations

import attrs

from kvmgr.errors import ConfigError
from kvmgr.groups.spec import GroupedLayout, GroupKind, GroupSpec

__all__ = ["HYBRID_PRESETS", "HybridPreset", "LayerGroup", "get_hybrid"]


@attrs.frozen(kw_only=True)
class LayerGroup:
    """Layers that form one cache group.

    Attributes:
        name: the group's name.
        kind: ``GroupKind`` of the group.
        num_layers: layers (one tensor each).
        bytes_per_token: attention kinds: bytes one token takes in one layer (K and V).
        state_bytes: recurrent kind: bytes of one layer's state at a boundary.
        window: sliding window in tokens (sliding-window kind only).
    """

    name: str
    kind: GroupKind
    num_layers: int
    bytes_per_token: int = 0
    state_bytes: int = 0
    window: int | None = None

    def spec(self, block_size: int, *, as_full: bool = False) -> GroupSpec:
        """The group's ``GroupSpec`` at ``block_size`` tokens per block (``as_full``: the
        same bytes, every block needed by every prefix: the all-full-attention baseline)."""
        per_layer = (
            self.state_bytes
            if self.kind is GroupKind.RECURRENT
            else self.bytes_per_token * block_size
        )
        return GroupSpec(
            name=self.name,
            kind=GroupKind.FULL if as_full else self.kind,
            block_size=block_size,
            page_bytes=(per_layer,) * self.num_layers,
            window=None if as_full else self.window,
        )


@attrs.frozen(kw_only=True)
class HybridPreset:
    """A hybrid model as cache groups.

    Attributes:
        name: registry name.
        groups: the layer groups.
        description: one line for ``--help`` and the report.
    """

    name: str
    groups: tuple[LayerGroup, ...]
    description: str

    def layout(self, block_size: int, *, as_full: bool = False) -> GroupedLayout:
        """The model's ``GroupedLayout`` with every group at ``block_size`` tokens per block.

        ``as_full``: the baseline of one key space, one full-attention group ``"all"`` holding
        every layer's tensor (what ``OffloadManager`` alone does with a hybrid model)."""
        specs = [g.spec(block_size, as_full=as_full) for g in self.groups]
        if as_full:
            pages = tuple(p for s in specs for p in s.page_bytes)
            specs = [attrs.evolve(specs[0], name="all", page_bytes=pages)]
        return GroupedLayout(specs, hash_block_size=block_size)


def _full_and_window(
    name: str, title: str, full: int, swa: int, bpt: int, window: int, heads: str
) -> HybridPreset:
    """A model of ``full`` full-attention and ``swa`` sliding-window layers of ``bpt`` bytes per
    token each (``heads``: the KV heads x dims text of the description)."""
    return HybridPreset(
        name=name,
        groups=(
            LayerGroup(name="full", kind=GroupKind.FULL, num_layers=full, bytes_per_token=bpt),
            LayerGroup(
                name="swa",
                kind=GroupKind.SLIDING_WINDOW,
                num_layers=swa,
                bytes_per_token=bpt,
                window=window,
            ),
        ),
        description=f"{title}: {full} full + {swa} sliding-window ({window}) layers, {heads}",
    )


HYBRID_PRESETS: dict[str, HybridPreset] = {
    p.name: p
    for p in (
        _full_and_window("gpt-oss-120b", "gpt-oss-120b", 18, 18, 2048, 128, "8 KV heads x 64"),
        _full_and_window("gpt-oss-20b", "gpt-oss-20b", 12, 12, 2048, 128, "8 KV heads x 64"),
        _full_and_window("gemma-3-27b", "Gemma-3-27B", 10, 52, 8192, 1024, "16 KV heads x 128"),
        HybridPreset(
            name="qwen3-next-80b",
            groups=(
                LayerGroup(name="full", kind=GroupKind.FULL, num_layers=12, bytes_per_token=2048),
                LayerGroup(
                    name="gdn", kind=GroupKind.RECURRENT, num_layers=36, state_bytes=1_097_728
                ),
            ),
            description="Qwen3-Next-80B: 12 full-attention + 36 Gated DeltaNet layers (1.05 MiB states)",
        ),
    )
}


def get_hybrid(name: str) -> HybridPreset:
    """The preset ``name``.

    Raises:
        ConfigError: an unknown name (the message lists the known ones).
    """
    try:
        return HYBRID_PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown hybrid preset {name!r}; known: {sorted(HYBRID_PRESETS)}"
        ) from None
