"""Loading libdflash and declaring its functions (ctypes, no compiled extension).

Search order: $DFLASH_LIBRARY, a libdflash.so next to this package, then the
system (ctypes.util.find_library). The loaded library's version must match
the major.minor this package was written for.
"""
import ctypes
import ctypes.util
import os
import pathlib

ABI_MAJOR, ABI_MINOR = 0, 1


class Error(Exception):
    """A libdflash call failed: `status` is the dflash_status name, `message` the detail."""

    def __init__(self, status, message):
        self.code = int(status)
        self.status = _status_name(status)
        self.message = message
        super().__init__(f"{self.status}: {message}")


def _candidates():
    env = os.environ.get("DFLASH_LIBRARY")
    if env:
        yield env
        return
    here = pathlib.Path(__file__).resolve().parent
    for name in ("libdflash.so", "libdflash.so.0", "libdflash.dylib"):
        if (here / name).exists():
            yield str(here / name)
    found = ctypes.util.find_library("dflash")
    if found:
        yield found


def _load():
    tried = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path)
        except OSError as exc:
            tried.append(f"{path}: {exc}")
    raise ImportError(
        "libdflash not found; set DFLASH_LIBRARY to the path of libdflash.so"
        + ("".join("\n  tried " + t for t in tried)))


lib = _load()
lib.dflash_version_number.restype = ctypes.c_int
lib.dflash_version_number.argtypes = []
lib.dflash_status_str.restype = ctypes.c_char_p
lib.dflash_status_str.argtypes = [ctypes.c_int]
lib.dflash_last_error.restype = ctypes.c_char_p
lib.dflash_last_error.argtypes = []

_version = lib.dflash_version_number()
if (_version // 10000, _version // 100 % 100) != (ABI_MAJOR, ABI_MINOR):
    raise ImportError(f"libdflash version {_version} does not match the Python package "
                      f"({ABI_MAJOR}.{ABI_MINOR}); set DFLASH_LIBRARY to a matching build")


def _status_name(status):
    return lib.dflash_status_str(int(status)).decode()


def _errcheck(result, func, args):
    if result != 0:
        raise Error(result, lib.dflash_last_error().decode("utf-8", "replace"))
    return result


def bind(name, argtypes, restype=ctypes.c_int):
    """Declare a library function. Functions returning dflash_status (the default
    restype) raise Error on failure."""
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = restype
    if restype is ctypes.c_int:
        fn.errcheck = _errcheck
    return fn


def cstr(value):
    """Encode a str/PathLike for a `const char *` argument (None stays NULL)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    return os.fsencode(value)


class Handle:
    """Base of the classes that own one C object (`self._h`) freed by the C function
    named in `_free`. close() is idempotent; `with` blocks and garbage collection call
    it; __del__ is safe at interpreter exit, when the library may already be gone."""

    _h = None
    _free = None  # name of the dflash_X_free function

    def close(self):
        h, self._h = self._h, None
        if h and lib is not None:
            getattr(lib, self._free)(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
