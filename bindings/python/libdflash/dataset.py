"""Tokenized datasets: build_dataset (what `dflash tokenize` runs), Dataset, DatasetWriter
(see dflash/dataset.h)."""
import ctypes
import json
import operator
import os

import numpy as np

from ._lib import (INDEX, Error, Handle, IndexRangeError, MissingFileError, MissingKeyError,
                   bind, cstr, files, lib, status_code)
from .chat import reasoning_mode

_vp = ctypes.c_void_p
_open = bind("dflash_dataset_open", [ctypes.c_char_p, ctypes.POINTER(_vp)], errors=files(0))
bind("dflash_dataset_free", [_vp], None)
bind("dflash_dataset_count", [_vp], ctypes.c_size_t)
bind("dflash_dataset_tokens", [_vp], ctypes.c_uint64)
_sample = bind("dflash_dataset_sample", [_vp, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.POINTER(ctypes.c_size_t),
                                         ctypes.POINTER(ctypes.c_char_p)], errors=INDEX)
_hist = bind("dflash_dataset_length_histogram", [_vp, ctypes.c_size_t, ctypes.c_size_t,
                                                 ctypes.POINTER(ctypes.c_uint64)])
_counts = bind("dflash_dataset_token_counts", [_vp, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64),
                                              ctypes.POINTER(ctypes.c_int64)])


_hash = bind("dflash_dataset_tokenizer_hash", [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t],
             errors=files(0))
TOKENIZER_HASH_LEN = 72


_matches = bind("dflash_dataset_tokenizer_matches", [ctypes.c_char_p, ctypes.c_char_p],
                errors=files(0))


def tokenizer_hash(path):
    """The manifest's "tokenizer_hash" of a tokenizer file or directory ("sha256:..."): the
    loaded tokenizer's identity (Tokenizer.hash), not its files' bytes."""
    buf = ctypes.create_string_buffer(TOKENIZER_HASH_LEN)
    _hash(cstr(path), buf, TOKENIZER_HASH_LEN)
    return buf.value.decode()


def tokenizer_matches(path, recorded):
    """Whether the manifest hash `recorded` names the tokenizer at `path`: its identity, or
    the hash of its files' bytes that older manifests hold. Raises the library's mismatch
    error (naming both hashes) when it does not; returns True otherwise."""
    _matches(cstr(path), cstr(recorded))
    return True


