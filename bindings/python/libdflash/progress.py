"""Progress reporting (include/dflash/progress.h): the library draws the bar and
hands its text to a write callback, which writes it to a Python file, path or
descriptor.

    with libdflash.Progress("train", "steps", total=100, stream="log.txt") as p:
        for step in range(100):
            p.update(step + 1, note=f"loss {loss:.3f}")
"""
import ctypes
import io
import os
import sys

from ._lib import Handle, bind, cstr

_P = ctypes.c_void_p
WRITE_FN = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_char), ctypes.c_size_t, ctypes.c_void_p)
_create = bind("dflash_progress_create", [WRITE_FN, _P, ctypes.c_int32, ctypes.c_char_p,
                                          ctypes.c_char_p, ctypes.c_uint64, ctypes.c_double,
                                          ctypes.POINTER(_P)])
_update = bind("dflash_progress_update", [_P, ctypes.c_uint64, ctypes.c_char_p], None)
_finish = bind("dflash_progress_finish", [_P], None)
bind("dflash_progress_free", [_P], None)


def _sink(target):
    """(write(bytes), isatty, close) for a stream target: None (standard error), an int
    descriptor (written with os.write, left open), a file object (written and flushed, left
    open; text or binary) or a path (opened for appending, closed with the reporter)."""
    if target is None:
        target = sys.stderr
    if isinstance(target, int):
        fd = target
        return (lambda b: os.write(fd, b)), os.isatty(fd), (lambda: None)
    if hasattr(target, "write"):
        f = target
        text = isinstance(f, io.TextIOBase) or "b" not in getattr(f, "mode", "b")

        def write(b):
            f.write(b.decode("utf-8", "replace") if text else b)
            f.flush()

        try:
            tty = f.isatty()
        except (AttributeError, ValueError, OSError):
            tty = False
        return write, tty, (lambda: None)
    f = open(cstr(target), "ab")
    return (lambda b: (f.write(b), f.flush())), False, f.close


class Progress(Handle):
    """A progress reporter: a live bar on a terminal, a plain line at most every
    `interval` seconds elsewhere (interval <= 0: 10 s). `stream`: None (standard
    error), a path (appended to), a file object or an int descriptor. total=0
    when unknown. Leaving a `with` block (or close()) draws the final state."""

    _free = "dflash_progress_free"
    _close_sink = None

    def __init__(self, label, unit, total=0, interval=0.0, stream=None):
        write, tty, self._close_sink = _sink(stream)

        def on_write(text, n, _user):
            write(ctypes.string_at(text, n))

        self._write = WRITE_FN(on_write)  # kept alive as long as the reporter
        h = _P()
        try:
            _create(self._write, None, 1 if tty else 0, cstr(label), cstr(unit), int(total),
                    float(interval), ctypes.byref(h))
        except BaseException:
            self._close_sink()
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

    def close(self):
        """Finish (draw the final state), free the reporter and close a stream it opened."""
        super().close()
        close_sink, self._close_sink = self._close_sink, None
        if close_sink is not None:
            close_sink()
