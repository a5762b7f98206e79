"""Tokenizers: exact tiktoken / Hugging Face byte-level BPE (see include/dflash/tokenizer.h).

Tokenizer.encode and encode_batch go through libdflash._fast (bindings/python/ext/_fast.c)
when the package has it, and through ctypes otherwise (`_encode_ctypes`,
`_encode_batch_ctypes`: the same results and errors). A call on a short text costs about 2 us
through ctypes, most of it ctypes' argument conversion; a batch of short texts spends as much
in Python, holding the GIL, as the library spends encoding them on its threads."""
import ctypes
import importlib
import importlib.util
import os
import threading

import numpy as np

from ._lib import INDEX, KEY, Handle, Error, bind, cstr, error, files, lib

_c_size_p = ctypes.POINTER(ctypes.c_size_t)
_i32_p = ctypes.POINTER(ctypes.c_int32)


class _Options(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("pattern", ctypes.c_char_p)]


_options_default = bind("dflash_tokenizer_options_init", [ctypes.POINTER(_Options), ctypes.c_size_t], None)
_load = bind("dflash_tokenizer_load",
             [ctypes.c_char_p, ctypes.POINTER(_Options), ctypes.POINTER(ctypes.c_void_p)],
             errors=files(0))
_free = bind("dflash_tokenizer_free", [ctypes.c_void_p], None)
_vocab_size = bind("dflash_tokenizer_vocab_size", [ctypes.c_void_p], ctypes.c_size_t)
_max_ids = bind("dflash_tokenizer_max_ids", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_size_t)
_encode = bind("dflash_tokenizer_encode",
               [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, _i32_p,
                ctypes.c_size_t, _c_size_p])
# encode's fast path: the function through PyDLL, which keeps the GIL during the call (for
# a short text, releasing and taking it back costs more than the encoding), without
# argtypes or errcheck: the caller passes ctypes objects made once per thread (a bytes
# object goes as its char *, a small int as an int) and checks the status itself.
_encode_gil = ctypes.PyDLL(lib._name, handle=lib._handle)["dflash_tokenizer_encode"]
_encode_gil.argtypes = None
_encode_gil.restype = ctypes.c_int
_c_size = ctypes.c_size_t
_encode_batch = bind("dflash_tokenizer_encode_batch",
                     [ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p), _c_size_p,
                      ctypes.c_size_t, ctypes.c_int, ctypes.c_int32, _i32_p, ctypes.c_size_t,
                      _c_size_p])
_decode = bind("dflash_tokenizer_decode",
               [ctypes.c_void_p, _i32_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t,
                _c_size_p], errors=INDEX)
_token_to_id = bind("dflash_tokenizer_token_to_id",
                    [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, _i32_p], errors=KEY)
_hash = bind("dflash_tokenizer_hash", [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t])
_id_to_token = bind("dflash_tokenizer_id_to_token",
                    [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p), _c_size_p,
                     ctypes.POINTER(ctypes.c_int)], errors=INDEX | KEY)

# experimental.h: the calling thread's counters, for benchmarks.
_thread_stats = bind("dflash_tokenizer_thread_stats",
                     [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), _c_size_p],
                     None)


def thread_stats():
    """The calling thread's tokenizer counters (experimental: dflash_tokenizer_thread_stats):
    {"pieces", "cache_misses"} of its single-text encodes since the thread began, and
    "cache_bytes", its piece and pair caches' memory (fixed; 0 before its first encode)."""
    p, m, b = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_size_t()
    _thread_stats(ctypes.byref(p), ctypes.byref(m), ctypes.byref(b))
    return {"pieces": p.value, "cache_misses": m.value, "cache_bytes": b.value}


_SPECIAL = {"all": 0, "none": 1}
# Texts up to _GIL_BYTES bytes are encoded holding the GIL (a few microseconds at most),
# into a per-thread buffer of _FAST_IDS ids, which they cannot overflow (at most 3 ids a
# byte, 6 with a prefix space); longer ones release the GIL and get an array of their own.
_GIL_BYTES = 2048


def _ids_bound(n_bytes):
    """Room for the ids of n_bytes of text: byte-level BPE gives at most one id per byte
    (only repaired or NFC-expanded text can need more, and is encoded again at its size).
    Half a byte each, as before, made every text with more ids than that (CJK runs, emoji,
    digits: 0.68 ids per byte on the bench's CJK text) encode twice."""
    return n_bytes + 16
_FAST_IDS = 6 * _GIL_BYTES + 16


