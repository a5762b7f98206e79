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


class Owner:
    """Owns one C object, freed by `free` when the last reference to this Owner goes.

    A Handle that made views (see `view`) holds one reference and drops it on close();
    each view holds another as its numpy base. So close() frees at once when no view is
    left, and otherwise the last view to go frees it: a view never outlives its memory.
    `parent`: the Owner of an object this one borrows (a storage client), kept until
    this one is freed."""

    def __init__(self, ptr, free, parent=None):
        self.ptr, self._free, self.parent = ptr, free, parent

    def detach(self):
        """Take the pointer back (the caller frees it now); the Owner frees nothing."""
        ptr, self.ptr = self.ptr, None
        return ptr

    def __del__(self):
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr and self._free is not None:
            try:
                self._free(ptr)
            except Exception:  # interpreter shutdown
                pass
        self.parent = None  # after the free: this object borrowed the parent's


class _ArrayInterface:
    """What numpy wraps (and keeps as the array's base): an address, and the Owner."""

    def __init__(self, owner, address, shape, typestr):
        self.owner = owner
        self.__array_interface__ = {"data": (address, True), "shape": shape,
                                    "typestr": typestr, "version": 3}


def view(owner, address, shape, dtype):
    """A read-only numpy array over `address` (memory of the Owner `owner`, C order)
    that keeps `owner` alive; empty shapes (and a NULL address) give an empty array."""
    import numpy as np
    dtype, shape = np.dtype(dtype), tuple(int(d) for d in shape)
    if not address or 0 in shape:
        out = np.empty(shape, dtype)
    else:
        out = np.asarray(_ArrayInterface(owner, address, shape, dtype.str))
    out.flags.writeable = False
    return out


class Handle:
    """Base of the classes that own one C object (`self._h`) freed by the C function
    named in `_free`. close() is idempotent; `with` blocks and garbage collection call
    it; __del__ is safe at interpreter exit, when the library may already be gone.

    A class whose arrays view the object's memory adopts it with `_own(h)` and makes
    them with `_view`: close() then frees the object only once the last view is gone.
    Methods reach the object through `_handle()`, which raises ValueError once closed."""

    _h = None
    _free = None  # name of the dflash_X_free function
    _owner = None  # an Owner, for classes that hand out views (see _own)

    def _own(self, h):
        self._owner = Owner(h, getattr(lib, self._free))
        self._h = h

    def _view(self, address, shape, dtype):
        return view(self._owner, address, shape, dtype)

    def _handle(self):
        if not self._h:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._h

    def close(self):
        h, self._h = self._h, None
        if self._owner is not None:
            self._owner = None  # frees h now, or when the last view goes
        elif h and lib is not None:
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