class Dataset(Handle):
    """A dataset directory, read through memory-mapped shards. A sample is a tuple
    (sample_id, input_ids int32, loss_mask uint8) whose arrays are read-only zero-copy
    views: a view keeps the shards mapped after close() until it is gone; the closed
    Dataset itself raises ValueError.

    len(ds) samples; ds[i] (negative i from the end; IndexError past either end);
    ds[2:5] (any slice) a list of samples; ds["sample-id"] or ds.by_id("sample-id")
    the sample of that id (KeyError when absent); "sample-id" in ds; iteration in
    order; repr shows the path, samples and tokens."""

    _free = "dflash_dataset_free"

    def __init__(self, path):
        h = _vp()
        _open(cstr(path), ctypes.byref(h))
        self._own(h)
        self.path = os.fsdecode(path)
        self._ids = None  # sample id -> index, built on the first lookup by id

    def __repr__(self):
        if not self._h:
            return f"<libdflash.Dataset {self.path!r} (closed)>"
        return f"<libdflash.Dataset {self.path!r}: {len(self)} samples, {self.tokens} tokens>"

    def __len__(self):
        return lib.dflash_dataset_count(self._handle())

    @property
    def tokens(self):
        """Total tokens over all samples."""
        return lib.dflash_dataset_tokens(self._handle())

    def __getitem__(self, key):
        if isinstance(key, slice):
            return [self._sample(i) for i in range(*key.indices(len(self)))]
        if isinstance(key, (str, bytes)):
            return self.by_id(key)
        try:
            i = operator.index(key)
        except TypeError:
            raise TypeError(f"Dataset indices are integers, slices or sample ids (str), not "
                            f"{type(key).__name__}") from None
        n = len(self)
        if i < -n or i >= n:
            raise IndexRangeError(status_code("DFLASH_E_RANGE"),
                                  f"sample index {i} is outside the {n} samples of {self.path}")
        return self._sample(i + n if i < 0 else i)

    def _sample(self, i):
        ids, mask, n, sid = _vp(), _vp(), ctypes.c_size_t(), ctypes.c_char_p()
        _sample(self._handle(), i, ctypes.byref(ids), ctypes.byref(mask), ctypes.byref(n),
                ctypes.byref(sid))
        return (sid.value.decode(), self._view(ids.value, (n.value,), np.int32),
                self._view(mask.value, (n.value,), np.uint8))

    def index_of(self, sample_id):
        """Position of the sample with this id; MissingKeyError (a KeyError) when absent."""
        if isinstance(sample_id, bytes):
            sample_id = sample_id.decode()
        if self._ids is None:
            h, sid = self._handle(), ctypes.c_char_p()
            ids = {}
            for i in range(len(self)):
                _sample(h, i, None, None, None, ctypes.byref(sid))
                ids.setdefault(sid.value.decode(), i)
            self._ids = ids
        try:
            return self._ids[sample_id]
        except KeyError:
            raise MissingKeyError(status_code("DFLASH_E_NOT_FOUND"),
                                  f"{self.path}: no sample has id {sample_id!r}") from None

    def by_id(self, sample_id):
        """The sample (sample_id, input_ids, loss_mask) with this id; MissingKeyError
        (a KeyError) when absent. The first lookup reads every id once."""
        return self._sample(self.index_of(sample_id))

    def __contains__(self, sample_id):
        if not isinstance(sample_id, (str, bytes)):
            return False
        try:
            self.index_of(sample_id)
        except KeyError:
            return False
        return True

    def __iter__(self):
        for i in range(len(self)):
            yield self._sample(i)

    def token_counts(self, vocab_size):
        """int64 [vocab_size]: how often each token id is supervised (loss_mask 1)."""
        out = np.zeros(int(vocab_size), dtype=np.int64)
        _counts(self._handle(), int(vocab_size), out.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
                None)
        return out

    def length_histogram(self, bin_width=256, n_bins=64):
        """uint64 counts of sample lengths in bins of `bin_width` tokens; the last bin takes
        longer ones."""
        out = np.zeros(n_bins, dtype=np.uint64)
        _hist(self._handle(), bin_width, n_bins,
              out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)))
        return out


class _WriterOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("shard_tokens", ctypes.c_uint64),
                ("tokenizer_hash", ctypes.c_char_p), ("template_name", ctypes.c_char_p),
                ("options_json", ctypes.c_char_p)]


_w_defaults = bind("dflash_dataset_writer_options_init",
                   [ctypes.POINTER(_WriterOptions), ctypes.c_size_t], None)
_w_create = bind("dflash_dataset_writer_create", [ctypes.c_char_p, ctypes.POINTER(_WriterOptions),
                                                  ctypes.POINTER(_vp)])
_w_add = bind("dflash_dataset_writer_add", [_vp, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int32),
                                            ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t])
_w_finish = bind("dflash_dataset_writer_commit", [_vp])
bind("dflash_dataset_writer_free", [_vp], None)


