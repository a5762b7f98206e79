"""Offline target hidden states through libdflash.

Dumping from Hugging Face transformers (layer id k = hidden_states[k + 1],
the OUTPUT of decoder layer k; hidden_states[0] is the embedding):

    import torch, dflash
    layer_ids = [1, 9, 17, 25, 33]          # dflash_config.target_layer_ids
    with libdflash.HiddenWriter("hidden/", num_layers=len(layer_ids),
                             hidden_size=model.config.hidden_size, dtype="bf16") as w:
        for sample_id, input_ids in dataset:   # the tokenized dataset's ids and tokens
            with torch.no_grad():
                out = model(torch.tensor([input_ids]), output_hidden_states=True)
            states = torch.cat([out.hidden_states[k + 1][0] for k in layer_ids], dim=-1)
            w.append(sample_id, states)        # [S, K*H]; bf16 tensors are kept bit-exact

transformers applies the model's final norm to the LAST entry of hidden_states:
the layer ids must not include the last layer, and a stack cut after the
last layer you need (to save time) must get an identity final norm, or that
layer is stored normalised while inference feeds the drafter the raw output.

Dumping from SGLang (in process, the way SpecForge's offline preparation
script does it): load the target with `sglang.bench_one_batch.load_model`,
call `model_runner.model.set_eagle3_layers_to_capture([k + 1 for k in
layer_ids])` (SGLang captures the INPUT of the listed layers, i.e. the
output of layer k when given k + 1; check this against your SGLang version
by comparing one sample with the transformers recipe above), run a prefill
`ScheduleBatch` with `CaptureHiddenMode.FULL`, and append
`logits_output.hidden_states` (the captured layers, concatenated, [S, K*H])
per request. The rows must align with the dataset's input_ids (same tokens,
same length); the stream reports every sample whose lengths differ.
"""
import atexit
import ctypes
import os
import warnings
import weakref

import numpy as np

from ._lib import INDEX, KEY, Handle, bind, cstr, files
from .dataset import DatasetWriter

_P = ctypes.c_void_p


class WriterOptions(ctypes.Structure):
    """Mirror of `dflash_hidden_writer_options`."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("dtype", ctypes.c_int32),
                ("shard_bytes", ctypes.c_uint64), ("spool_budget", ctypes.c_uint64),
                ("spool_wait_s", ctypes.c_double),
                ("target_layer_ids", ctypes.POINTER(ctypes.c_int32)),
                ("tokenizer_hash", ctypes.c_char_p), ("final_state", ctypes.c_int32)]


class SpoolOptions(ctypes.Structure):
    """Mirror of `dflash_spool_options`."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("wait_s", ctypes.c_double),
                ("reuse", ctypes.c_int32), ("stored_rows", ctypes.c_int32)]


class Sample(ctypes.Structure):
    """Mirror of `dflash_sample` (pointers borrowed from the stream or spool that gave it; the
    anchors are the caller's input to a trainer call, which streams and spools leave empty)."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("index", ctypes.c_uint64),
                ("id", ctypes.c_char_p), ("len", ctypes.c_int64),
                ("input_ids", ctypes.POINTER(ctypes.c_int32)),
                ("loss_mask", ctypes.POINTER(ctypes.c_uint8)),
                ("hidden", ctypes.POINTER(ctypes.c_float)),
                ("target_ids", ctypes.POINTER(ctypes.c_int32)), ("hidden_dtype", ctypes.c_int32),
                ("hidden_codes", ctypes.c_void_p),
                ("hidden_scales", ctypes.POINTER(ctypes.c_float)),
                ("epoch", ctypes.c_int32), ("shard", ctypes.c_uint64),
                ("offset", ctypes.c_uint64), ("anchors", ctypes.POINTER(ctypes.c_int32)),
                ("n_anchors", ctypes.c_int32),
                ("target_final", ctypes.POINTER(ctypes.c_float))]


class _HiddenInfo(ctypes.Structure):
    """Mirror of `dflash_hidden_info` (what dflash_hidden_get_info fills)."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("num_layers", ctypes.c_int32),
                ("hidden_size", ctypes.c_int32), ("dtype", ctypes.c_int32),
                ("count", ctypes.c_uint64), ("final_state", ctypes.c_int32)]


