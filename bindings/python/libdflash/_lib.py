"""Loading libdflash and declaring its functions (ctypes; tokenizer.py adds an optional compiled
extension, libdflash._fast, that calls the functions of the library loaded here).

Search order: the library inside this package (lib/libdflash.so.N, what `pip install` of the
repository puts there; or a libdflash.so beside it), then $DFLASH_LIBRARY, then, only when DFLASH_LIBRARY is unset, the
system's: the soname libdflash.so.N through the dynamic loader (LD_LIBRARY_PATH,
ld.so.cache), ctypes.util.find_library, then the libdir that `pkg-config dflash` names. The
first library whose version equals this package's (__version__) is used; when none does,
import fails naming the package's version and each library tried with its own.

Every function the package calls is declared through `bind`, which records
its name in BOUND (tests/test_coverage.py checks it against the headers).

Failures raise a subclass of Error chosen by the status (STATUS_CLASSES); the
package docstring tables them. `bind(..., errors=...)` refines the class for
the statuses whose meaning depends on the call: DFLASH_E_NOT_FOUND (a missing
file, files(); a missing name or id, KEY; a missing file when one of the call's
local paths does not exist, missing_path()), DFLASH_E_IO (a missing file when the
path does not exist, files() and missing_path()) and DFLASH_E_RANGE (an index,
INDEX).
"""
import ctypes
import ctypes.util
import errno
import os
import pathlib
import subprocess

from ._version import __version__, SOVERSION

ABI_MAJOR, ABI_MINOR = (int(x) for x in __version__.split(".")[:2])
BOUND = set()


class Error(Exception):
    """A libdflash call failed: `status` is the dflash_status name ("DFLASH_E_IO"), `code`
    its number, `message` the detail. The base of every exception the library's statuses
    raise (STATUS_CLASSES): `except libdflash.Error` catches them all."""

    def __init__(self, status, message):
        self.code = int(status)
        self.status = _status_name(status)
        self.message = message
        super().__init__(f"{self.status}: {message}")

    def __str__(self):  # KeyError's would quote the text
        return f"{self.status}: {self.message}"

    def __reduce__(self):  # pickles (multiprocessing) as the same class, status and message
        return (type(self), (self.code, self.message))


class _OSErrorMixin:
    """errno and strerror for the OSError subclasses (filename stays None: the message
    names the path)."""
    _errno = None

    def __init__(self, status, message):
        super().__init__(status, message)
        self.errno, self.strerror = self._errno, message


class InvalidArgumentError(Error, ValueError):
    """DFLASH_E_INVALID_ARG: an argument the library refuses (NULL, negative, out of range)."""


class OutOfMemoryError(Error, MemoryError):
    """DFLASH_E_NOMEM: an allocation failed."""


class InputOutputError(_OSErrorMixin, Error, OSError):
    """DFLASH_E_IO: open, read, write, fsync, rename or mmap failed."""


class FormatError(Error, ValueError):
    """DFLASH_E_FORMAT: a malformed file or record."""


class TruncatedError(FormatError):
    """DFLASH_E_TRUNCATED: input that ends before its declared size."""


class RangeError(Error, ValueError):
    """DFLASH_E_RANGE: a value outside its valid range (IndexRangeError for an index)."""


class IndexRangeError(RangeError, IndexError):
    """DFLASH_E_RANGE from a call that takes an index: a sample, tensor, token id, span,
    listing entry or server index out of range."""


class SizeOverflowError(Error, OverflowError):
    """DFLASH_E_OVERFLOW: a size computation would overflow."""


class DtypeError(Error, ValueError, TypeError):
    """DFLASH_E_DTYPE: an unknown or unexpected element type."""


class Utf8Error(Error, UnicodeError):
    """DFLASH_E_UTF8: invalid UTF-8 (UnicodeError is a ValueError)."""


class DuplicateError(Error, ValueError):
    """DFLASH_E_DUPLICATE: a key, name or id given twice."""


class NotFoundError(Error, LookupError):
    """DFLASH_E_NOT_FOUND: something named does not exist. Calls that look up a file raise
    MissingFileError, calls that look up a name or id MissingKeyError; both derive from
    this class, which is raised as is where the call cannot tell."""


class MissingFileError(_OSErrorMixin, NotFoundError, FileNotFoundError):
    """DFLASH_E_NOT_FOUND for a file, directory or object that does not exist (and
    DFLASH_E_IO from a call opening a local path that does not exist)."""
    _errno = errno.ENOENT


class MissingKeyError(NotFoundError, KeyError):
    """DFLASH_E_NOT_FOUND for a name or id looked up by key: a tensor, metadata key,
    sample id, template name, parameter or token."""