class DatasetWriter(Handle):
    """Writes a dataset directory in the format `dflash tokenize` produces.

    shard_tokens: start a new shard past this many tokens (None: the library's
    default, 2^26); tokenizer_hash, template and options (a dict) are recorded
    in dataset.json. add() appends a sample; leaving a `with` block normally
    (or finish()) writes the last shard and the manifest; leaving it by an
    exception writes no manifest, so the directory reads as unfinished.
    """

    _free = "dflash_dataset_writer_free"

    def __init__(self, directory, shard_tokens=None, tokenizer_hash=None, template=None,
                 options=None):
        o = _WriterOptions()
        _w_defaults(ctypes.byref(o), ctypes.sizeof(o))
        if shard_tokens is not None:
            o.shard_tokens = int(shard_tokens)
        o.tokenizer_hash = cstr(tokenizer_hash)
        o.template_name = cstr(template)
        o.options_json = None if options is None else json.dumps(options).encode()
        h = _vp()
        _w_create(cstr(directory), ctypes.byref(o), ctypes.byref(h))
        self._h = h

    def add(self, sample_id, input_ids, loss_mask):
        """Append one sample: int32 token ids and a uint8 mask of the same length."""
        ids = np.ascontiguousarray(input_ids, dtype=np.int32)
        mask = np.ascontiguousarray(loss_mask, dtype=np.uint8)
        if ids.ndim != 1 or mask.shape != ids.shape:
            raise ValueError(f"input_ids {ids.shape} and loss_mask {mask.shape} must be equal 1-D")
        _w_add(self._writer(), str(sample_id).encode(),
               ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
               mask.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), ids.size)

    def _writer(self):
        if not self._h:
            raise ValueError("DatasetWriter is closed")
        return self._h

    def finish(self):
        """Write the last shard and dataset.json, and release the writer."""
        try:
            _w_finish(self._writer())
        finally:
            self.close()

    def __exit__(self, exc_type, *rest):
        if exc_type is None and self._h:
            self.finish()
        else:
            self.close()


VERDICTS = ["ok", "unreadable", "empty", "rejects", "too_long"]  # dflash_dataset_build_verdict


class BuildStats(ctypes.Structure):
    """Counters of a dataset build (see dflash_dataset_build_stats)."""
    _fields_ = ([("struct_size", ctypes.c_size_t)] +
                [(name, ctypes.c_uint64) for name in (
                    "lines", "samples", "tokens", "supervised_tokens", "rejected", "too_long",
                    "unreadable")] +
                [("verdict", ctypes.c_int32), ("unfinished", ctypes.c_uint64)])

    def as_dict(self):
        out = {name: getattr(self, name) for name, _ in self._fields_[1:]}
        out["verdict"] = VERDICTS[self.verdict]
        return out


_BUILD_PROGRESS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(BuildStats), ctypes.c_void_p)


class _BuildOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("tokenizer_path", ctypes.c_char_p),
                ("template_name", ctypes.c_char_p), ("reasoning", ctypes.c_int32),
                ("last_turn_only", ctypes.c_int32), ("max_len", ctypes.c_uint64),
                ("truncate", ctypes.c_int32), ("allow_split_control_tokens", ctypes.c_int32),
                ("threads", ctypes.c_int32), ("batch_lines", ctypes.c_uint64),
                ("max_reject_ratio", ctypes.c_double), ("shard_tokens", ctypes.c_uint64),
                ("progress", _BUILD_PROGRESS), ("progress_user", ctypes.c_void_p),
                ("keep_unfinished", ctypes.c_int32), ("overwrite", ctypes.c_int32),
                ("no_thinking", ctypes.c_int32)]


_b_init = bind("dflash_dataset_build_options_init", [ctypes.POINTER(_BuildOptions),
                                                     ctypes.c_size_t], None)


def _missing_file(args):
    """MissingFileError when an input or the tokenizer is a local path that does not exist
    (else the status's own class: an unknown template is NOT_FOUND too)."""
    paths = list(args[0][:args[1]]) + [args[3]._obj.tokenizer_path]
    for p in paths:
        path = os.fsdecode(p or b"")
        if path and "://" not in path and not os.path.exists(path):
            return MissingFileError
    return None


_build = bind("dflash_dataset_build", [ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t,
                                       ctypes.c_char_p, ctypes.POINTER(_BuildOptions),
                                       ctypes.POINTER(BuildStats)],
              errors={"DFLASH_E_NOT_FOUND": _missing_file, "DFLASH_E_IO": _missing_file})