class _SpoolInfo(ctypes.Structure):
    """Mirror of `dflash_spool_info` (what dflash_spool_get_info fills)."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("num_layers", ctypes.c_int32),
                ("hidden_size", ctypes.c_int32), ("dtype", ctypes.c_int32),
                ("final_state", ctypes.c_int32)]


class _SpoolStatus(ctypes.Structure):
    """Mirror of `dflash_hidden_writer_spool_status`."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("epoch", ctypes.c_int32),
                ("samples", ctypes.c_uint64), ("spool_bytes", ctypes.c_uint64),
                ("high_water", ctypes.c_uint64)]


class StreamOptions(ctypes.Structure):
    """Mirror of `dflash_sample_stream_options`."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("prefetch", ctypes.c_int32),
                ("stored_rows", ctypes.c_int32)]


_w_defaults = bind("dflash_hidden_writer_options_init",
                   [ctypes.POINTER(WriterOptions), ctypes.c_size_t], None)
_w_create = bind("dflash_hidden_writer_create", [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32,
                                                 ctypes.POINTER(WriterOptions), ctypes.POINTER(_P)])
_DTYPE_F32, _DTYPE_BF16 = 1, 3  # dflash_dtype (safetensors.h)


class Rows(ctypes.Structure):
    """dflash_hidden_rows: one sample's rows for dflash_hidden_writer_add."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("dtype", ctypes.c_int32),
                ("len", ctypes.c_int64), ("states", ctypes.c_void_p),
                ("target_ids", ctypes.c_void_p), ("final_state", ctypes.c_void_p)]


_rows_init = bind("dflash_hidden_rows_init", [ctypes.POINTER(Rows), ctypes.c_size_t], None)
_w_add = bind("dflash_hidden_writer_add", [_P, ctypes.c_char_p, ctypes.POINTER(Rows)])
_w_flush = bind("dflash_hidden_writer_flush", [_P])
_w_finish = bind("dflash_hidden_writer_commit", [_P])
_w_free = bind("dflash_hidden_writer_free", [_P], None)
_w_end_epoch = bind("dflash_hidden_writer_end_epoch", [_P])
_w_contains = bind("dflash_hidden_writer_contains", [_P, ctypes.c_char_p], ctypes.c_int32,
                   status=False)
_w_spool_status = bind("dflash_hidden_writer_get_spool_status",
                       [_P, ctypes.POINTER(_SpoolStatus)])
_sp_defaults = bind("dflash_spool_options_init", [ctypes.POINTER(SpoolOptions), ctypes.c_size_t],
                    None)
_sp_open = bind("dflash_spool_open", [ctypes.c_char_p, ctypes.POINTER(SpoolOptions),
                                      ctypes.POINTER(_P)], errors=files(0))
_sp_free = bind("dflash_spool_free", [_P], None)
_sp_info = bind("dflash_spool_get_info", [_P, ctypes.POINTER(_SpoolInfo)])
_sp_seek = bind("dflash_spool_seek", [_P, ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint64])
_sp_tell = bind("dflash_spool_tell", [_P, ctypes.POINTER(ctypes.c_int32),
                                      ctypes.POINTER(ctypes.c_uint64),
                                      ctypes.POINTER(ctypes.c_uint64)])
_sp_next = bind("dflash_spool_next", [_P, ctypes.POINTER(Sample),
                                      ctypes.POINTER(ctypes.c_int)])
