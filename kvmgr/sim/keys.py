"""Block keys of the simulation: chained prefix hashes derived from a trace's ``hash_ids``.

Offers:
    KEY_BYTES       bytes of every key (16)
    BlockKeyer      the published keys of a request's prompt at a given block size
    private_key     the key naming a request's unpublished block (fingerprints only)

Each full ``TRACE_BLOCK_TOKENS``-token trace block splits into ``TRACE_BLOCK_TOKENS //
block_size`` sub-blocks. Their keys are one SHAKE-128 output of (parent key, hash id), cut into
16-byte pieces: piece ``s`` names sub-block ``s``, and the last piece is the parent of the next
trace block. A key therefore depends on the whole chain of ids before it, so equal keys mean
equal prefixes. The last trace block of a prompt, when partial, gets no key: it is never
published.
"""

from __future__ import annotations

import hashlib

from kvmgr.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest

__all__ = ["KEY_BYTES", "BlockKeyer", "private_key"]

#: Bytes of every block key.
KEY_BYTES = 16

_ROOT = b"kvmgr-sim-root\x00\x00"  # parent of the first block; KEY_BYTES long like every key


class BlockKeyer:
    """Computes the published block keys of prompts at one simulation block size.

    Args:
        block_size: tokens per simulation block; must divide ``TRACE_BLOCK_TOKENS``.

    Raises:
        ValueError: ``block_size`` is not a positive divisor of ``TRACE_BLOCK_TOKENS``.
    """

    def __init__(self, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1 or TRACE_BLOCK_TOKENS % block_size:
            raise ValueError(
                f"expected a block size dividing {TRACE_BLOCK_TOKENS}, got {block_size!r}"
            )
        self.block_size = block_size
        self.sub_blocks = TRACE_BLOCK_TOKENS // block_size

    def prefix_keys(self, request: TraceRequest) -> list[bytes]:
        """Keys of the request's full trace blocks, ``sub_blocks`` keys per trace block.

        Returns:
            ``request.num_full_trace_blocks * sub_blocks`` keys of ``KEY_BYTES`` bytes, in
            prompt order; key ``i`` names tokens ``[i * block_size, (i + 1) * block_size)``.
        """
        width = KEY_BYTES * self.sub_blocks
        keys: list[bytes] = []
        parent = _ROOT
        for hash_id in request.hash_ids[: request.num_full_trace_blocks]:
            out = hashlib.shake_128(parent + b"%d" % hash_id).digest(width)
            keys.extend(out[i : i + KEY_BYTES] for i in range(0, width, KEY_BYTES))
            parent = keys[-1]
        return keys


def private_key(request_index: int, block_index: int) -> bytes:
    """A ``KEY_BYTES`` key naming block ``block_index`` of request ``request_index`` privately.

    Never handed to the manager's prefix index: it only seeds the page fingerprint of blocks
    that are not published (the partial prompt tail, decoded tokens).
    """
    return hashlib.blake2b(
        b"%d/%d" % (request_index, block_index), digest_size=KEY_BYTES, person=b"kvmgr-private"
    ).digest()
