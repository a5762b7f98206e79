"""Object storage through libdflash: one API over local paths and s3:// URLs
(SigV4-signed by libcurl, retried, multipart for large objects), a chunked
JSONL writer with deterministic chunk names, and safetensors read on demand."""
import ctypes
import json

import numpy as np

from ._lib import INDEX, KEY, Owner, bind, cstr, files
from .safetensors import DTYPES, _Tensor, _shape, dtype_name

_P = ctypes.c_void_p
_ADDRESSING = {None: 0, "auto": 0, "path": 1, "virtual": 2}


class _Options(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("region", ctypes.c_char_p),
                ("endpoint_url", ctypes.c_char_p), ("access_key_id", ctypes.c_char_p),
                ("secret_access_key", ctypes.c_char_p), ("session_token", ctypes.c_char_p),
                ("addressing", ctypes.c_int32), ("max_attempts", ctypes.c_uint32),
                ("backoff_base_s", ctypes.c_double), ("backoff_max_s", ctypes.c_double),
                ("connect_timeout_s", ctypes.c_double), ("idle_timeout_s", ctypes.c_double),
                ("request_timeout_s", ctypes.c_double), ("part_size", ctypes.c_uint64),
                ("multipart_threshold", ctypes.c_uint64), ("trace", ctypes.c_int32)]


class _Info(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("size", ctypes.c_uint64),
                ("mtime", ctypes.c_int64)]


class _ChunkOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("max_records", ctypes.c_uint64),
                ("max_bytes", ctypes.c_uint64), ("max_seconds", ctypes.c_double),
                ("suffix", ctypes.c_char_p)]


_S = ctypes.c_char_p
_opts_default = bind("dflash_storage_options_init", [ctypes.POINTER(_Options), ctypes.c_size_t], None)
_create = bind("dflash_storage_create", [ctypes.POINTER(_Options), ctypes.POINTER(_P)])
_free = bind("dflash_storage_free", [_P], None)
_buf_free = bind("dflash_storage_buffer_free", [_P], None)
_read = bind("dflash_storage_read", [_P, _S, ctypes.POINTER(_P), ctypes.POINTER(ctypes.c_size_t)],
             errors=files(1))
_read_range = bind("dflash_storage_read_range",
                   [_P, _S, ctypes.c_uint64, _P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
                   errors=files(1))
_stat = bind("dflash_storage_stat", [_P, _S, ctypes.POINTER(_Info)], errors=files(1))
_write = bind("dflash_storage_write", [_P, _S, _P, ctypes.c_size_t])
_delete = bind("dflash_storage_delete", [_P, _S], errors=files(1))
_copy = bind("dflash_storage_copy", [_P, _S, _S], errors=files(1))
_list = bind("dflash_storage_list", [_P, _S, ctypes.POINTER(_P)], errors=files(1))
_l_count = bind("dflash_storage_listing_count", [_P], ctypes.c_size_t)
_l_get = bind("dflash_storage_listing_get",
              [_P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_uint64)],
              errors=INDEX)
_l_free = bind("dflash_storage_listing_free", [_P], None)
_w_open = bind("dflash_storage_writer_open", [_P, _S, ctypes.POINTER(_P)])
_w_write = bind("dflash_storage_writer_write", [_P, _P, ctypes.c_size_t])
_w_commit = bind("dflash_storage_writer_commit", [_P])
_w_free = bind("dflash_storage_writer_free", [_P], None)
_c_default = bind("dflash_chunk_writer_options_init", [ctypes.POINTER(_ChunkOptions), ctypes.c_size_t], None)
_c_open = bind("dflash_chunk_writer_open",
               [_P, _S, _S, ctypes.POINTER(_ChunkOptions), ctypes.POINTER(_P)])
_c_append = bind("dflash_chunk_writer_add", [_P, _S, ctypes.c_size_t])
_c_poll = bind("dflash_chunk_writer_poll", [_P])
_c_flush = bind("dflash_chunk_writer_flush", [_P])
_c_next = bind("dflash_chunk_writer_next_seq", [_P], ctypes.c_uint64)
_c_last = bind("dflash_chunk_writer_last_chunk", [_P], ctypes.c_char_p)
_c_close = bind("dflash_chunk_writer_commit", [_P])
_c_free = bind("dflash_chunk_writer_free", [_P], None)
_st_open = bind("dflash_storage_safetensors_open", [_P, _S, ctypes.c_uint64, ctypes.POINTER(_P)],
                errors=files(1))
_st_free = bind("dflash_storage_safetensors_free", [_P], None)
_st_count = bind("dflash_storage_safetensors_count", [_P], ctypes.c_size_t)
_st_get = bind("dflash_storage_safetensors_get", [_P, ctypes.c_size_t, ctypes.POINTER(_Tensor)],
               errors=INDEX)
