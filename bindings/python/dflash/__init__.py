"""Python bindings for libdflash (ctypes over the C library's stable ABI)."""
from ._lib import Error
from ._core import version, status_name, cuda_device_count
from .fetch import fetch

__version__ = version()

__all__ = ["Error", "version", "status_name", "cuda_device_count"]