def _utf8(text):
    """str -> UTF-8 bytes the way tiktoken does it (lone surrogates become U+FFFD)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")


def _mode(special):
    try:
        return _SPECIAL[special]
    except KeyError:
        raise ValueError(f"special must be 'all' or 'none', not {special!r}") from None


def _load_fast():
    """libdflash._fast, initialised with this library's functions, or None: not built (no
    Python headers or numpy where the package was built), built for another numpy, or
    DFLASH_NO_EXTENSION set. The package's own comes first; then a build folder's, which
    DFLASH_PYEXT names (the binding tests, run from the source tree)."""
    if os.environ.get("DFLASH_NO_EXTENSION"):
        return None
    try:
        mod = importlib.import_module("._fast", __package__)
    except ImportError:
        path = os.environ.get("DFLASH_PYEXT")
        if not path:
            return None
        try:
            spec = importlib.util.spec_from_file_location(f"{__package__}._fast", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        except (ImportError, OSError):
            return None
    mod.init(*(ctypes.cast(getattr(lib, f), ctypes.c_void_p).value for f in (
        "dflash_tokenizer_encode", "dflash_tokenizer_encode_batch", "dflash_last_error")),
        error, _utf8)
    return mod


class Tokenizer(Handle):
    """A loaded tokenizer (immutable; share it across threads freely).

    `path`: a tiktoken rank file, a tokenizer.json, a vocab.json, or a model directory.
    `pattern`: pre-tokenizer name (cl100k, o200k, kimi-k2, qwen2, qwen3.5, gpt2) or a regex;
    None takes the one the files imply.
    """

    _free = "dflash_tokenizer_free"

    def __init__(self, path, pattern=None):
        opts = _Options()
        _options_default(ctypes.byref(opts), ctypes.sizeof(opts))
        opts.pattern = cstr(pattern)
        handle = ctypes.c_void_p()
        _load(cstr(os.fspath(path)), ctypes.byref(opts), ctypes.byref(handle))
        self._tls = threading.local()
        self._h = handle.value

    @property
    def vocab_size(self):
        """Number of token ids (ranks and special tokens)."""
        return int(_vocab_size(self._handle()))

    def __len__(self):
        """The vocabulary size, as len() of a Hugging Face tokenizer."""
        return self.vocab_size

    def hash(self):
        """The tokenizer's identity, "sha256:..." over what decides the ids (vocabulary,
        merges, added tokens, patterns, normalizer), not over its files' bytes: what a
        dataset manifest records as "tokenizer_hash"."""
        buf = ctypes.create_string_buffer(72)
        _hash(self._handle(), buf, 72)
        return buf.value.decode()

    def max_ids(self, n_bytes):
        """Ids that encoding `n_bytes` bytes of text can produce at most."""
        return int(_max_ids(self._handle(), int(n_bytes)))

    def _scratch(self):
        """This thread's output buffer and count cell, as the ctypes objects encode passes,
        kept between calls (a Tokenizer is shared across threads: each has its own)."""
        tls = self._tls
        buf = tls.buf = np.empty(_FAST_IDS, dtype=np.int32)
        tls.buf_p, tls.cap = ctypes.c_void_p(buf.ctypes.data), _c_size(len(buf))
        tls.n = _c_size(0)
        tls.n_p = ctypes.c_void_p(ctypes.addressof(tls.n))
        tls.h_p = ctypes.c_void_p(self._h)
        return tls

    def _encode_fast(self, text, special="all"):
        """Token ids of `text` (str or UTF-8 bytes) as a numpy int32 array."""
        return _fast_encode(self._h or self._handle(), text, special)

    def _encode_ctypes(self, text, special="all"):
        """Token ids of `text` (str or UTF-8 bytes) as a numpy int32 array."""
        if type(text) is str:
            try:
                data = text.encode()
            except UnicodeEncodeError:
                data = _utf8(text)
        else:
            data = _utf8(text)
        mode = 0 if special == "all" else _mode(special)
        if not self._h:
            self._handle()  # raises: closed
        n = len(data)
        if n > _GIL_BYTES:  # long: let other Python threads run meanwhile
            return self._encode_slow(self._h, data, mode)
        tls = self._tls
        try:
            buf = tls.buf
        except AttributeError:
            tls = self._scratch()
            buf = tls.buf
        if _encode_gil(tls.h_p, data, _c_size(n), mode, tls.buf_p, tls.cap, tls.n_p) == 0:
            return buf[:tls.n.value].copy()
        return self._encode_slow(self._h, data, mode)

    encode = _encode_ctypes  # _encode_fast once libdflash._fast loads (end of this file)

    def _encode_slow(self, h, data, mode):
        """encode of a long text (into an array of its own, without the GIL), or of one
        that fails (again, to raise the error)."""
        cap = _ids_bound(len(data))
        while True:
            out = np.empty(cap, dtype=np.int32)
            n = ctypes.c_size_t(0)
            try:
                _encode(h, data, len(data), mode, out.ctypes.data_as(_i32_p), cap, ctypes.byref(n))
                out.resize(n.value, refcheck=False)  # gives back the unused ids' memory
                return out
            except Error as e:
                if e.status != "DFLASH_E_BUFFER":
                    raise
                cap = n.value

    def _encode_batch_fast(self, texts, special="all", n_threads=0):
        """Encode a list of texts on a thread pool; returns a list of int32 arrays."""
        return _fast.encode_batch(self._h or self._handle(), texts, special, int(n_threads))

    def _encode_batch_ctypes(self, texts, special="all", n_threads=0):
        """Encode a list of texts on a thread pool; returns a list of int32 arrays."""
        data = [_utf8(t) for t in texts]
        n = len(data)
        h = self._handle()
        arr = (ctypes.c_char_p * max(n, 1))(*data)
        lens = (ctypes.c_size_t * max(n, 1))(*[len(d) for d in data])
        offsets = np.empty(n + 1, dtype=np.uintp)
        cap = _ids_bound(sum(len(d) for d in data)) + 16 * n
        while True:
            ids = np.empty(cap, dtype=np.int32)
            try:
                _encode_batch(h, arr, lens, n, _mode(special), int(n_threads),
                              ids.ctypes.data_as(_i32_p), cap, offsets.ctypes.data_as(_c_size_p))
                ids.resize(int(offsets[n]), refcheck=False)
                break
            except Error as e:
                if e.status != "DFLASH_E_BUFFER":
                    raise
                cap = int(offsets[n])
        return [ids[offsets[i]:offsets[i + 1]] for i in range(n)]

    encode_batch = _encode_batch_ctypes  # _encode_batch_fast with libdflash._fast

    def decode(self, ids, errors="replace"):
        """The text the ids stand for (specials included), as str. Ids that end inside a
        UTF-8 sequence, or tokens that are not UTF-8 by themselves, decode with `errors`
        ("replace": U+FFFD, as tiktoken and Hugging Face do; "strict" raises
        UnicodeDecodeError). decode_bytes gives the exact bytes."""
        return self.decode_bytes(ids).decode("utf-8", errors)

    def decode_bytes(self, ids):
        """The bytes the ids stand for (specials included). An id that is not a token
        raises IndexRangeError (an IndexError)."""
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        h = self._handle()
        cap = len(ids) * 8 + 16
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = ctypes.c_size_t(0)
            try:
                _decode(h, ids.ctypes.data_as(_i32_p), len(ids), buf, cap, ctypes.byref(n))
                return buf.raw[:n.value]
            except Error as e:
                if e.status != "DFLASH_E_BUFFER":
                    raise
                cap = n.value

    def token_to_id(self, token):
        """Id of the token with these bytes (str is UTF-8 encoded), or None."""
        data = _utf8(token)
        out = ctypes.c_int32()
        try:
            _token_to_id(self._handle(), data, len(data), ctypes.byref(out))
        except Error as e:
            if e.status == "DFLASH_E_NOT_FOUND":
                return None
            raise
        return out.value

    def id_to_token(self, token_id):
        """Bytes of token `token_id`; MissingKeyError (a KeyError) for an unused id,
        IndexRangeError (an IndexError) for one outside the vocabulary."""
        p = ctypes.c_void_p()
        n = ctypes.c_size_t()
        _id_to_token(self._handle(), int(token_id), ctypes.byref(p), ctypes.byref(n), None)
        return ctypes.string_at(p, n.value) if n.value else b""

    def is_special(self, token_id):
        """True when `token_id` is a special (added) token."""
        p = ctypes.c_void_p()
        n = ctypes.c_size_t()
        flag = ctypes.c_int()
        _id_to_token(self._handle(), int(token_id), ctypes.byref(p), ctypes.byref(n),
                     ctypes.byref(flag))
        return bool(flag.value)


_fast = _load_fast()
if _fast is not None:
    _fast_encode = _fast.encode
    Tokenizer.encode = Tokenizer._encode_fast
    Tokenizer.encode_batch = Tokenizer._encode_batch_fast

__all__ = ["Tokenizer"]