class JSONError(Error, ValueError):
    """DFLASH_E_JSON: JSON that does not parse."""


class BufferTooSmallError(Error, ValueError):
    """DFLASH_E_BUFFER: a caller buffer is too small (the bindings size theirs)."""


class UnsupportedError(Error, NotImplementedError):
    """DFLASH_E_UNSUPPORTED: valid input this build does not handle."""


class StateError(Error, RuntimeError):
    """DFLASH_E_STATE: a call not valid in the object's current state."""


class ConfigError(Error, ValueError):
    """DFLASH_E_CONFIG: an inconsistent configuration."""


class MismatchError(Error, ValueError):
    """DFLASH_E_MISMATCH: two inputs that must agree do not."""


class RegexError(Error, ValueError):
    """DFLASH_E_REGEX: a regular expression that does not compile or match."""


class TemplateError(Error, ValueError):
    """DFLASH_E_TEMPLATE: a conversation the chat template cannot render."""


class HTTPError(_OSErrorMixin, Error, OSError):
    """DFLASH_E_HTTP: an HTTP error response."""


class NetworkError(_OSErrorMixin, Error, ConnectionError):
    """DFLASH_E_NETWORK: a connection, DNS, TLS or transfer failure."""


class DeadlineError(_OSErrorMixin, Error, TimeoutError):
    """DFLASH_E_TIMEOUT: a deadline passed."""
    _errno = errno.ETIMEDOUT


class CancelledError(Error):
    """DFLASH_E_CANCELLED: stopped on request (what finished is kept)."""


class CudaError(Error, RuntimeError):
    """DFLASH_E_CUDA: a CUDA, cuBLAS or NCCL call failed."""


class NoDeviceError(Error, RuntimeError):
    """DFLASH_E_NO_DEVICE: no CUDA device or driver."""


class InternalError(Error, RuntimeError):
    """DFLASH_E_INTERNAL: a bug in libdflash; please report it."""


class AuthError(_OSErrorMixin, Error, PermissionError):
    """DFLASH_E_AUTH: missing or rejected credentials."""
    _errno = errno.EACCES


class ExistsError(_OSErrorMixin, Error, FileExistsError):
    """DFLASH_E_EXISTS: refusing to overwrite something that exists."""
    _errno = errno.EEXIST


# dflash_status name -> the class its failures raise (refined per call by bind's errors=).
STATUS_CLASSES = {
    "DFLASH_E_INVALID_ARG": InvalidArgumentError,
    "DFLASH_E_NOMEM": OutOfMemoryError,
    "DFLASH_E_IO": InputOutputError,
    "DFLASH_E_FORMAT": FormatError,
    "DFLASH_E_TRUNCATED": TruncatedError,
    "DFLASH_E_RANGE": RangeError,
    "DFLASH_E_OVERFLOW": SizeOverflowError,
    "DFLASH_E_DTYPE": DtypeError,
    "DFLASH_E_UTF8": Utf8Error,
    "DFLASH_E_DUPLICATE": DuplicateError,
    "DFLASH_E_NOT_FOUND": NotFoundError,
    "DFLASH_E_JSON": JSONError,
    "DFLASH_E_BUFFER": BufferTooSmallError,
    "DFLASH_E_UNSUPPORTED": UnsupportedError,
    "DFLASH_E_STATE": StateError,
    "DFLASH_E_CONFIG": ConfigError,
    "DFLASH_E_MISMATCH": MismatchError,
    "DFLASH_E_REGEX": RegexError,
    "DFLASH_E_TEMPLATE": TemplateError,
    "DFLASH_E_HTTP": HTTPError,
    "DFLASH_E_NETWORK": NetworkError,
    "DFLASH_E_TIMEOUT": DeadlineError,
    "DFLASH_E_CANCELLED": CancelledError,
    "DFLASH_E_CUDA": CudaError,
    "DFLASH_E_NO_DEVICE": NoDeviceError,
    "DFLASH_E_INTERNAL": InternalError,
    "DFLASH_E_AUTH": AuthError,
    "DFLASH_E_EXISTS": ExistsError,
}
ERROR_CLASSES = sorted(set(STATUS_CLASSES.values()) | {MissingFileError, MissingKeyError,
                                                        IndexRangeError},
                       key=lambda c: c.__name__)

for _cls in ERROR_CLASSES + [Error]:
    _cls.__module__ = "libdflash"  # tracebacks and pickles name libdflash.MissingFileError
del _cls

# Refinements for bind(errors=...): what NOT_FOUND, IO and RANGE mean for that call.
KEY = {"DFLASH_E_NOT_FOUND": MissingKeyError}
INDEX = {"DFLASH_E_RANGE": IndexRangeError}