_sp_release = bind("dflash_spool_release", [_P, ctypes.c_int32, ctypes.c_uint64])
_h_open = bind("dflash_hidden_open", [ctypes.c_char_p, ctypes.POINTER(_P)], errors=files(0))
_h_free = bind("dflash_hidden_free", [_P], None)
_h_info = bind("dflash_hidden_get_info", [_P, ctypes.POINTER(_HiddenInfo)])
_h_id = bind("dflash_hidden_id", [_P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p)],
             errors=INDEX)
_h_len = bind("dflash_hidden_length", [_P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64)],
              errors=KEY)
_h_read = bind("dflash_hidden_read", [_P, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64],
               errors=KEY)
_h_has_t = bind("dflash_hidden_has_target_ids", [_P], ctypes.c_int, status=False)
_h_read_t = bind("dflash_hidden_read_target_ids", [_P, ctypes.c_char_p, ctypes.c_void_p,
                                                   ctypes.c_int64], errors=KEY)
_layout_of = bind("dflash_hidden_layout_of", [ctypes.c_char_p], ctypes.c_int, status=False)
_is_vllm_file = bind("dflash_hidden_is_vllm_file", [ctypes.c_char_p], ctypes.c_int, status=False)
_h_read_final = bind("dflash_hidden_read_final", [_P, ctypes.c_char_p, ctypes.c_void_p,
                                                  ctypes.c_int64], errors=KEY)
_h_read_final_state = bind("dflash_hidden_read_final_state",
                          [_P, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64], errors=KEY)
_h_stats = bind("dflash_hidden_stats", [_P, ctypes.POINTER(ctypes.c_double),
                                         ctypes.POINTER(ctypes.c_uint64),
                                         ctypes.POINTER(ctypes.c_uint64)])
_s_defaults = bind("dflash_sample_stream_options_init",
                   [ctypes.POINTER(StreamOptions), ctypes.c_size_t], None)
_s_open = bind("dflash_sample_stream_open", [ctypes.c_char_p, ctypes.c_char_p,
                                             ctypes.POINTER(StreamOptions), ctypes.POINTER(_P)],
               errors=files(0, 1))
_s_free = bind("dflash_sample_stream_free", [_P], None)
_s_count = bind("dflash_sample_stream_count", [_P], ctypes.c_size_t)
_s_check = bind("dflash_sample_stream_check", [_P, ctypes.POINTER(ctypes.c_size_t)], errors=KEY)
_s_start = bind("dflash_sample_stream_start", [_P, ctypes.POINTER(ctypes.c_uint64),
                                               ctypes.c_size_t], errors=INDEX)
_s_next = bind("dflash_sample_stream_next", [_P, ctypes.POINTER(Sample),
                                             ctypes.POINTER(ctypes.c_int)])

# dflash_dtype (safetensors.h): the one dtype enum, also of a store's rows.
DTYPES = {"bf16": 3, "bfloat16": 3, "fp8": 4, "fp8_e4m3": 4, "float8_e4m3fn": 4}
_DTYPE_NAMES = {3: "bf16", 4: "fp8_e4m3"}


def _as_array(states):
    """numpy or torch -> (contiguous array, is_bf16_bits)."""
    if hasattr(states, "detach"):  # a torch tensor
        import torch
        t = states.detach().cpu()
        if t.dtype == torch.bfloat16:
            return np.ascontiguousarray(t.view(torch.int16).numpy().view(np.uint16)), True
        return np.ascontiguousarray(t.float().numpy()), False
    return np.ascontiguousarray(states, dtype=np.float32), False


