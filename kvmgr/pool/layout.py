"""Byte layout of a list of KV tensors: where each block's page lives.

Offers:
    KVLayout        base address, block stride and page bytes of every tensor, as numpy arrays
    kv_page_bytes   page bytes of each tensor of a KV cache

A KV cache is a list of tensors, each with ``num_blocks`` as dim 0 and each block stored
contiguously; tensor ``t`` is then a ``[num_blocks, page_bytes[t]]`` byte array whose rows may be
``block_stride[t] >= page_bytes[t]`` apart. Page sizes may differ between tensors and need not be
multiples of 16 bytes (MLA rows of 576 x 2 B, DeepSeek-V4 584 B per token, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

from kvmgr.errors import GeometryError

__all__ = ["KVLayout", "kv_page_bytes"]


def _check_tensor(index: int, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise GeometryError(
            f"kv tensor {index}: expected torch.Tensor, got {type(tensor).__name__}"
        )
    if tensor.is_nested or tensor.layout is not torch.strided or tensor.is_quantized:
        raise GeometryError(
            f"kv tensor {index}: expected a dense strided tensor, got a "
            f"{'nested' if tensor.is_nested else tensor.layout} one"
        )
    if tensor.dim() < 1 or tensor.shape[0] < 1:
        raise GeometryError(
            f"kv tensor {index}: expected dim 0 = num_blocks >= 1, got shape {tuple(tensor.shape)}"
        )
    if tensor[0].numel() > 0 and not tensor[0].is_contiguous():
        raise GeometryError(
            f"kv tensor {index}: expected each block to be contiguous, got strides {tensor.stride()}"
        )
    return tensor


def kv_page_bytes(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Page bytes of each tensor: ``tensor[0].numel() * element_size``.

    Raises:
        GeometryError: a tensor is not a tensor, has no blocks, or has non-contiguous blocks.
    """
    return [_check_tensor(i, t)[0].numel() * t.element_size() for i, t in enumerate(tensors)]


@attrs.frozen(eq=False)
class KVLayout:
    """Where the pages of a KV cache live, for pointer arithmetic without a Python loop per page.

    Attributes:
        base_addrs: int64 ``[num_tensors]``: address of block 0 of each tensor (device or host).
        block_strides: int64 ``[num_tensors]``: bytes from block ``b`` to ``b + 1``.
        page_bytes: int64 ``[num_tensors]``: bytes of one block in each tensor.
        num_blocks: blocks per tensor (equal for all tensors).
        device: ``torch.device`` of every tensor.
    """

    base_addrs: np.ndarray
    block_strides: np.ndarray
    page_bytes: np.ndarray
    num_blocks: int
    device: torch.device

    @property
    def num_tensors(self) -> int:
        """Number of KV tensors."""
        return len(self.page_bytes)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all tensors."""
        return int(self.page_bytes.sum())

    @property
    def is_dense(self) -> np.ndarray:
        """bool ``[num_tensors]``: whether consecutive blocks are adjacent in memory."""
        return self.block_strides == self.page_bytes

    def page_addrs(self, block_ids: np.ndarray) -> np.ndarray:
        """int64 ``[num_tensors, len(block_ids)]``: address of every page of the given blocks."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return self.base_addrs[:, None] + ids[None, :] * self.block_strides[:, None]

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor]) -> KVLayout:
        """Describe a KV cache given as tensors with ``num_blocks`` as dim 0.

        Args:
            tensors: one or more tensors on one device, equal ``shape[0]``, each block contiguous.
                They are not copied; the caller keeps them alive as long as the layout is used.

        Raises:
            GeometryError: empty list, unequal block counts or devices, non-contiguous blocks,
                or a block stride smaller than the page.
        """
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence) or not tensors:
            raise GeometryError(
                f"expected a non-empty list of KV tensors, got {type(tensors).__name__}"
            )
        page_bytes = kv_page_bytes(tensors)
        first = tensors[0]
        for i, t in enumerate(tensors):
            if t.shape[0] != first.shape[0]:
                raise GeometryError(
                    f"kv tensor {i}: expected {first.shape[0]} blocks like tensor 0, got {t.shape[0]}"
                )
            if t.device != first.device:
                raise GeometryError(
                    f"kv tensor {i}: expected device {first.device} like tensor 0, got {t.device}"
                )
        strides = [t.stride(0) * t.element_size() for t in tensors]
        for i, (stride, page) in enumerate(zip(strides, page_bytes)):
            if first.shape[0] > 1 and stride < page:
                raise GeometryError(
                    f"kv tensor {i}: expected block stride >= page ({page} B), got {stride} B"
                )
        return cls(
            base_addrs=np.array([t.data_ptr() for t in tensors], dtype=np.int64),
            block_strides=np.array(strides, dtype=np.int64),
            page_bytes=np.array(page_bytes, dtype=np.int64),
            num_blocks=int(first.shape[0]),
            device=first.device,
        )
