"""Tokenized datasets written by `dflash tokenize` (see dflash/dataset.h)."""
import ctypes

import numpy as np

from ._lib import Handle, bind, cstr, lib

_vp = ctypes.c_void_p
_open = bind("dflash_dataset_open", [ctypes.c_char_p, ctypes.POINTER(_vp)])
bind("dflash_dataset_free", [_vp], None)
bind("dflash_dataset_count", [_vp], ctypes.c_size_t)
bind("dflash_dataset_tokens", [_vp], ctypes.c_uint64)
_sample = bind("dflash_dataset_sample", [_vp, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.POINTER(ctypes.c_size_t),
                                         ctypes.POINTER(ctypes.c_char_p)])
_hist = bind("dflash_dataset_length_histogram", [_vp, ctypes.c_size_t, ctypes.c_size_t,
                                                 ctypes.POINTER(ctypes.c_uint64)])


_hash = bind("dflash_dataset_tokenizer_hash", [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t])
TOKENIZER_HASH_LEN = 72


def tokenizer_hash(path):
    """The manifest's "tokenizer_hash" of a tokenizer file or directory ("sha256:...")."""
    buf = ctypes.create_string_buffer(TOKENIZER_HASH_LEN)
    _hash(cstr(path), buf, TOKENIZER_HASH_LEN)
    return buf.value.decode()


class Dataset(Handle):
    """A dataset directory: len(ds), ds[i] -> (sample_id, input_ids int32, loss_mask uint8)
    as zero-copy numpy views of the mapped shards (valid while the Dataset is open)."""

    _free = "dflash_dataset_free"

    def __init__(self, path):
        h = _vp()
        _open(cstr(path), ctypes.byref(h))
        self._h = h

    def __len__(self):
        return lib.dflash_dataset_count(self._h)

    @property
    def tokens(self):
        return lib.dflash_dataset_tokens(self._h)

    def __getitem__(self, i):
        if i < 0:
            i += len(self)
        ids, mask, n, sid = _vp(), _vp(), ctypes.c_size_t(), ctypes.c_char_p()
        _sample(self._h, i, ctypes.byref(ids), ctypes.byref(mask), ctypes.byref(n),
                ctypes.byref(sid))
        a = np.ctypeslib.as_array(ctypes.cast(ids, ctypes.POINTER(ctypes.c_int32)), (n.value,))
        m = np.ctypeslib.as_array(ctypes.cast(mask, ctypes.POINTER(ctypes.c_uint8)), (n.value,))
        a.flags.writeable = m.flags.writeable = False
        return sid.value.decode(), a, m

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def length_histogram(self, bin_width=256, n_bins=64):
        out = np.zeros(n_bins, dtype=np.uint64)
        _hist(self._h, bin_width, n_bins, out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)))
        return out