class HiddenWriter:
    """libdflash.HiddenWriter(dir, num_layers=K, hidden_size=H, dtype="bf16"|"fp8").

    append(sample_id, array [S, K*H]) buffers a sample; shards of
    `shard_bytes` are written as they fill; close() (or leaving a `with`)
    writes the rest. Reopening a directory appends to it. Use it as
    `with libdflash.HiddenWriter(...) as w:`.

    A writer that is never closed still commits what it holds: when it is
    garbage-collected, or at interpreter exit, its buffered samples are
    written and its index updated, and a RuntimeWarning names the directory
    and the samples appended since the last flush. Committing, not
    discarding, because every buffered sample was whole when append() took
    it (a shard is written under a temporary name and renamed, so a commit
    never leaves half a sample), and those rows cost a target forward each;
    a script that simply forgot close() would otherwise lose up to
    `shard_bytes` of them without a word. Only leaving a `with` block by an
    exception discards the buffer (a failed dump's last samples may be the
    cause of the failure); the samples already in shards stay.

    target_layer_ids (K target layer numbers, the drafter config's
    dflash_config.target_layer_ids) and tokenizer_hash (libdflash.tokenizer_hash(target),
    as the dataset records it) are recorded in the store: `dflash train` and `eval` refuse a
    drafter reading other layers, `dflash inspect` shows them.

    final_state=True: every append() also takes final_state=[S, H], the target's final
    hidden state AFTER its final norm (transformers: hidden_states[-1] of the whole model,
    or last_hidden_state), stored as "f/<id>" in the store's dtype. A DSpark drafter
    trains on it with 0.1 CE + 0.9 L1 + 1.0 BCE (without it: 0.1 CE alone). It costs H more
    values per token, (K+1)/K of the bytes. In a store or a spool (spool_budget) alike: a
    spool's consumer (`dflash train --hidden spool:DIR`, Spool) gets it with every sample.

    Spool mode (spool_budget=BYTES, at least 2 * shard_bytes): `dir` (a folder or
    an s3:// prefix) is a spool that `dflash train --hidden spool:DIR` consumes
    while it is written; a shard is published only while the unconsumed shards
    total less than the budget. spool_wait: seconds to wait for room (None:
    forever; 0: raise at once); past it, libdflash.DeadlineError ("spool ... is
    full") and an append that raised did NOT take its sample. end_epoch() ends
    an epoch (the producer then re-prefills the next one); `sample_id in w` says
    whether the current epoch already has it, also after a restart, so a killed
    producer resumes with `if sid in w: continue`. spool_status() reports the
    epoch, its samples, the spool's bytes and its high-water mark.

    Producer recipes (the target writes, `dflash train --hidden spool:DIR` reads):

        with libdflash.HiddenWriter("s3://bucket/spool", num_layers=K, hidden_size=H,
                                    shard_bytes=256 << 20, spool_budget=8 << 30) as w:
            for epoch in range(w.spool_status()["epoch"], epochs):
                for sid, input_ids in dataset:         # same order every restart
                    if sid in w:
                        continue                       # published before a crash
                    w.append(sid, prefill(input_ids))  # blocks while the spool is full
                w.end_epoch()

    prefill() with SGLang: an engine with hidden-state capture, as SpecForge
    drives it: `model_runner.model.set_eagle3_layers_to_capture([k + 1 for k in
    layer_ids])` and a prefill-only request (max_new_tokens=0 or 1) with
    CaptureHiddenMode.FULL; `logits_output.hidden_states` [S, K*H] is the
    sample (see the module docstring for the layer offset). With vLLM:
    speculators' extract_hidden_states method (`LLM(..., speculative_config=
    {"method": "extract_hidden_states", ...})` with the hs-connector writing
    [S, K+1, H] per request); drop the last slot (the final layer) and reshape
    to [S, K*H] before append; vLLM's aux layer ids are z-lab's + 1. Several
    target replicas: one spool each (one producer per spool), or a queue in
    front of one writer.
    """

    def __init__(self, directory, num_layers, hidden_size, dtype="bf16", shard_bytes=None,
                 spool_budget=None, spool_wait=None, target_layer_ids=None, tokenizer_hash=None,
                 final_state=False):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}")
        opts = WriterOptions()
        _w_defaults(ctypes.byref(opts), ctypes.sizeof(opts))
        opts.dtype = DTYPES[dtype]
        if shard_bytes:
            opts.shard_bytes = int(shard_bytes)
        if spool_budget:
            opts.spool_budget = int(spool_budget)
            opts.spool_wait_s = -1.0 if spool_wait is None else float(spool_wait)
        # Recorded in the store (dflash_hidden_writer_options): train and eval refuse a drafter
        # config whose target_layer_ids differ. The array lives until create has copied it.
        ids = None
        if target_layer_ids is not None:
            if len(target_layer_ids) != num_layers:
                raise ValueError(f"target_layer_ids has {len(target_layer_ids)} entries, "
                                 f"num_layers is {num_layers}")
            ids = (ctypes.c_int32 * num_layers)(*[int(k) for k in target_layer_ids])
            opts.target_layer_ids = ids
        opts.tokenizer_hash = cstr(tokenizer_hash)
        opts.final_state = int(bool(final_state))
        self.final_state, self.hidden_size = bool(final_state), hidden_size
        self.width = num_layers * hidden_size
        self._dir, self._pending = str(directory), 0
        self._h = _P()
        _w_create(cstr(directory), num_layers, hidden_size, ctypes.byref(opts),
                  ctypes.byref(self._h))
        _OPEN_WRITERS.add(self)

    def _writer(self):
        if not getattr(self, "_h", None):
            raise ValueError("HiddenWriter is closed")
        return self._h

    def append(self, sample_id, states, target_ids=None, final_state=None):
        """Buffer one sample: float32 (or torch bf16, kept bit-exact) [S, K*H].
        target_ids: the target's greedy token after each position, [S] integers
        (logits.argmax(-1) of the same forward), stored for `dflash train --labels target`
        (4 bytes per token). final_state: the target's post-norm final state [S, H], in the
        same dtype as states; required by a writer with final_state=True, refused otherwise."""
        a, bf16 = _as_array(states)
        if a.ndim != 2 or a.shape[1] != self.width:
            raise ValueError(f"states have shape {a.shape}; expected [S, {self.width}]")
        if (final_state is None) == self.final_state:
            raise ValueError("final_state is required by a HiddenWriter(..., final_state=True)"
                             if self.final_state else
                             "final_state given to a HiddenWriter created without final_state")
        r = Rows()
        _rows_init(ctypes.byref(r), ctypes.sizeof(r))
        r.dtype = _DTYPE_BF16 if bf16 else _DTYPE_F32
        r.len, r.states = a.shape[0], a.ctypes.data
        t = None
        if target_ids is not None:
            if hasattr(target_ids, "detach"):  # a torch tensor
                target_ids = target_ids.detach().cpu().numpy()
            t = np.ascontiguousarray(target_ids, dtype=np.int32)
            if t.shape != (a.shape[0],):
                raise ValueError(f"target_ids have shape {t.shape}; expected [{a.shape[0]}]")
            r.target_ids = t.ctypes.data
        f = None
        if final_state is not None:
            f, fbf16 = _as_array(final_state)
            if f.shape != (a.shape[0], self.hidden_size):
                raise ValueError(f"final_state has shape {f.shape}; expected "
                                 f"[{a.shape[0]}, {self.hidden_size}]")
            if fbf16 != bf16:
                raise ValueError("final_state must have the dtype of states (both bfloat16, "
                                 "or both float)")
            r.final_state = f.ctypes.data
        _w_add(self._writer(), str(sample_id).encode(), ctypes.byref(r))
        self._pending += 1

    def flush(self):
        """Write the buffered samples as a shard and update the index."""
        _w_flush(self._writer())
        self._pending = 0

    def end_epoch(self):
        """Spool: publish the buffered samples and mark the end of the current epoch."""
        _w_end_epoch(self._writer())
        self._pending = 0

    def __contains__(self, sample_id):
        return bool(_w_contains(self._writer(), str(sample_id).encode()))

    def spool_status(self):
        """{"epoch", "samples" (taken in it), "spool_bytes", "high_water"}."""
        s = _SpoolStatus(struct_size=ctypes.sizeof(_SpoolStatus))
        _w_spool_status(self._writer(), ctypes.byref(s))
        return {name: getattr(s, name) for name, _ in _SpoolStatus._fields_[1:]}

    def close(self):
        """Write the buffered samples and the index, then release the writer."""
        h, self._h = getattr(self, "_h", None), None
        _OPEN_WRITERS.discard(self)
        if h:
            try:
                _w_finish(h)
            finally:
                _w_free(h)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        if exc_type is None:
            self.close()
        else:  # do not write a shard from a failed dump's buffer
            h, self._h = self._h, None
            _OPEN_WRITERS.discard(self)
            _w_free(h)

    def _commit_unclosed(self, when):
        """close() for a writer its owner forgot, with a warning (see the class docstring)."""
        if not getattr(self, "_h", None) or _w_finish is None:
            return  # closed, or the module is already torn down (then _at_exit ran first)
        n = self._pending
        try:
            self.close()
        except Exception as e:  # a finalizer must not raise; say what was lost instead
            warnings.warn(f"HiddenWriter({self._dir!r}) was not closed, and committing its "
                          f"{n} buffered samples {when} failed: {e}", RuntimeWarning)
            return
        warnings.warn(f"HiddenWriter({self._dir!r}) was not closed: {when}, its {n} samples "
                      "appended since the last flush were written (use `with` or close())",
                      RuntimeWarning)

    def __del__(self):
        self._commit_unclosed("when it was garbage-collected")


