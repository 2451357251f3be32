"""Pinned host memory: one page-aligned region page-locked before use (tools, benchmarks, tests).

Offers:
    PinnedHostBuffer    a page-aligned ``uint8`` CPU tensor registered with ``cudaHostRegister``
    HostRegistrar       the register/unregister pair it uses (torch's cudart binding by default)
    torch_registrar     that pair through ``torch.cuda.cudart()``
    mapped_device_pointer   what the driver says about a host address (registered? mapped where?)

Registering one large region once (instead of ``pin_memory=True`` per tensor, which rounds each
allocation up to a power of two) keeps the CPU tier dense. The region is page-aligned and covers
whole pages, so two buffers never share a registered page. With ``allow_pageable=True`` a failed
registration is logged with ``logging.warning`` and the buffer stays pageable
(``is_registered == False``, reported by the engine's statistics); otherwise it raises.

Do not ask torch whether such memory is pinned: ``Tensor.is_pinned()`` only knows torch's own
pinned allocations and reports ``False`` for a ``cudaHostRegister``-ed region (torch 2.11), which
DMA and kernels nevertheless use at full speed. ``PinnedHostBuffer.is_registered`` records what
the registration returned; ``mapped_device_pointer`` asks the driver.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import attrs
import torch

from kvmgr.errors import TransferError
from kvmgr.transfer.pin_plan import MAX_REGISTER_BYTES

__all__ = ["HostRegistrar", "PinnedHostBuffer", "mapped_device_pointer", "torch_registrar"]

_LOG = logging.getLogger(__name__)
_PAGE_BYTES = 4096
_REGISTER_FLAGS = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


@attrs.frozen
class HostRegistrar:
    """How host memory is page-locked.

    Attributes:
        register: ``(address, num_bytes) -> None``; raises ``RuntimeError`` with the reason.
        unregister: ``(address) -> None``; raises ``RuntimeError`` with the reason.
    """

    register: Callable[[int, int], None]
    unregister: Callable[[int], None]


def mapped_device_pointer(address: int) -> int | None:
    """The device address through which kernels reach host ``address``, or ``None`` when the
    driver does not know ``address`` as page-locked host memory (pageable, or never registered).

    Asks the driver (``cuPointerGetAttribute``: memory type, then device pointer) in the calling
    thread's current context, torch's primary context once torch has used the device. With
    unified addressing the result equals ``address``.

    Raises:
        RuntimeError: no CUDA driver could be loaded (cuda-python's ``DynamicLibNotFoundError``).
    """
    from cuda.bindings import driver as cu

    attribute = cu.CUpointer_attribute
    err, kind = cu.cuPointerGetAttribute(attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)
    if err != cu.CUresult.CUDA_SUCCESS or int(kind) != int(cu.CUmemorytype.CU_MEMORYTYPE_HOST):
        return None
    err, pointer = cu.cuPointerGetAttribute(attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER, address)
    return int(pointer) if err == cu.CUresult.CUDA_SUCCESS else None


def torch_registrar() -> HostRegistrar:
    """``cudaHostRegister``/``cudaHostUnregister`` through ``torch.cuda.cudart()``, which shares
    torch's CUDA runtime and primary context.

    Raises:
        RuntimeError: CUDA is not available to torch.
    """
    try:
        cudart = torch.cuda.cudart()
    except (AssertionError, RuntimeError) as exc:  # a CPU-only torch raises AssertionError
        raise RuntimeError(f"CUDA runtime not available to torch: {exc}") from exc

    def _check(what: str, err: object) -> None:
        code = int(err)  # type: ignore[call-overload]
        if code != 0:
            raise RuntimeError(f"{what} failed: {cudart.cudaGetErrorString(err)} (error {code})")

    def register(address: int, num_bytes: int) -> None:
        _check("cudaHostRegister", cudart.cudaHostRegister(address, num_bytes, _REGISTER_FLAGS))

    def unregister(address: int) -> None:
        _check("cudaHostUnregister", cudart.cudaHostUnregister(address))

    return HostRegistrar(register, unregister)


class PinnedHostBuffer:
    """One host region of ``num_bytes``, page-locked for DMA until ``close``.

    Args:
        num_bytes: size of the CPU tier in bytes, ``>= 1``.
        allow_pageable: on a failed registration, log a warning and keep pageable memory
            instead of raising.
        registrar: register/unregister functions; ``torch_registrar()`` by default.

    Attributes:
        tensor: ``uint8 [num_bytes]`` CPU tensor, page-aligned, page-locked if ``is_registered``.
        is_registered: whether the registration succeeded (and ``close`` has not undone it).
        register_s: seconds the registration took (``0.0`` if it failed).

    Raises:
        ValueError: ``num_bytes < 1``.
        TransferError: registration failed and ``allow_pageable`` is false.
    """

    def __init__(
        self,
        num_bytes: int,
        *,
        allow_pageable: bool = False,
        registrar: HostRegistrar | None = None,
    ) -> None:
        if num_bytes < 1:
            raise ValueError(f"expected num_bytes >= 1, got {num_bytes}")
        registered_bytes = -(-num_bytes // _PAGE_BYTES) * _PAGE_BYTES
        raw = torch.empty(registered_bytes + _PAGE_BYTES, dtype=torch.uint8)
        offset = -raw.data_ptr() % _PAGE_BYTES
        self._region = raw[offset : offset + registered_bytes]  # keeps `raw` alive
        self.tensor = self._region[:num_bytes]
        self._registrar = registrar
        self.is_registered = False
        self.register_s = 0.0
        start = time.perf_counter()
        base = self._region.data_ptr()
        self._chunks: list[int] = []  # registered addresses (<= 64 GiB each: vllm #51080)
        try:
            self._registrar = registrar or torch_registrar()
            for at in range(0, registered_bytes, MAX_REGISTER_BYTES):
                self._registrar.register(base + at, min(MAX_REGISTER_BYTES, registered_bytes - at))
                self._chunks.append(base + at)
        except RuntimeError as exc:
            self._unregister_chunks()
            message = (
                f"could not page-lock {registered_bytes} B of host memory for the CPU tier: {exc} "
                "(check `ulimit -l` and free memory, or pass allow_pageable=True to accept "
                "pageable memory at a fraction of the bandwidth)"
            )
            if not allow_pageable:
                raise TransferError(message) from exc
            _LOG.warning("%s; falling back to pageable memory", message)
            return
        self.register_s = time.perf_counter() - start
        self.is_registered = True

    @property
    def num_bytes(self) -> int:
        """Usable bytes (``tensor.numel()``)."""
        return self.tensor.numel()

    def close(self) -> None:
        """Unregister the region (idempotent). The tensor stays valid as pageable memory.

        Call only when no copy reads or writes the region any more.

        Raises:
            TransferError: ``cudaHostUnregister`` failed.
        """
        if not self.is_registered:
            return
        self.is_registered = False
        errors = self._unregister_chunks()
        if errors:
            raise TransferError(f"could not unregister the CPU tier: {'; '.join(errors)}")

    def _unregister_chunks(self) -> list[str]:
        errors = []
        while self._chunks:
            address = self._chunks.pop()
            try:
                assert self._registrar is not None
                self._registrar.unregister(address)
            except RuntimeError as exc:
                errors.append(str(exc))
        return errors
