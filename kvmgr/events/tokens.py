"""Token ids that travel with a store, so that its KV events say which tokens a block holds.

Offers:
    check_token_ids   a store's ``token_ids`` argument as an int32 ``[num_keys, block_size]`` copy

kvmgr keys blocks by caller-supplied hashes and never sees tokens. A router that re-hashes token
ids (Dynamo's, llm-d's indexer at another block size) needs them in ``BlockStored``, so a store
may carry them: ``swap_out(..., token_ids=...)`` and ``store_many(..., token_ids=...)``. They
are kept only while the store is in flight (in its ``Part``), handed to the ``stored`` event
when the copy has landed, and dropped with it: nothing per block stays in the CPU tier.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvmgr.errors import InvalidArgumentError

__all__ = ["MAX_TOKEN_ID", "check_token_ids"]

#: Largest token id accepted (int32; every vocabulary served today fits).
MAX_TOKEN_ID = (1 << 31) - 1


def check_token_ids(token_ids: Any, num_keys: int) -> np.ndarray:
    """The token ids of ``num_keys`` full blocks as a fresh int32 ``[num_keys, block_size]`` array.

    Args:
        token_ids: row ``i`` holds the tokens of block ``i`` of the call: a 2-D integer array
            (numpy, or a CPU torch tensor) ``[num_keys, block_size]``, or a flat sequence (or 1-D
            array) of ``num_keys * block_size`` ints. Copied: the caller may reuse its buffer.
        num_keys: keys of the call (``>= 1``).

    Returns:
        int32 ``[num_keys, block_size]``, C-contiguous, owned by the caller of this function.

    Raises:
        InvalidArgumentError: not integers, a shape that does not split into ``num_keys`` rows
            of ``>= 1`` token, or an id outside ``[0, MAX_TOKEN_ID]``.
    """
    if hasattr(token_ids, "numpy") and hasattr(token_ids, "device"):  # a torch tensor
        if token_ids.device.type != "cpu":
            raise InvalidArgumentError(f"expected token ids on the CPU, got {token_ids.device}")
        token_ids = token_ids.numpy()
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise InvalidArgumentError(f"expected integer token ids, got {type(token_ids).__name__}")
    try:
        array = np.asarray(token_ids)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"expected integer token ids: {exc}") from None
    if array.ndim == 1 and num_keys >= 1 and array.size % num_keys == 0:
        array = array.reshape(num_keys, -1)
    if array.ndim != 2 or array.shape[0] != num_keys or array.shape[1] < 1:
        raise InvalidArgumentError(
            f"expected token ids [num_keys={num_keys}, block_size >= 1] (or a flat multiple of "
            f"num_keys), got shape {tuple(np.shape(token_ids))}"
        )
    if array.dtype.kind not in "iu":  # bools are kind "b", floats "f": refused
        raise InvalidArgumentError(f"expected integer token ids, got dtype {array.dtype}")
    if array.size and (int(array.min()) < 0 or int(array.max()) > MAX_TOKEN_ID):
        bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
        raise InvalidArgumentError(f"token id {bad} outside [0, {MAX_TOKEN_ID}]")
    return np.array(array, dtype=np.int32, order="C", copy=True)