# Writers not yet closed: committed at interpreter exit, while the library and the log
# callback still work (atexit runs before module teardown; registered after _core's
# handler, so it runs before that one unsets the callback).
_OPEN_WRITERS = weakref.WeakSet()


@atexit.register
def _commit_open_writers():
    for w in list(_OPEN_WRITERS):
        w._commit_unclosed("at interpreter exit")


class Spool(Handle):
    """The consumer side of a spool (what `dflash train --hidden spool:DIR` does):
    Spool(dir, wait=600, reuse=False); iterate(epoch) yields (id, hidden [S, K*H]
    copy, (epoch, shard, offset)) up to the producer's end of that epoch;
    release(epoch, shard) deletes the shards before (epoch, shard) once your own
    record of them is durable. final_state: whether the producer wrote the target's
    post-norm final state (HiddenWriter(..., final_state=True)); next(final_state=True)
    and iterate(final_state=True) then yield (id, hidden, final [S, H] float32 or None,
    position)."""

    _free = "dflash_spool_free"

    def __init__(self, directory, wait=None, reuse=False):
        opts = SpoolOptions()
        _sp_defaults(ctypes.byref(opts), ctypes.sizeof(opts))
        if wait is not None:
            opts.wait_s = float(wait)
        opts.reuse = int(bool(reuse))
        self._h = _P()
        _sp_open(cstr(directory), ctypes.byref(opts), ctypes.byref(self._h))
        info = _SpoolInfo(struct_size=ctypes.sizeof(_SpoolInfo))
        _sp_info(self._h, ctypes.byref(info))
        self.num_layers, self.hidden_size = info.num_layers, info.hidden_size
        self.dtype = _DTYPE_NAMES[info.dtype]
        self.final_state = bool(info.final_state)

    def seek(self, epoch, shard=0, offset=0):
        """Move to sample `offset` of shard `shard` of `epoch` (a resume)."""
        _sp_seek(self._handle(), int(epoch), int(shard), int(offset))

    def tell(self):
        """(epoch, shard, offset) of the sample next() returns next."""
        e, s, o = ctypes.c_int32(), ctypes.c_uint64(), ctypes.c_uint64()
        _sp_tell(self._handle(), ctypes.byref(e), ctypes.byref(s), ctypes.byref(o))
        return e.value, s.value, o.value

    def next(self, final_state=False):
        """(id, hidden, (epoch, shard, offset)), or None at the end of the epoch; with
        final_state=True, (id, hidden, final, (epoch, shard, offset)): final is the sample's
        target final state, float32 [S, H], or None when the spool has none."""
        smp, end = Sample(struct_size=ctypes.sizeof(Sample)), ctypes.c_int()
        _sp_next(self._handle(), ctypes.byref(smp), ctypes.byref(end))
        if end.value:
            return None
        width = self.num_layers * self.hidden_size
        sid, hidden = smp.id.decode(), _copy(smp.hidden, (smp.len, width), np.float32)
        pos = (smp.epoch, smp.shard, smp.offset)
        if not final_state:
            return sid, hidden, pos
        fin = (_copy(smp.target_final, (smp.len, self.hidden_size), np.float32)
               if smp.target_final else None)
        return sid, hidden, fin, pos

    def iterate(self, epoch=None, final_state=False):
        """Yield next() items up to the end of the epoch (from its start when `epoch` is given)."""
        if epoch is not None:
            self.seek(epoch)
        while True:
            item = self.next(final_state)
            if item is None:
                return
            yield item

    def release(self, epoch, shard):
        """Record that shards before (epoch, shard) are consumed, and delete them."""
        _sp_release(self._handle(), int(epoch), int(shard))