def _if_missing(which, otherwise):
    """A picker: MissingFileError when one of the call's paths at `which` (argument
    indices, or functions of the argument tuple) is a local path that does not exist."""
    def pick(args):
        for w in which:
            value = w(args) if callable(w) else args[w]
            if isinstance(value, (str, bytes, os.PathLike)) and value:
                path = os.fsdecode(value)
                if "://" not in path and not os.path.exists(path):
                    return MissingFileError
        return otherwise
    return pick


def files(*which):
    """errors= for a call that opens the paths at `which`: DFLASH_E_NOT_FOUND is a
    missing file, and so is DFLASH_E_IO when one of those local paths does not exist
    (some loaders report ENOENT as an I/O error; `.status` stays the library's)."""
    return {"DFLASH_E_NOT_FOUND": MissingFileError,
            "DFLASH_E_IO": _if_missing(which, None)}


def missing_path(*which):
    """errors= for a call whose NOT_FOUND may be a missing file or a missing name inside
    one (a checkpoint without a tensor): MissingFileError when one of the paths at `which`
    does not exist, NotFoundError (or InputOutputError for DFLASH_E_IO) otherwise."""
    pick = _if_missing(which, None)
    return {"DFLASH_E_NOT_FOUND": pick, "DFLASH_E_IO": pick}


def error(status, message, errors=None, args=()):
    """The exception for a failing status: STATUS_CLASSES' class, or the one `errors`
    (a bind refinement) picks for it; Error itself for a status this package does not know."""
    name = _status_name(status)
    cls = (errors or {}).get(name)
    if cls is not None and not isinstance(cls, type):
        cls = cls(args)
    if cls is None:
        cls = STATUS_CLASSES.get(name, Error)
    return cls(status, message)


def status_code(name):
    """The number of a dflash_status name ("DFLASH_E_NOT_FOUND")."""
    return _STATUS_CODES[name]


def _pkg_config_libdir():
    try:
        out = subprocess.run(["pkg-config", "--variable=libdir", "dflash"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _candidates():
    here = pathlib.Path(__file__).resolve().parent
    for name in (f"lib/libdflash.so.{SOVERSION}", "libdflash.so", "libdflash.dylib"):
        if (here / name).exists():
            yield str(here / name)
    env = os.environ.get("DFLASH_LIBRARY")
    if env:
        yield env
        return
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
    v = fn()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def _load():
    tried = []
    for path in _candidates():
        try:
            candidate = ctypes.CDLL(path)
        except OSError as exc:
            tried.append(f"{path}: {exc}")
            continue
        try:
            v = _library_version(candidate)
        except AttributeError:  # some other library of that name
            tried.append(f"{path}: no dflash_version_number, not libdflash")
            continue
        if v == __version__:
            return candidate
        tried.append(f"{path}: libdflash {v}")
    raise ImportError(
        f"the Python package libdflash {__version__} needs the library libdflash {__version__}, "
        "and none was found; reinstall the package (pip install), or set DFLASH_LIBRARY to "
        "the path of libdflash.so" + "".join("\n  tried " + t for t in tried))


lib = _load()


def _errcheck(errors):
    def check(result, func, args):
        if result != 0:
            raise error(result, lib.dflash_last_error().decode("utf-8", "replace"), errors, args)
        return result
    return check


def bind(name, argtypes, restype=ctypes.c_int, status=None, errors=None):
    """Declare a library function and record it in BOUND. Functions returning
    dflash_status raise an Error subclass on failure (see `error`): status=None
    takes that to mean a c_int restype; pass status=False for an int that is not
    a status (ctypes.c_int32 is ctypes.c_int). errors: files(...), KEY, INDEX
    (merged with |) or missing_path(...): what NOT_FOUND, IO and RANGE mean for
    this call."""
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = restype
    if status is None:
        status = restype is ctypes.c_int
    if status:
        fn.errcheck = _errcheck(errors)
    BOUND.add(name)
    return fn


bind("dflash_version_number", [], ctypes.c_int, status=False)
bind("dflash_status_str", [ctypes.c_int], ctypes.c_char_p)
bind("dflash_last_error", [], ctypes.c_char_p)


def _status_name(status):
    return lib.dflash_status_str(int(status)).decode()


def _status_codes():
    codes, code = {}, 0
    while (name := _status_name(code)) != "DFLASH_E_UNKNOWN":
        codes[name] = code
        code += 1
    return codes


_STATUS_CODES = _status_codes()  # every status the loaded library names, e.g. "DFLASH_OK": 0


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