_st_find = bind("dflash_storage_safetensors_find", [_P, _S, ctypes.POINTER(_Tensor)], errors=KEY)
_st_meta = bind("dflash_storage_safetensors_metadata_find", [_P, _S, ctypes.POINTER(ctypes.c_char_p)],
                errors=KEY)
_st_read = bind("dflash_storage_safetensors_read",
                [_P, _S, _P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)], errors=KEY)
_is_remote = bind("dflash_storage_is_remote", [_S], ctypes.c_uint)  # a flag, not a status


def is_remote(location):
    """Whether `location` is an s3:// URL."""
    return bool(_is_remote(cstr(location)))


class _Owned:
    """A library handle released by `free` when closed or collected. An object made
    from a Storage borrows its client: it keeps the client's C object alive (its Owner)
    until it is freed itself, so closing a Storage first only stops its own use."""

    def __init__(self, ptr, free, parent=None):
        self._owner = Owner(ptr, free, parent._owner if parent is not None else None)
        self.ptr = ptr

    def close(self):
        self.ptr, self._owner = None, None  # frees, after every object borrowing it

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _p(self):
        if not self.ptr:
            raise ValueError(f"{type(self).__name__} is closed")
        return self.ptr


class Storage(_Owned):
    """A storage client (one per thread). Every keyword is optional; unset ones
    come from AWS_* / DFLASH_S3_* environment variables (see storage.h).

    addressing: "path" or "virtual"; the *_s (seconds), part_size,
    multipart_threshold, max_attempts and trace keywords match dflash_storage_options. Writers and
    RemoteSafeTensors made from it borrow its client: they keep it alive past close()."""

    def __init__(self, region=None, endpoint_url=None, access_key_id=None,
                 secret_access_key=None, session_token=None, addressing=None, **numbers):
        o = _Options()
        _opts_default(ctypes.byref(o), ctypes.sizeof(o))
        o.region, o.endpoint_url = cstr(region), cstr(endpoint_url)
        o.access_key_id, o.secret_access_key = cstr(access_key_id), cstr(secret_access_key)
        o.session_token = cstr(session_token)
        o.addressing = _ADDRESSING[addressing]
        fields = dict(_Options._fields_)
        for name, value in numbers.items():
            if name not in fields or name in ("struct_size", "addressing"):
                raise TypeError(f"unknown storage option {name!r}")
            setattr(o, name, float(value) if fields[name] is ctypes.c_double else int(value))
        ptr = _P()
        _create(ctypes.byref(o), ctypes.byref(ptr))
        super().__init__(ptr, _free)

    def read(self, location):
        """The whole object as bytes."""
        data, n = _P(), ctypes.c_size_t()
        _read(self._p(), cstr(location), ctypes.byref(data), ctypes.byref(n))
        try:
            return ctypes.string_at(data, n.value) if n.value else b""
        finally:
            _buf_free(data)

    def read_range(self, location, offset, length):
        """Up to `length` bytes at `offset` (fewer at the end of the object)."""
        buf = ctypes.create_string_buffer(max(length, 1))
        got = ctypes.c_size_t()
        _read_range(self._p(), cstr(location), offset, buf, length, ctypes.byref(got))
        return buf.raw[:got.value]

    def stat(self, location):
        """(size, mtime); raises Error (DFLASH_E_NOT_FOUND) when absent."""
        info = _Info(struct_size=ctypes.sizeof(_Info))
        _stat(self._p(), cstr(location), ctypes.byref(info))
        return info.size, info.mtime

    def exists(self, location):
        """True when the object or file exists."""
        from ._lib import Error
        try:
            self.stat(location)
            return True
        except Error as e:
            if e.status == "DFLASH_E_NOT_FOUND":
                return False
            raise

    def write(self, location, data):
        """Write bytes atomically (multipart when large)."""
        data = bytes(data)
        _write(self._p(), cstr(location), data, len(data))

    def delete(self, location):
        """Remove an object or file (removing something absent succeeds, as S3 does)."""
        _delete(self._p(), cstr(location))

    def copy(self, src, dst):
        """Copy between any two locations (local or s3://)."""
        _copy(self._p(), cstr(src), cstr(dst))

    def list(self, prefix):
        """[(location, size)] of every object whose location starts with prefix, sorted."""
        lst = _P()
        _list(self._p(), cstr(prefix), ctypes.byref(lst))
        try:
            loc, size, out = ctypes.c_char_p(), ctypes.c_uint64(), []
            for i in range(_l_count(lst)):
                _l_get(lst, i, ctypes.byref(loc), ctypes.byref(size))
                out.append((loc.value.decode("utf-8", "surrogateescape"), size.value))
            return out
        finally:
            _l_free(lst)

    def open_writer(self, location):
        """A streaming Writer; `with` commits on success and aborts on an exception."""
        return Writer(self, location)

    def chunk_writer(self, prefix, name, max_records=None, max_bytes=None, max_seconds=None,
                     suffix=None):
        """A ChunkWriter of JSONL records into <prefix><name>-<seq>.jsonl chunks."""
        return ChunkWriter(self, prefix, name, max_records, max_bytes, max_seconds, suffix)

    def open_safetensors(self, location, readahead=0):
        """A RemoteSafeTensors reading tensors on demand with ranged reads."""
        return RemoteSafeTensors(self, location, readahead)