class HiddenStore(Handle):
    """A hidden-state store opened for reading (memory-mapped)."""

    _free = "dflash_hidden_free"

    def __init__(self, directory):
        self._h = _P()
        _h_open(cstr(directory), ctypes.byref(self._h))
        info = _HiddenInfo(struct_size=ctypes.sizeof(_HiddenInfo))
        _h_info(self._h, ctypes.byref(info))
        self.num_layers, self.hidden_size = info.num_layers, info.hidden_size
        self.dtype, self.count = _DTYPE_NAMES[info.dtype], info.count
        # Whether every sample carries the target's post-norm final state (final_state=True).
        self.final_state = bool(info.final_state)

    def __len__(self):
        return self.count

    def ids(self):
        """Sample ids in the store, sorted."""
        out = []
        for i in range(self.count):
            s = ctypes.c_char_p()
            _h_id(self._handle(), i, ctypes.byref(s))
            out.append(s.value.decode())
        return out

    def length(self, sample_id):
        """Token count of a sample; MissingKeyError (a KeyError, DFLASH_E_NOT_FOUND)
        naming the id when absent."""
        n = ctypes.c_int64()
        _h_len(self._handle(), str(sample_id).encode(), ctypes.byref(n))
        return n.value

    def read(self, sample_id):
        """A sample decoded to float32 [S, K*H]."""
        n = self.length(sample_id)
        out = np.empty((n, self.num_layers * self.hidden_size), dtype=np.float32)
        _h_read(self._handle(), str(sample_id).encode(), out.ctypes.data, n)
        return out

    def has_target_ids(self):
        """"stored" (the producer's target ids), "vllm" (vLLM's final layer, turned into ids
        by the trainer) or None: what `dflash train --labels target` can train on."""
        return {0: None, 1: "stored", 2: "vllm"}[_h_has_t(self._handle())]

    def target_ids(self, sample_id):
        """The stored target ids of a sample, int32 [S] (MissingKeyError when none)."""
        n = self.length(sample_id)
        out = np.empty((n,), dtype=np.int32)
        _h_read_t(self._handle(), str(sample_id).encode(), out.ctypes.data, n)
        return out

    def final_layer(self, sample_id):
        """vLLM's files: the final-layer slot of a sample, float32 [S, H]."""
        n = self.length(sample_id)
        out = np.empty((n, self.hidden_size), dtype=np.float32)
        _h_read_final(self._handle(), str(sample_id).encode(), out.ctypes.data, n)
        return out

    def read_final_state(self, sample_id):
        """The target's final state after its final norm of a sample, float32 [S, H] (a
        store written with final_state=True; MissingKeyError otherwise)."""
        n = self.length(sample_id)
        out = np.empty((n, self.hidden_size), dtype=np.float32)
        _h_read_final_state(self._handle(), str(sample_id).encode(), out.ctypes.data, n)
        return out

    def stats(self):
        """Sanity of the whole store (reads every sample): {"rows": tokens, "rms": per-layer
        RMS list, "zero_rows": per-layer count of all-zero token rows}. A layer whose RMS is 0,
        or whose zero rows are all of them, was never captured."""
        K = self.num_layers
        rms, zero, rows = (ctypes.c_double * K)(), (ctypes.c_uint64 * K)(), ctypes.c_uint64()
        _h_stats(self._handle(), rms, zero, ctypes.byref(rows))
        return {"rows": rows.value, "rms": list(rms), "zero_rows": list(zero)}


