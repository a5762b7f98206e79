"""Progress reporting (include/dflash/progress.h) and the C `FILE *` streams the
library writes progress to, made from Python files, paths or descriptors.

    with libdflash.Progress("train", "steps", total=100, stream="log.txt") as p:
        for step in range(100):
            p.update(step + 1, note=f"loss {loss:.3f}")
"""
import ctypes
import ctypes.util
import os

from ._lib import Handle, bind, cstr

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_fdopen = _libc.fdopen
_fdopen.argtypes, _fdopen.restype = [ctypes.c_int, ctypes.c_char_p], ctypes.c_void_p
_fflush = _libc.fflush
_fflush.argtypes, _fflush.restype = [ctypes.c_void_p], ctypes.c_int
_fclose = _libc.fclose
_fclose.argtypes, _fclose.restype = [ctypes.c_void_p], ctypes.c_int

_P = ctypes.c_void_p
_create = bind("dflash_progress_create", [_P, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint64,
                                          ctypes.c_double, ctypes.POINTER(_P)])
_update = bind("dflash_progress_update", [_P, ctypes.c_uint64, ctypes.c_char_p], None)
_finish = bind("dflash_progress_finish", [_P], None)
bind("dflash_progress_free", [_P], None)


class CFile(Handle):
    """A C `FILE *` (opened for appending) over a Python stream; `ptr` is the pointer.

    `target`: a path (opened for appending and closed with this object), a
    file object with fileno() (flushed first; its descriptor is duplicated,
    so it stays open), an int descriptor (duplicated), or None for the
    process's standard error (descriptor 2). C buffers are flushed by
    flush() and close()."""

    def __init__(self, target=None):
        if target is None:
            fd = os.dup(2)
        elif isinstance(target, int):
            fd = os.dup(target)
        elif hasattr(target, "fileno"):
            target.flush()
            fd = os.dup(target.fileno())
        else:
            fd = os.open(cstr(target), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        ptr = _fdopen(fd, b"a")
        if not ptr:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"fdopen: {os.strerror(err)}")
        self._h = ptr

    @property
    def ptr(self):
        """The `FILE *` (an int address; None once closed)."""
        return self._h

    def _release(self, h):
        _fclose(h)

    def flush(self):
        """Flush the C stream's buffer."""
        if self._h:
            _fflush(self._h)


class Progress(Handle):
    """A progress reporter: a live bar on a terminal, a plain line at most every
    `interval` seconds elsewhere (interval <= 0: 10 s). `stream` as for CFile
    (None: standard error). total=0 when unknown. Leaving a `with` block (or
    close()) draws the final state."""

    _free = "dflash_progress_free"

    def __init__(self, label, unit, total=0, interval=0.0, stream=None):
        self._file = CFile(stream)
        h = _P()
        try:
            _create(self._file.ptr, cstr(label), cstr(unit), int(total), float(interval),
                    ctypes.byref(h))
        except BaseException:
            self._file.close()
            raise
        self._h = h

    def update(self, done, note=None):
        """`done` units complete so far (absolute); `note` is appended ("loss 2.31")."""
        if self._h:
            _update(self._h, int(done), cstr(note))

    def finish(self):
        """Draw the final state and end the line; later updates are ignored."""
        if self._h:
            _finish(self._h)
            self._file.flush()

    def close(self):
        """Finish (draw the final state), free the reporter and close its stream."""
        super().close()
        self._file.close()
