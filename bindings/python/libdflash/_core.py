"""Version, status names, capability queries, the thread's error message and
the library's log messages."""
import atexit
import ctypes
import logging
import warnings

from ._lib import bind, lib

bind("dflash_version_string", [], ctypes.c_char_p)
bind("dflash_blas_corename", [], ctypes.c_char_p)
bind("dflash_blas_coretype_advice", [], ctypes.c_char_p)
_cuda_count = bind("dflash_cuda_device_count", [ctypes.POINTER(ctypes.c_int)])
_clear_error = bind("dflash_clear_error", [], None)

LOG_LEVELS = {"error": 0, "warn": 1, "info": 2, "debug": 3}
_LEVEL_NAMES = {v: k for k, v in LOG_LEVELS.items()}
_PY_LEVELS = {0: logging.ERROR, 1: logging.WARNING, 2: logging.INFO, 3: logging.DEBUG}
_LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_set_log = bind("dflash_set_log_callback", [_LOG_FN, ctypes.c_void_p, ctypes.c_int], None)
_log_callback = None  # the installed ctypes callback: it must outlive its use by C


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


def blas_kernels():
    """(the kernel set OpenBLAS chose, e.g. "Zen", and the OPENBLAS_CORETYPE this CPU
    runs faster with, or None when the chosen set fits). OpenBLAS reads
    OPENBLAS_CORETYPE when it is loaded: set it before Python starts. Creating a
    Trainer logs the same advice once (see log_to_python)."""
    advice = lib.dflash_blas_coretype_advice()
    return lib.dflash_blas_corename().decode(), advice.decode() if advice else None


_blas_warned = False


def warn_generic_blas():
    """Once a process, a RuntimeWarning when OpenBLAS runs kernels older than the CPU
    (the library's own warning goes to its log callback, which Python discards unless
    log_to_python or set_log_callback is called)."""
    global _blas_warned
    core, advice = blas_kernels()
    if advice and not _blas_warned:
        _blas_warned = True
        warnings.warn(f"OpenBLAS runs its generic {core} kernels on this CPU: set "
                      f"OPENBLAS_CORETYPE={advice} before Python starts for its faster "
                      f"{advice} kernels", RuntimeWarning, stacklevel=3)


def last_error():
    """This thread's message of the last failing library call ("" when none).
    libdflash.Error carries it already; this is for code that calls `_lib` directly."""
    return lib.dflash_last_error().decode("utf-8", "replace")


def clear_error():
    """Forget this thread's last error message."""
    _clear_error()


def set_log_callback(fn, max_level="info"):
    """Route the library's log messages to fn(level, message), level one of
    "error", "warn", "info", "debug"; messages above `max_level` are dropped in C
    before they are formatted. fn=None discards them (the library's default).
    fn may be called from library threads (the fetcher's loop, the thread pool);
    exceptions it raises are printed by ctypes and otherwise ignored."""
    global _log_callback
    if fn is None:
        _set_log(_LOG_FN(), None, 0)
        _log_callback = None
        return

    def trampoline(level, message, _user):
        fn(_LEVEL_NAMES.get(level, "debug"), message.decode("utf-8", "replace"))

    cb = _LOG_FN(trampoline)
    _set_log(cb, None, LOG_LEVELS[max_level])
    _log_callback = cb  # replaced only after C stopped using the old one


def log_to_python(logger="libdflash", max_level=None):
    """Send library log messages to the `logging` logger named `logger` (or a
    Logger), at ERROR/WARNING/INFO/DEBUG. max_level None: what the logger's
    effective level lets through, decided now."""
    log = logger if isinstance(logger, logging.Logger) else logging.getLogger(logger)
    if max_level is None:
        effective = log.getEffectiveLevel()
        max_level = next((name for name, py in (("debug", logging.DEBUG), ("info", logging.INFO),
                                                ("warn", logging.WARNING)) if effective <= py),
                         "error")
    set_log_callback(lambda level, msg: log.log(_PY_LEVELS[LOG_LEVELS[level]], "%s", msg),
                     max_level)
    return log


@atexit.register
def _unset_log_callback():
    # Library threads must not call into a finalizing interpreter.
    if _log_callback is not None:
        set_log_callback(None)