class SampleStream(Handle):
    """Tokenized dataset joined with a hidden-state store, prefetched."""

    _free = "dflash_sample_stream_free"

    def __init__(self, data_dir, hidden_dir, prefetch=None):
        """prefetch: samples decoded ahead on the background thread (None: the
        library's default)."""
        opts = StreamOptions()
        _s_defaults(ctypes.byref(opts), ctypes.sizeof(opts))
        if prefetch is not None:
            opts.prefetch = int(prefetch)
        self._h = _P()
        _s_open(cstr(data_dir), cstr(hidden_dir), ctypes.byref(opts), ctypes.byref(self._h))

    def __len__(self):
        return _s_count(self._handle())

    def check(self):
        """Raise libdflash.Error naming the first missing id / length mismatch."""
        bad = ctypes.c_size_t()
        _s_check(self._handle(), ctypes.byref(bad))

    def iterate(self, order=None):
        """Yield (index, id, input_ids, loss_mask, hidden) copies in `order` (the
        sample's pointers are the stream's until the next one: each is copied before
        it is yielded). Closing the stream mid-iteration makes the next step raise
        ValueError."""
        order = np.ascontiguousarray(np.arange(len(self)) if order is None else order,
                                     dtype=np.uint64)
        _s_start(self._handle(), order.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)),
                 order.size)
        s, done = Sample(struct_size=ctypes.sizeof(Sample)), ctypes.c_int()
        while True:
            h = self._handle()
            _s_next(h, ctypes.byref(s), ctypes.byref(done))
            if done.value:
                return
            n, width = s.len, _width(h)
            yield (s.index, s.id.decode(), _copy(s.input_ids, (n,), np.int32),
                   _copy(s.loss_mask, (n,), np.uint8), _copy(s.hidden, (n, width), np.float32))

    def width(self):
        """K*H of the store: the width of each hidden-state row."""
        return _width(self._handle())


_width = bind("dflash_sample_stream_width", [_P], ctypes.c_int64)


def _copy(ptr, shape, dtype):
    """A numpy copy of the C array at `ptr` (empty shapes need no address)."""
    out = np.empty(shape, dtype)
    if out.size:
        ctypes.memmove(out.ctypes.data, ptr, out.nbytes)
    return out


def write_dataset(directory, samples, **options):
    """Write a tokenized dataset (the format `dflash tokenize` produces) from
    samples = [(id, input_ids, loss_mask), ...]; handy for tests and for
    data tokenized elsewhere. `options` go to libdflash.DatasetWriter."""
    with DatasetWriter(directory, **options) as w:
        for sid, ids, mask in samples:
            w.add(sid, ids, mask)


def hidden_layout(path):
    """What the local folder `path` holds: "store" (a libdflash store), "vllm" (vLLM's
    hs_<digits>.safetensors files) or None."""
    return {0: None, 1: "store", 2: "vllm"}[_layout_of(os.fsencode(os.fspath(path)))]


def is_vllm_hidden_file(name):
    """Whether a file name is one of vLLM's hidden-state files, hs_<digits>.safetensors."""
    return bool(_is_vllm_file(os.fsencode(os.fspath(name))))
