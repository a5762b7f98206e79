"""Version, status names and capability queries."""
import ctypes

from ._lib import bind, lib

bind("dflash_version_string", [], ctypes.c_char_p)
_cuda_count = bind("dflash_cuda_device_count", [ctypes.POINTER(ctypes.c_int)])


def version():
    """The loaded library's version string, e.g. "0.1.0"."""
    return lib.dflash_version_string().decode()


def status_name(code):
    """Name of a dflash_status code."""
    return lib.dflash_status_str(int(code)).decode()


def cuda_device_count():
    """Number of usable CUDA devices; raises Error when there is none or no CUDA build."""
    n = ctypes.c_int(0)
    _cuda_count(ctypes.byref(n))
    return n.value
