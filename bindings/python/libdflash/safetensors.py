"""safetensors through libdflash: zero-copy numpy views of memory-mapped files,
and the crash-safe streaming writer."""
import ctypes

import numpy as np

from ._lib import INDEX, KEY, Error, Handle, bind, cstr, files

# dtype name -> numpy dtype. bfloat16 and float8 have no numpy type: their raw
# bits come back as uint16 / uint8 (ml_dtypes can .view() them if installed).
DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
}
_NUMPY_TO_NAME = {
    np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
    np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint16): "U16", np.dtype(np.uint32): "U32", np.dtype(np.uint64): "U64",
}


class _Tensor(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("name", ctypes.c_char_p),
                ("dtype", ctypes.c_int32), ("ndim", ctypes.c_uint32),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("data", ctypes.c_void_p),
                ("nbytes", ctypes.c_uint64), ("file", ctypes.c_char_p)]


_P = ctypes.c_void_p
_open = bind("dflash_safetensors_open", [ctypes.c_char_p, ctypes.POINTER(_P)], errors=files(0))
_free = bind("dflash_safetensors_free", [_P], None)
_count = bind("dflash_safetensors_count", [_P], ctypes.c_size_t)
_files = bind("dflash_safetensors_file_count", [_P], ctypes.c_size_t)
_get = bind("dflash_safetensors_get", [_P, ctypes.c_size_t, ctypes.POINTER(_Tensor)], errors=INDEX)
_find = bind("dflash_safetensors_find", [_P, ctypes.c_char_p, ctypes.POINTER(_Tensor)], errors=KEY)
_meta_count = bind("dflash_safetensors_metadata_count", [_P], ctypes.c_size_t)
_meta_get = bind("dflash_safetensors_metadata_get",
                 [_P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)],
                 errors=INDEX)
_meta_find = bind("dflash_safetensors_metadata_find",
                  [_P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)], errors=KEY)
_dtype_name = bind("dflash_dtype_name", [ctypes.c_int], ctypes.c_char_p)
_dtype_size = bind("dflash_dtype_size", [ctypes.c_int], ctypes.c_size_t)
_dtype_from = bind("dflash_dtype_from_name", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)])
_w_create = bind("dflash_safetensors_writer_create", [ctypes.c_char_p, ctypes.POINTER(_P)])
_w_meta = bind("dflash_safetensors_writer_metadata", [_P, ctypes.c_char_p, ctypes.c_char_p])
_w_declare = bind("dflash_safetensors_writer_declare",
                  [_P, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint32, ctypes.POINTER(ctypes.c_int64)])
_w_write = bind("dflash_safetensors_writer_write", [_P, ctypes.c_void_p, ctypes.c_size_t])
_w_finish = bind("dflash_safetensors_writer_commit", [_P])
_w_free = bind("dflash_safetensors_writer_free", [_P], None)
_write_index = bind("dflash_safetensors_write_index",
                    [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p),
                     ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)])