def _build_options(tokenizer, template, reasoning, last_turn_only, max_len, truncate,
                   allow_split_control_tokens, threads, batch_lines, max_reject_ratio,
                   shard_tokens, keep_unfinished=False, overwrite=False, no_thinking=False):
    o = _BuildOptions()
    _b_init(ctypes.byref(o), ctypes.sizeof(o))
    o.tokenizer_path = cstr(tokenizer)
    o.template_name = cstr(template)
    o.reasoning = reasoning_mode(reasoning)
    o.last_turn_only = int(bool(last_turn_only))
    o.max_len = int(max_len or 0)
    o.truncate = int(bool(truncate))
    o.allow_split_control_tokens = int(bool(allow_split_control_tokens))
    o.threads = int(threads)
    if batch_lines is not None:
        o.batch_lines = int(batch_lines)
    if max_reject_ratio is not None:
        o.max_reject_ratio = float(max_reject_ratio)
    o.shard_tokens = int(shard_tokens or 0)
    o.keep_unfinished = int(bool(keep_unfinished))
    o.overwrite = int(bool(overwrite))
    o.no_thinking = int(bool(no_thinking))
    return o


def build_dataset(inputs, out_dir, tokenizer, template, reasoning="keep_after_last_user",
                  last_turn_only=False, max_len=0, truncate=False,
                  allow_split_control_tokens=False, threads=0, batch_lines=None,
                  max_reject_ratio=None, shard_tokens=None, progress=None,
                  keep_unfinished=False, overwrite=False, no_thinking=False):
    """Tokenize JSONL conversations into the dataset directory `out_dir`: what
    `dflash tokenize` does, the same bytes for the same options (dflash_dataset_build).

    inputs: a path or a list of them (s3:// locations too; an s3:// prefix ending in
    '/' means every *.jsonl under it). tokenizer: what Tokenizer() takes; template: a
    built-in template name; reasoning: a mode name (see chat.REASONING). keep_unfinished:
    keep fetch records the target did not finish (outcome length or empty) with no closing
    token supervised, instead of rejecting them (`tokenize --keep-unfinished`). overwrite:
    replace a dataset already in out_dir (`tokenize --overwrite`). no_thinking: answers
    written with thinking off (`tokenize --no-thinking`). batch_lines
    and max_reject_ratio: None keeps the library's defaults (2048, 0.05).
    progress: optional callable(stats: dict) -> bool, called once the outputs exist
    and after every batch; True stops the build (CancelledError, no manifest), and so
    does an exception it raises (KeyboardInterrupt included), raised again here. Returns the stats dict. When the finished dataset is refused
    (unreadable inputs, no sample, too many rejections) the library's error is raised
    with the stats as its `stats` attribute, and out_dir keeps rejected.jsonl only. A fetch
    output's settings.json beside an input decides thinking (see `dflash tokenize --help`)."""
    if isinstance(inputs, (str, bytes, os.PathLike)):
        inputs = [inputs]
    enc = [cstr(p) for p in inputs]
    arr = (ctypes.c_char_p * max(len(enc), 1))(*enc)
    o = _build_options(tokenizer, template, reasoning, last_turn_only, max_len, truncate,
                       allow_split_control_tokens, threads, batch_lines, max_reject_ratio,
                       shard_tokens, keep_unfinished, overwrite, no_thinking)
    raised = []

    def on_progress(stats, _user):
        try:
            return 1 if progress(stats.contents.as_dict()) else 0
        except BaseException as exc:  # noqa: B036 - stops the build, raised again below
            raised.append(exc)
            return 1

    o.progress = _BUILD_PROGRESS(on_progress) if progress else _BUILD_PROGRESS()
    stats = BuildStats(struct_size=ctypes.sizeof(BuildStats))
    try:
        _build(arr, len(enc), cstr(out_dir), ctypes.byref(o), ctypes.byref(stats))
    except Error as e:
        if raised:
            raise raised[0] from e
        e.stats = stats.as_dict()
        raise
    return stats.as_dict()
