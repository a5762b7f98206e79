"""Loading libdflash and declaring its functions (ctypes, no compiled extension).

Search order: $DFLASH_LIBRARY (alone when set), a libdflash.so next to this
package, the soname libdflash.so.N through the dynamic loader
(LD_LIBRARY_PATH, ld.so.cache), ctypes.util.find_library, then the libdir
that `pkg-config dflash` names. The first library whose version matches the
MAJOR.MINOR this package was written for is used.

Every function the package calls is declared through `bind`, which records
its name in BOUND (tests/test_coverage.py checks it against the headers).
"""
import ctypes
import ctypes.util
import os
import pathlib
import subprocess

from ._version import __version__, SOVERSION

ABI_MAJOR, ABI_MINOR = (int(x) for x in __version__.split(".")[:2])
BOUND = set()


class Error(Exception):
    """A libdflash call failed: `status` is the dflash_status name, `message` the detail."""

    def __init__(self, status, message):
        self.code = int(status)
        self.status = _status_name(status)
        self.message = message
        super().__init__(f"{self.status}: {message}")


def _pkg_config_libdir():
    try:
        out = subprocess.run(["pkg-config", "--variable=libdir", "dflash"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _candidates():
    env = os.environ.get("DFLASH_LIBRARY")
    if env:
        yield env
        return
    here = pathlib.Path(__file__).resolve().parent
    for name in ("libdflash.so", f"libdflash.so.{SOVERSION}", "libdflash.dylib"):
        if (here / name).exists():
            yield str(here / name)
    yield f"libdflash.so.{SOVERSION}"
    found = ctypes.util.find_library("dflash")
    if found:
        yield found
    libdir = _pkg_config_libdir()
    if libdir:
        yield os.path.join(libdir, f"libdflash.so.{SOVERSION}")


def _library_version(candidate):
    fn = candidate.dflash_version_number
    fn.argtypes, fn.restype = [], ctypes.c_int
    return fn()


def _load():
    tried = []
    for path in _candidates():
        try:
            candidate = ctypes.CDLL(path)
        except OSError as exc:
            tried.append(f"{path}: {exc}")
            continue
        v = _library_version(candidate)
        if (v // 10000, v // 100 % 100) == (ABI_MAJOR, ABI_MINOR):
            return candidate
        tried.append(f"{path}: version {v // 10000}.{v // 100 % 100}.{v % 100}")
    raise ImportError(
        f"no libdflash {ABI_MAJOR}.{ABI_MINOR}.x found; set DFLASH_LIBRARY to the path of "
        "libdflash.so or install the library" + "".join("\n  tried " + t for t in tried))


lib = _load()


def _errcheck(result, func, args):
    if result != 0:
        raise Error(result, lib.dflash_last_error().decode("utf-8", "replace"))
    return result


def bind(name, argtypes, restype=ctypes.c_int, status=None):
    """Declare a library function and record it in BOUND. Functions returning
    dflash_status raise Error on failure: status=None takes that to mean a
    c_int restype; pass status=False for an int that is not a status
    (ctypes.c_int32 is ctypes.c_int)."""
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = restype
    if status is None:
        status = restype is ctypes.c_int
    if status:
        fn.errcheck = _errcheck
    BOUND.add(name)
    return fn


bind("dflash_version_number", [], ctypes.c_int, status=False)
bind("dflash_status_str", [ctypes.c_int], ctypes.c_char_p)
bind("dflash_last_error", [], ctypes.c_char_p)


def _status_name(status):
    return lib.dflash_status_str(int(status)).decode()


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
            self._release(h)

    def _release(self, h):
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