class Writer(_Owned):
    """A streaming object writer: write() parts, commit() publishes the object."""

    def __init__(self, storage, location):
        ptr = _P()
        _w_open(storage._p(), cstr(location), ctypes.byref(ptr))
        super().__init__(ptr, _w_free, storage)

    def write(self, data):
        """Append bytes to the object being written."""
        data = bytes(data)
        _w_write(self._p(), data, len(data))

    def commit(self):
        """Finish the upload; the object appears whole or not at all."""
        _w_commit(self._p())

    def __exit__(self, exc_type, *exc):
        try:
            if exc_type is None:
                self.commit()
        finally:
            self.close()


class ChunkWriter(_Owned):
    """Appends JSONL records (str, bytes, or any JSON-serialisable object) into
    immutable chunk objects <prefix><name>-<seq>.jsonl."""

    def __init__(self, storage, prefix, name, max_records, max_bytes, max_seconds, suffix):
        o = _ChunkOptions()
        _c_default(ctypes.byref(o), ctypes.sizeof(o))
        if max_records is not None:
            o.max_records = max_records
        if max_bytes is not None:
            o.max_bytes = max_bytes
        if max_seconds is not None:
            o.max_seconds = max_seconds
        self._suffix = cstr(suffix)  # kept alive: the library reads it at open only
        if suffix is not None:
            o.suffix = self._suffix
        ptr = _P()
        _c_open(storage._p(), cstr(prefix), cstr(name), ctypes.byref(o), ctypes.byref(ptr))
        super().__init__(ptr, _c_free, storage)

    def append(self, record):
        """Append one record (a line of JSONL); chunks close on the configured limits."""
        if not isinstance(record, (str, bytes)):
            record = json.dumps(record, ensure_ascii=False)
        if isinstance(record, str):
            record = record.encode()
        _c_append(self._p(), record, len(record))

    def poll(self):
        """Close the open chunk when its time limit has passed."""
        _c_poll(self._p())

    def flush(self):
        """Close and upload the open chunk now (nothing when it is empty)."""
        _c_flush(self._p())

    @property
    def next_seq(self):
        """Sequence number the next chunk will get."""
        return _c_next(self._p())

    @property
    def last_chunk(self):
        """Location of the last committed chunk ("" before the first)."""
        return _c_last(self._p()).decode()

    def close(self):
        """Flush the open chunk, then free (raises if that last upload fails).
        Dropped without close(), the writer is freed and buffered records are not
        written."""
        owner, self.ptr, self._owner = getattr(self, "_owner", None), None, None
        ptr = owner.detach() if owner is not None else None
        if ptr:
            try:
                _c_close(ptr)  # while `owner` still holds the storage client
            finally:
                _c_free(ptr)

    def __del__(self):
        self.ptr, self._owner = None, None


class RemoteSafeTensors(_Owned):
    """A safetensors object read on demand: `f[name]` fetches one tensor (a
    numpy copy) with a ranged read through the read-ahead window."""

    def __init__(self, storage, location, readahead=0):
        ptr = _P()
        _st_open(storage._p(), cstr(location), readahead, ctypes.byref(ptr))
        super().__init__(ptr, _st_free, storage)

    def __len__(self):
        return _st_count(self._p())

    def keys(self):
        """Tensor names, sorted."""
        t = _Tensor(struct_size=ctypes.sizeof(_Tensor))
        out = []
        for i in range(len(self)):
            _st_get(self._p(), i, ctypes.byref(t))
            out.append(t.name.decode())
        return out

    def info(self, name):
        """(dtype name, shape, nbytes)."""
        t = _Tensor(struct_size=ctypes.sizeof(_Tensor))
        _st_find(self._p(), cstr(name), ctypes.byref(t))
        return dtype_name(t.dtype), _shape(t), t.nbytes

    def metadata(self, key):
        """One `__metadata__` value; MissingKeyError (a KeyError, DFLASH_E_NOT_FOUND)
        when absent."""
        v = ctypes.c_char_p()
        _st_meta(self._p(), cstr(key), ctypes.byref(v))
        return v.value.decode()

    def __getitem__(self, name):
        dtype, shape, nbytes = self.info(name)
        out = np.empty(shape, DTYPES[dtype])
        _st_read(self._p(), cstr(name), out.ctypes.data if nbytes else None, nbytes, None)
        return out