class SafeTensors(Handle):
    """A safetensors file, index or shard directory, memory-mapped.

    `st[name]` is a read-only numpy view of the mapped bytes (no copy); a view keeps
    the files mapped after close() until it is gone. BF16/F8 tensors come back as raw
    uint16/uint8 bits.
    """

    _free = "dflash_safetensors_free"

    def __init__(self, path):
        ptr = _P()
        _open(cstr(path), ctypes.byref(ptr))
        self._own(ptr)

    def close(self):
        """Release the mapping (views taken from it keep it alive until they go)."""
        super().close()

    _ptr = Handle._handle

    def __len__(self):
        return _count(self._ptr())

    @property
    def file_count(self):
        """Number of files in the set (1 for a single file)."""
        return _files(self._ptr())

    def keys(self):
        """Tensor names, sorted."""
        return [self._tensor(index=i).name.decode() for i in range(len(self))]

    def __iter__(self):
        return iter(self.keys())

    def __contains__(self, name):
        return name in self.keys()

    def _tensor(self, index=None, name=None):
        t = _Tensor(struct_size=ctypes.sizeof(_Tensor))
        if name is None:
            _get(self._ptr(), index, ctypes.byref(t))
        else:
            _find(self._ptr(), cstr(name), ctypes.byref(t))
        return t

    def info(self, name):
        """(dtype name, shape, nbytes, file) of one tensor."""
        t = self._tensor(name=name)
        return dtype_name(t.dtype), _shape(t), t.nbytes, t.file.decode()

    def __getitem__(self, name):
        t = self._tensor(name=name)
        dtype = np.dtype(DTYPES[dtype_name(t.dtype)])
        return self._view(t.data if t.nbytes else None, _shape(t), dtype)

    @property
    def metadata(self):
        """All `__metadata__` entries as a dict (the index's "metadata" for a shard set)."""
        out = {}
        k, v = ctypes.c_char_p(), ctypes.c_char_p()
        for i in range(_meta_count(self._ptr())):
            _meta_get(self._ptr(), i, ctypes.byref(k), ctypes.byref(v))
            out[k.value.decode()] = v.value.decode()
        return out

    def get_metadata(self, key, default=None):
        """One `__metadata__` value (the index's "metadata" for a sharded set),
        or `default` when the key is absent."""
        v = ctypes.c_char_p()
        try:
            _meta_find(self._ptr(), cstr(key), ctypes.byref(v))
        except Error as e:
            if e.status != "DFLASH_E_NOT_FOUND":
                raise
            return default
        return v.value.decode()


def _shape(t):
    return tuple(t.shape[d] for d in range(t.ndim))


def dtype_name(code):
    """The safetensors name of a dflash_dtype value ("BF16"); "?N" when unknown."""
    name = _dtype_name(code)
    return name.decode() if name else f"?{code}"


def dtype_code(name):
    """The dflash_dtype value of a safetensors dtype name ("BF16")."""
    code = ctypes.c_int()
    _dtype_from(cstr(name), ctypes.byref(code))
    return code.value


def dtype_size(dtype):
    """Bytes per element of a dtype given by name ("BF16") or dflash_dtype value."""
    return _dtype_size(dtype_code(dtype) if isinstance(dtype, str) else int(dtype))


def write_safetensors(path, tensors, metadata=None, dtypes=None):
    """Write a dict name -> numpy array with libdflash's crash-safe writer.

    `dtypes` maps names to safetensors dtype names for arrays that carry raw
    bits (e.g. {"w": "BF16"} for a uint16 array).
    """
    dtypes = dtypes or {}
    w = _P()
    _w_create(cstr(path), ctypes.byref(w))
    try:
        for k, v in (metadata or {}).items():
            _w_meta(w, k.encode(), v.encode())
        arrays = []
        for name, array in tensors.items():
            a = np.require(array, requirements="C")  # keeps 0-d shapes, unlike ascontiguousarray
            code = ctypes.c_int()
            _dtype_from(dtypes.get(name, _NUMPY_TO_NAME.get(a.dtype, "?")).encode(), ctypes.byref(code))
            shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
            _w_declare(w, name.encode(), code.value, a.ndim, shape)
            arrays.append(a)
        for a in arrays:
            if a.nbytes:
                _w_write(w, a.ctypes.data, a.nbytes)
        _w_finish(w)
    finally:
        _w_free(w)


def write_index(path, shard_files, metadata=None):
    """Write a model.safetensors.index.json for shards (paths relative to it)."""
    files = (ctypes.c_char_p * max(len(shard_files), 1))(*[cstr(s) for s in shard_files])
    meta = metadata or {}
    keys = (ctypes.c_char_p * max(len(meta), 1))(*[k.encode() for k in meta])
    vals = (ctypes.c_char_p * max(len(meta), 1))(*[v.encode() for v in meta.values()])
    _write_index(cstr(path), len(shard_files), files, len(meta), keys, vals)
