"""What the transfer stack finds on this machine, for ``kvmgr info`` and bug reports.

Offers:
    collect_info    GPU, driver, CUDA, cuda-python, torch, batch-copy ABI, pinned memory, copy path

Every probe is guarded: without a GPU or a driver the values say so ("no CUDA device",
"no CUDA driver") instead of raising.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from kvmgr.transfer.driver import CopyDriver, attrs_layout_matches

__all__ = ["collect_info"]

_T = TypeVar("_T")
_NO_DRIVER = "no CUDA driver"
_NO_DEVICE = "no CUDA device"


def collect_info(*, probe_pinned: bool = True) -> dict[str, object]:
    """Probe the CUDA stack the transfer engines rely on.

    Args:
        probe_pinned: register (and unregister) 1 MiB of host memory to check pinning works.

    Returns:
        An ordered ``{label: value}`` dict of strings and ints:
        ``torch``, ``torch_cuda`` (CUDA runtime torch was built with), ``cuda_python``,
        ``gpu``, ``compute_capability``, ``driver`` (kernel module version), ``driver_cuda``
        (CUDA version the driver supports), ``batch_copy_abi`` (``13000``, ``12080`` or
        ``"missing"``), ``memcpy_attrs_layout``, ``pinned_memory`` (registration time, and
        whether the driver maps the region at its host address), ``copy_path``
        (``"batch"``/``"loop"``: what ``CudaBatchEngine(copy_path="auto")`` would use).
    """
    info: dict[str, object] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none (CPU build)",
        "cuda_python": _cuda_python_version(),
    }
    has_device = _guard(torch.cuda.is_available, False)
    if has_device:
        info["gpu"] = torch.cuda.get_device_name()
        info["compute_capability"] = "{}.{}".format(*torch.cuda.get_device_capability())
    else:
        info["gpu"] = info["compute_capability"] = _NO_DEVICE
    info["driver"] = _kernel_module_version()
    driver = _probe_driver(info)
    layout: bool | None = _guard(attrs_layout_matches, None)
    info["memcpy_attrs_layout"] = {
        True: "24 B, matches cuda-python",
        False: "MISMATCH with cuda-python",
        None: "not checked (no cuda-python)",
    }[layout]
    info["pinned_memory"] = _probe_pinned() if probe_pinned and has_device else _NO_DEVICE
    if driver is None or not has_device:
        info["copy_path"] = "host only"
    else:
        info["copy_path"] = "batch" if driver.batch_abi else "loop"
    return info


def _probe_driver(info: dict[str, object]) -> CopyDriver | None:
    """The copy driver, its ``driver_cuda`` and ``batch_copy_abi`` written into ``info`` (or
    ``driver_error`` and ``None`` where it cannot be loaded)."""
    try:
        driver = CopyDriver()
    except (RuntimeError, ImportError) as exc:
        info["driver_cuda"] = info["batch_copy_abi"] = _NO_DRIVER
        info["driver_error"] = _first_line(exc)
        return None
    version = driver.driver_version
    info["driver_cuda"] = f"{version // 1000}.{version % 1000 // 10} ({version})"
    info["batch_copy_abi"] = driver.batch_abi or "missing"
    return driver


def _probe_pinned() -> str:
    from kvmgr.transfer.pinned import PinnedHostBuffer, mapped_device_pointer

    try:
        buffer = PinnedHostBuffer(1 << 20)
    except Exception as exc:  # report, never raise: this is a diagnostic
        return f"FAILED: {_first_line(exc)}"
    try:
        address = buffer.tensor.data_ptr()
        mapped = _guard(lambda: mapped_device_pointer(address), None)
        where = {None: "not mapped?", address: "device ptr == host ptr"}.get(mapped, "mapped")
        return f"ok (1 MiB registered in {buffer.register_s * 1e3:.2f} ms, {where})"
    finally:
        buffer.close()


def _cuda_python_version() -> str:
    try:
        import cuda.bindings
    except ImportError:
        return "not installed"
    return str(getattr(cuda.bindings, "__version__", "unknown"))


def _kernel_module_version() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return _NO_DRIVER
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
    return match.group(1) if match else text.splitlines()[0].strip()


def _guard(probe: Callable[[], _T], default: _T) -> _T:
    try:
        return probe()
    except Exception:  # a diagnostic: report the default, never raise
        return default


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
