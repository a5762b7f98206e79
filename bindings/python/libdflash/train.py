"""The drafter trainer through libdflash (float32 CPU reference backend).

`Trainer` is the oracle hook: it exposes parameters, gradients and one
sequence's forward/backward with given anchors, so the maths can be checked
against independent implementations (tests/train/oracle_*.py does so with
PyTorch).
"""
import ctypes
import json
import os
import signal

import numpy as np

from ._core import warn_generic_blas
from ._lib import (INDEX, KEY, BufferTooSmallError, ExistsError, Handle, bind, cstr, files,
                   missing_path, status_code)

MAX_LAYERS = 64
MAX_TARGET = 128


class DrafterConfig(ctypes.Structure):
    """Mirror of `dflash_drafter_config` (include/dflash/drafter.h)."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("hidden_size", ctypes.c_int32), ("intermediate_size", ctypes.c_int32),
        ("num_hidden_layers", ctypes.c_int32), ("num_attention_heads", ctypes.c_int32),
        ("num_key_value_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
        ("vocab_size", ctypes.c_int32), ("max_position_embeddings", ctypes.c_int32),
        ("rms_norm_eps", ctypes.c_double), ("rope_theta", ctypes.c_double),
        ("rope_type", ctypes.c_int32), ("rope_factor", ctypes.c_double),
        ("rope_attention_factor", ctypes.c_double), ("rope_beta_fast", ctypes.c_double),
        ("rope_beta_slow", ctypes.c_double), ("rope_original_max_position", ctypes.c_int32),
        ("rope_truncate", ctypes.c_int32),
        ("num_target_layers", ctypes.c_int32), ("block_size", ctypes.c_int32),
        ("mask_token_id", ctypes.c_int32), ("n_target_layer_ids", ctypes.c_int32),
        ("target_layer_ids", ctypes.c_int32 * MAX_TARGET),
        ("layer_types", ctypes.c_int32 * MAX_LAYERS),
        ("sliding_window", ctypes.c_int32), ("attention_bias", ctypes.c_int32),
        ("tie_word_embeddings", ctypes.c_int32),
        # partial RoPE and DFlash 2 (drafter.h)
        ("partial_rotary_factor", ctypes.c_double),
        ("dflash2", ctypes.c_int32), ("conv_kernel_size", ctypes.c_int32),
        ("conv_group_size", ctypes.c_int32), ("selector_top_k", ctypes.c_int32),
        ("selector_rank", ctypes.c_int32),
        # DSpark (drafter.h), and its pruned draft vocabulary
        ("dspark", ctypes.c_int32), ("markov_rank", ctypes.c_int32),
        ("confidence_head", ctypes.c_int32), ("num_anchors", ctypes.c_int32),
        ("draft_vocab_size", ctypes.c_int32),
    ]

    def __init__(self, *args, **kw):
        # A versioned struct (the one rule): parse and load write up to its struct_size.
        kw.setdefault("struct_size", ctypes.sizeof(DrafterConfig))
        super().__init__(*args, **kw)


class TrainerOptions(ctypes.Structure):
    """Mirror of `dflash_trainer_options`."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t), ("backend", ctypes.c_int32),
        ("n_threads", ctypes.c_int32), ("seed", ctypes.c_uint64), ("lr", ctypes.c_double),
        ("weight_decay", ctypes.c_double), ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double), ("adam_eps", ctypes.c_double),
        ("grad_clip", ctypes.c_double), ("warmup_ratio", ctypes.c_double),
        ("total_steps", ctypes.c_int64), ("min_lr_ratio", ctypes.c_double),
        ("loss_gamma", ctypes.c_double), ("num_anchors", ctypes.c_int32),
        ("vocab_chunk", ctypes.c_int32), ("init_std", ctypes.c_double),
        ("selector_loss_weight", ctypes.c_double), ("selector_loss_mode", ctypes.c_int32),
        ("lr_schedule", ctypes.c_int32), ("position_weighting", ctypes.c_int32),
        ("muon_momentum", ctypes.c_double), ("muon_weight_decay", ctypes.c_double),
        ("optimizer", ctypes.c_int32), ("muon_adjust_lr", ctypes.c_int32),
        ("dist_timeout_s", ctypes.c_double), ("grad_reduce_bf16", ctypes.c_int32),
    ]


# dflash_lr_schedule and dflash_position_weighting
LR_COSINE, LR_LINEAR, LR_CONSTANT = 0, 1, 2
POSITION_WEIGHTING_DECAY, POSITION_WEIGHTING_ADAPTIVE = 0, 1
# dflash_optimizer and dflash_muon_adjust_lr
OPTIMIZER_ADAMW, OPTIMIZER_MUON = 0, 1
MUON_ADJUST_LR_MATCH_RMS_ADAMW, MUON_ADJUST_LR_ORIGINAL = 0, 1


_P = ctypes.c_void_p
_F = ctypes.POINTER(ctypes.c_float)
_I32 = ctypes.POINTER(ctypes.c_int32)
_U8 = ctypes.POINTER(ctypes.c_uint8)
_D = ctypes.POINTER(ctypes.c_double)

_cfg_default = bind("dflash_drafter_config_init", [ctypes.POINTER(DrafterConfig), ctypes.c_size_t],
                    None)
_cfg_parse = bind("dflash_drafter_config_parse",
                  [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(DrafterConfig)])
_cfg_json = bind("dflash_drafter_config_to_json",
                 [ctypes.POINTER(DrafterConfig), ctypes.c_char_p, ctypes.c_size_t,
                  ctypes.POINTER(ctypes.c_size_t)])
_default_layers = bind("dflash_drafter_default_target_layers", [ctypes.c_int32, ctypes.c_int32, _I32])
_opts_default = bind("dflash_trainer_options_init", [ctypes.POINTER(TrainerOptions), ctypes.c_size_t],
                     None)
_create = bind("dflash_trainer_create", [ctypes.POINTER(DrafterConfig), _F, _F,
                                         ctypes.POINTER(TrainerOptions), ctypes.POINTER(_P)])
_free = bind("dflash_trainer_free", [_P], None)
_pcount = bind("dflash_trainer_param_count", [_P], ctypes.c_size_t)
_pinfo = bind("dflash_trainer_param_info",
              [_P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p), _I32,
               ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_size_t)], errors=INDEX)
_get_param = bind("dflash_trainer_get_param", [_P, ctypes.c_char_p, _F, ctypes.c_size_t],
                  errors=KEY)
_set_param = bind("dflash_trainer_set_param", [_P, ctypes.c_char_p, _F, ctypes.c_size_t],
                  errors=KEY)
_get_grad = bind("dflash_trainer_get_grad", [_P, ctypes.c_char_p, _F, ctypes.c_size_t], errors=KEY)
from .hidden import Sample as _StreamSample  # noqa: E402


# One mirror of `dflash_sample` (hidden.Sample), what streams fill and trainer calls take.
TrainSample = _StreamSample


_SMP = ctypes.POINTER(TrainSample)
_fb = bind("dflash_trainer_forward_backward", [_P, _SMP, _D])
_zero = bind("dflash_trainer_zero_grad", [_P])
_accum = bind("dflash_trainer_accumulate", [_P, _SMP, ctypes.c_double])
_collect = bind("dflash_trainer_collect", [_P, _D, _D])
_wsum = bind("dflash_trainer_weight_sum", [_P, _SMP, _D])
_step = bind("dflash_trainer_step", [_P, _D, _D])
_step_async = bind("dflash_trainer_step_async", [_P, _D])
_step_result = bind("dflash_trainer_step_result", [_P, _D])
_step_count = bind("dflash_trainer_step_count", [_P], ctypes.c_int64)
_lr_at = bind("dflash_trainer_lr_at", [_P, ctypes.c_int64], ctypes.c_double)


class ProposeOptions(ctypes.Structure):
    """Mirror of `dflash_propose_options`."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t), ("temperature", ctypes.c_double),
        ("seed", ctypes.c_uint64),
    ]


class ProposeOutputs(ctypes.Structure):
    """Mirror of `dflash_propose_outputs`."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t), ("candidates", _I32), ("probs", _F), ("argmax", _I32),
    ]


_propose_init = bind("dflash_propose_options_init",
                     [ctypes.POINTER(ProposeOptions), ctypes.c_size_t], None)
_propose = bind("dflash_trainer_propose", [_P, _SMP, ctypes.POINTER(ProposeOptions), _I32,
                                           ctypes.POINTER(ProposeOutputs)])
_save = bind("dflash_trainer_save", [_P, ctypes.c_char_p, ctypes.c_int32])
_load = bind("dflash_trainer_load", [_P, ctypes.c_char_p], errors=missing_path(1))
_save_state = bind("dflash_trainer_save_state", [_P, ctypes.c_char_p, ctypes.c_void_p,
                                                 ctypes.c_size_t])
_load_state = bind("dflash_trainer_load_state", [_P, ctypes.c_char_p, ctypes.c_void_p,
                                                 ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
                   errors=missing_path(1))
_sample = bind("dflash_anchors_sample", [_U8, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                                         ctypes.c_uint64, ctypes.c_uint64, _I32, _I32])
_gamma = bind("dflash_trainer_default_loss_gamma", [ctypes.c_int32], ctypes.c_double)
_I64 = ctypes.POINTER(ctypes.c_int64)
_dv_select = bind("dflash_draft_vocab_select", [_I64, ctypes.c_int32, ctypes.c_int32, _I32,
                                                ctypes.POINTER(ctypes.c_double)])
_dv_dataset = bind("dflash_draft_vocab_from_dataset", [ctypes.c_void_p, ctypes.c_int32,
                                                       ctypes.c_int32, _I32,
                                                       ctypes.POINTER(ctypes.c_double)])
_dv_set = bind("dflash_trainer_set_draft_vocab", [ctypes.c_void_p, _I32, ctypes.c_int32])
_dv_get = bind("dflash_trainer_draft_vocab", [ctypes.c_void_p, _I32, ctypes.c_int32,
                                              ctypes.POINTER(ctypes.c_int32)])


def draft_vocab_select(counts, draft_vocab_size):
    """A pruned draft vocabulary from supervised token counts (int64 [vocab_size]): the
    draft_vocab_size most frequent ids (ties: the lower id; filled with the lowest unused
    ids), ascending, and their coverage of the counted tokens. Returns (kept int32, coverage);
    d2t = kept - arange, t2d = isin(arange(vocab_size), kept) (spec/dspark.md section 4)."""
    c = np.ascontiguousarray(counts, dtype=np.int64)
    kept = np.zeros(int(draft_vocab_size), dtype=np.int32)
    cov = ctypes.c_double(0)
    _dv_select(_ptr(c, ctypes.c_int64), len(c), int(draft_vocab_size), _ptr(kept, ctypes.c_int32),
               ctypes.byref(cov))
    return kept, cov.value


def draft_vocab_from_dataset(dataset, vocab_size, draft_vocab_size):
    """draft_vocab_select on a libdflash.Dataset's supervised token counts."""
    kept = np.zeros(int(draft_vocab_size), dtype=np.int32)
    cov = ctypes.c_double(0)
    _dv_dataset(dataset._handle(), int(vocab_size), int(draft_vocab_size),
                _ptr(kept, ctypes.c_int32), ctypes.byref(cov))
    return kept, cov.value


def _ptr(arr, ctype):
    return arr.ctypes.data_as(ctypes.POINTER(ctype))


def _config_text(config):
    """A config dict, JSON text or path -> (JSON bytes, the name messages give it)."""
    if isinstance(config, dict):
        return json.dumps(config).encode(), b"<dict>"
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        with open(config, "rb") as f:
            return f.read(), cstr(config)
    return (config.encode() if isinstance(config, str) else config), b"<text>"


def parse_config(config):
    """A config dict, JSON text or path -> DrafterConfig (validated by the library)."""
    if isinstance(config, DrafterConfig):
        return config
    text, what = _config_text(config)
    cfg = DrafterConfig()
    _cfg_parse(text, len(text), what, ctypes.byref(cfg))
    return cfg


def config_to_dict(cfg):
    """DrafterConfig -> the config.json dict the library writes."""
    n = ctypes.c_size_t(0)
    try:
        _cfg_json(ctypes.byref(cfg), None, 0, ctypes.byref(n))
    except Exception:  # DFLASH_E_BUFFER reports the size
        pass
    buf = ctypes.create_string_buffer(n.value)
    _cfg_json(ctypes.byref(cfg), buf, n.value, ctypes.byref(n))
    return json.loads(buf.value.decode())


def default_target_layers(num_target_layers, k):
    """The spec's default target layer ids for K layers of an L-layer target."""
    out = (ctypes.c_int32 * k)()
    _default_layers(num_target_layers, k, out)
    return list(out)


def default_loss_gamma(block_size):
    """Default loss decay gamma for a block size (7 for B=16, 5 for 10, 4 for 8, else B/2)."""
    return _gamma(block_size)


def sample_anchors(loss_mask, block_size, max_anchors, seed, stream):
    """The spec's anchor sampling, as the trainer draws it."""
    mask = np.ascontiguousarray(loss_mask, dtype=np.uint8)
    out = np.zeros(max(max_anchors, 1), dtype=np.int32)
    n = ctypes.c_int32(0)
    _sample(_ptr(mask, ctypes.c_uint8), mask.size, block_size, max_anchors, seed, stream,
            _ptr(out, ctypes.c_int32), ctypes.byref(n))
    return out[:n.value].copy()


_OPTION_NAMES = {f for f, _ in TrainerOptions._fields_} - {"struct_size"}


class Trainer(Handle):
    """libdflash.Trainer(config, embed, lm_head, backend="cpu", seed=0, **options).

    config: a dict in config.json form, JSON text or a path; embed and lm_head:
    float32 [vocab, hidden]. Extra keyword options are fields of
    dflash_trainer_options (lr, weight_decay, beta1, beta2, adam_eps,
    grad_clip, warmup_ratio, total_steps, min_lr_ratio, loss_gamma,
    num_anchors, vocab_chunk, init_std, n_threads, lr_schedule: LR_*,
    position_weighting: POSITION_WEIGHTING_*, optimizer: OPTIMIZER_*, muon_momentum,
    muon_weight_decay, muon_adjust_lr: MUON_ADJUST_LR_*, grad_reduce_bf16: the CUDA
    backend's gradient reduce-scatter in bf16, dist_timeout_s: how long a collective waits
    for a rank).
    """

    _free = "dflash_trainer_free"

    def __init__(self, config, embed, lm_head, backend="cpu", seed=0, **options):
        warn_generic_blas()
        self.config = parse_config(config)
        opts = TrainerOptions()
        _opts_default(ctypes.byref(opts), ctypes.sizeof(opts))
        opts.backend = {"cpu": 0, "cuda": 1}[backend]
        opts.seed = seed
        for k, v in options.items():
            if k not in _OPTION_NAMES:
                raise TypeError(f"unknown trainer option {k!r}")
            setattr(opts, k, v)
        V, H = self.config.vocab_size, self.config.hidden_size
        embed = np.ascontiguousarray(embed, dtype=np.float32)
        lm_head = np.ascontiguousarray(lm_head, dtype=np.float32)
        for name, a in (("embed", embed), ("lm_head", lm_head)):
            if a.shape != (V, H):
                raise ValueError(f"{name} has shape {a.shape}, the config needs {(V, H)}")
        self._h = _P()
        _create(ctypes.byref(self.config), _ptr(embed, ctypes.c_float),
                _ptr(lm_head, ctypes.c_float), ctypes.byref(opts), ctypes.byref(self._h))
        self._info = []
        for i in range(_pcount(self._h)):
            name, ndim = ctypes.c_char_p(), ctypes.c_int32()
            shape, numel = (ctypes.c_int64 * 2)(), ctypes.c_size_t()
            _pinfo(self._h, i, ctypes.byref(name), ctypes.byref(ndim), shape, ctypes.byref(numel))
            self._info.append((name.value.decode(), tuple(shape[:ndim.value])))


    @property
    def block_size(self):
        """Block size B of the drafter."""
        return self.config.block_size

    def names(self):
        """Trainable tensor names, in buffer order (checkpoint names)."""
        return [n for n, _ in self._info]

    def _tensors(self, getter):
        out = {}
        for name, shape in self._info:
            a = np.empty(shape, dtype=np.float32)
            getter(self._handle(), name.encode(), _ptr(a, ctypes.c_float), a.size)
            out[name] = a
        return out

    def parameters(self):
        """dict name -> float32 array (copies), checkpoint names."""
        return self._tensors(_get_param)

    def gradients(self):
        """Gradients of the last forward_backward (or of the accumulated batch)."""
        return self._tensors(_get_grad)

    def set_parameters(self, params):
        """Copy parameters in from a dict name -> array (shapes as parameters())."""
        for name, value in params.items():
            a = np.ascontiguousarray(value, dtype=np.float32)
            _set_param(self._handle(), name.encode(), _ptr(a, ctypes.c_float), a.size)

    def _inputs(self, input_ids, loss_mask, hidden, anchors):
        ids = np.ascontiguousarray(input_ids, dtype=np.int32)
        mask = np.ascontiguousarray(loss_mask, dtype=np.uint8) if loss_mask is not None else None
        hid = np.ascontiguousarray(hidden, dtype=np.float32)
        anc = np.ascontiguousarray(anchors, dtype=np.int32)
        # The library reads len x K*H floats: a narrower array would be read past its end.
        width = self.config.n_target_layer_ids * self.config.hidden_size
        if hid.ndim != 2 or hid.shape != (ids.size, width):
            raise ValueError(f"hidden has shape {hid.shape}; expected [{ids.size}, {width}] "
                             f"(len(input_ids), K*H)")
        if mask is not None and mask.size != ids.size:
            raise ValueError("loss_mask and input_ids differ in length")
        return ids, mask, hid, anc

    def _sample(self, ids, mask, hid, anc):
        """The one sample struct over checked arrays (kept alive by the caller)."""
        smp = TrainSample(struct_size=ctypes.sizeof(TrainSample), len=ids.size if ids is not None
                          else mask.size)
        if ids is not None:
            smp.input_ids = _ptr(ids, ctypes.c_int32)
        if mask is not None:
            smp.loss_mask = _ptr(mask, ctypes.c_uint8)
        if hid is not None:
            smp.hidden = _ptr(hid, ctypes.c_float)
        if anc is not None:
            smp.anchors, smp.n_anchors = _ptr(anc, ctypes.c_int32), anc.size
        return smp

    def _final(self, target_final, n):
        """DSpark's target final state as float32 [n, hidden_size], or None."""
        if target_final is None:
            return None
        fin = np.ascontiguousarray(target_final, dtype=np.float32)
        if fin.shape != (n, self.config.hidden_size):
            raise ValueError(f"target_final has shape {fin.shape}; expected "
                             f"[{n}, {self.config.hidden_size}]")
        return fin

    def forward_backward(self, input_ids, loss_mask, hidden, anchors, target_final=None):
        """loss = sum(w*CE)/sum(w) over the given anchors; sets gradients(). DSpark:
        sum(w (0.1 CE + 0.9 L1 + 1.0 BCE)) / sum(w), with target_final the target's post-norm
        final hidden state [len, hidden_size] (None: 0.1 CE alone)."""
        ids, mask, hid, anc = self._inputs(input_ids, loss_mask, hidden, anchors)
        fin = self._final(target_final, ids.size)
        smp = self._sample(ids, mask, hid, anc)
        if fin is not None:
            smp.target_final = _ptr(fin, ctypes.c_float)
        loss = ctypes.c_double()
        _fb(self._handle(), ctypes.byref(smp), ctypes.byref(loss))
        return loss.value

    def zero_grad(self):
        """Zero the gradients before accumulate() calls."""
        _zero(self._handle())

    def weight_sum(self, loss_mask, anchors):
        """The position weights sum(w) a sequence with these anchors carries."""
        mask = np.ascontiguousarray(loss_mask, dtype=np.uint8)
        anc = np.ascontiguousarray(anchors, dtype=np.int32)
        out = ctypes.c_double()
        _wsum(self._handle(), ctypes.byref(self._sample(None, mask, None, anc)), ctypes.byref(out))
        return out.value

    def accumulate(self, input_ids, loss_mask, anchors, grad_scale, hidden=None,
                   codes=None, scales=None, sample_id=None, target_final=None):
        """Add grad_scale * d(sum w*CE) without waiting for the device: hidden float32
        [len, K*H], or codes as stored (uint16 bf16 bits, or uint8 e4m3 with float32 scales
        [len, K]). The sums come from collect(); a NaN/Inf row found on the device fails
        collect() or step(), naming sample_id."""
        ids = np.ascontiguousarray(input_ids, dtype=np.int32)
        mask = np.ascontiguousarray(loss_mask, dtype=np.uint8)
        anc = np.ascontiguousarray(anchors, dtype=np.int32)
        K, H = self.config.n_target_layer_ids, self.config.hidden_size
        if mask.size != ids.size:
            raise ValueError("loss_mask and input_ids differ in length")
        smp = self._sample(ids, mask, None, anc)
        smp.id = cstr(sample_id) if sample_id else None
        keep = [ids, mask, anc]
        fin = self._final(target_final, ids.size)
        if fin is not None:
            smp.target_final = _ptr(fin, ctypes.c_float)
            keep.append(fin)
        if hidden is not None:
            hid = np.ascontiguousarray(hidden, dtype=np.float32)
            if hid.shape != (ids.size, K * H):
                raise ValueError(f"hidden has shape {hid.shape}; expected [{ids.size}, {K * H}]")
            smp.hidden = _ptr(hid, ctypes.c_float)
            keep.append(hid)
        else:
            c = np.ascontiguousarray(codes)
            fp8 = c.dtype == np.uint8
            if c.dtype not in (np.uint8, np.uint16) or c.shape != (ids.size, K * H):
                raise ValueError(f"codes: uint16 (bf16) or uint8 (e4m3) [{ids.size}, {K * H}]")
            smp.hidden_dtype = 4 if fp8 else 3  # dflash_dtype: F8_E4M3, BF16
            smp.hidden_codes = c.ctypes.data
            keep.append(c)
            if fp8:
                sc = np.ascontiguousarray(scales, dtype=np.float32)
                if sc.shape != (ids.size, K):
                    raise ValueError(f"scales: float32 [{ids.size}, {K}]")
                smp.hidden_scales = _ptr(sc, ctypes.c_float)
                keep.append(sc)
        _accum(self._handle(), ctypes.byref(smp), grad_scale)
        del keep

    def collect(self):
        """(sum w*CE, sum w) of the accumulate calls since the last collect."""
        ls, ws = ctypes.c_double(), ctypes.c_double()
        _collect(self._handle(), ctypes.byref(ls), ctypes.byref(ws))
        return ls.value, ws.value

    def step(self):
        """Clip, AdamW at the scheduled lr; returns (grad_norm, lr)."""
        norm, lr = ctypes.c_double(), ctypes.c_double()
        _step(self._handle(), ctypes.byref(norm), ctypes.byref(lr))
        return norm.value, lr.value

    def step_async(self):
        """step without waiting for the device; returns the lr. The norm: step_result()."""
        lr = ctypes.c_double()
        _step_async(self._handle(), ctypes.byref(lr))
        return lr.value

    def step_result(self):
        """The pre-clip norm of the last step_async (waits for it)."""
        norm = ctypes.c_double()
        _step_result(self._handle(), ctypes.byref(norm))
        return norm.value

    @property
    def step_count(self):
        """Optimizer steps taken so far."""
        return _step_count(self._handle())

    def lr_at(self, step):
        """Scheduled learning rate of step `step` (0-based)."""
        return _lr_at(self._handle(), step)

    def _drafts(self):
        """Drafts a block: B - 1, or B for DSpark (its anchor-first slot 0 drafts too)."""
        return self.block_size if self.config.dspark else self.block_size - 1

    def predict(self, input_ids, hidden, anchors):
        """Greedy tokens for block positions 1..B-1: int32 [n_anchors, B-1]
        (dflash_trainer_propose with no options: propose(...)["tokens"] without the rest).
        DSpark: [n_anchors, B], slot k drafting anchor + k + 1, chained through the Markov
        head."""
        ids, _, hid, anc = self._inputs(input_ids, None, hidden, anchors)
        out = np.zeros((anc.size, self._drafts()), dtype=np.int32)
        _propose(self._handle(), ctypes.byref(self._sample(ids, None, hid, anc)), None,
                 _ptr(out, ctypes.c_int32), None)
        return out

    def propose(self, input_ids, hidden, anchors, temperature=0.0, seed=0):
        """Draft as z-lab's propose (dflash_trainer_propose): dict tokens int32
        [n_anchors, B-1] (greedy at temperature 0, else drawn from the candidate
        selector's rescored distribution, reproducibly for a seed), argmax
        [n_anchors, B-1] (the plain argmax) and, for DFlash 2, candidates
        int32 / probs float32 [n_anchors, B-1, selector_top_k] (probs, q of
        each candidate, only when temperature > 0)."""
        ids, _, hid, anc = self._inputs(input_ids, None, hidden, anchors)
        n = self._drafts()
        out = {"tokens": np.zeros((anc.size, n), np.int32),
               "argmax": np.zeros((anc.size, n), np.int32)}
        o = ProposeOptions()
        _propose_init(ctypes.byref(o), ctypes.sizeof(o))
        o.temperature, o.seed = float(temperature), int(seed)
        extra = ProposeOutputs(struct_size=ctypes.sizeof(ProposeOutputs))
        extra.argmax = _ptr(out["argmax"], ctypes.c_int32)
        if self.config.dflash2:
            K = self.config.selector_top_k
            out["candidates"] = np.zeros((anc.size, n, K), np.int32)
            extra.candidates = _ptr(out["candidates"], ctypes.c_int32)
            if temperature > 0:
                out["probs"] = np.zeros((anc.size, n, K), np.float32)
                extra.probs = _ptr(out["probs"], ctypes.c_float)
        _propose(self._handle(), ctypes.byref(self._sample(ids, None, hid, anc)), ctypes.byref(o),
                 _ptr(out["tokens"], ctypes.c_int32), ctypes.byref(extra))
        return out

    def set_draft_vocab(self, kept):
        """A pruned DSpark drafter's kept target ids (ascending, draft_vocab_size of them):
        its LM head rows and CE label map follow them."""
        k = np.ascontiguousarray(kept, dtype=np.int32)
        _dv_set(self._handle(), _ptr(k, ctypes.c_int32), len(k))

    def draft_vocab(self):
        """The kept target ids, int32 (all ids when not pruned)."""
        n = ctypes.c_int32(0)
        try:
            _dv_get(self._handle(), None, 0, ctypes.byref(n))
        except BufferTooSmallError:  # the count is in n
            pass
        out = np.zeros(n.value, dtype=np.int32)
        _dv_get(self._handle(), _ptr(out, ctypes.c_int32), n.value, ctypes.byref(n))
        return out

    def save(self, directory, bf16=False):
        """Save a checkpoint directory SGLang/vLLM load: config.json + model.safetensors."""
        _save(self._handle(), cstr(directory), int(bool(bf16)))

    def load(self, path):
        """Load parameters from a checkpoint directory or .safetensors file."""
        _load(self._handle(), cstr(path))

    def save_state(self, path, user=b""):
        """Save the training state (optimizer, step, parameters, caller blob) atomically."""
        buf = ctypes.create_string_buffer(bytes(user), len(user))
        _save_state(self._handle(), cstr(path), buf, len(user))

    def load_state(self, path):
        """Restore optimizer state and parameters; returns the caller blob."""
        n = ctypes.c_size_t(0)
        _load_state(self._handle(), cstr(path), None, 0, ctypes.byref(n))
        buf = ctypes.create_string_buffer(max(n.value, 1))
        _load_state(self._handle(), cstr(path), buf, len(buf), ctypes.byref(n))
        return buf.raw[:n.value]

    @classmethod
    def from_checkpoint(cls, checkpoint, target, embed_name=None, lm_head_name=None, **kwargs):
        """A trainer holding a saved drafter: its config.json, the target's
        embedding and LM head from `target` (see load_target_head), then the
        checkpoint's weights. kwargs as for Trainer (backend, seed, options)."""
        folder = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint)
        cfg = load_config(os.path.join(os.fspath(folder), "config.json"))
        embed, lm_head = load_target_head(target, cfg.vocab_size, cfg.hidden_size,
                                          embed_name, lm_head_name)
        t = cls(cfg, embed, lm_head, **kwargs)
        try:
            t.load(checkpoint)
        except BaseException:
            t.close()
            raise
        return t

    def acceptance(self, input_ids, hidden, anchors):
        """Greedy acceptance at each anchor: accept int32 [n]; accept[i] leading block
        positions equal the data, so tau_i = 1 + accept[i] (the drafts: predict())."""
        ids, _, hid, anc = self._inputs(input_ids, None, hidden, anchors)
        accept = np.zeros(anc.size, dtype=np.int32)
        _acceptance(self._handle(), ctypes.byref(self._sample(ids, None, hid, anc)),
                    _ptr(accept, ctypes.c_int32))
        return accept

    def evaluate(self, data_dir, hidden_dir, anchors_per_seq=64, seed=1):
        """Mean acceptance length over a held-out dataset and hidden-state store
        (what `dflash eval` prints): {"tau", "accuracy" (float64 [B-1], per block
        position; DSpark: [B], per draft), "n_blocks"}."""
        acc = np.zeros(self._drafts(), dtype=np.float64)
        e = Eval()
        _eval_init(ctypes.byref(e), ctypes.sizeof(e))
        e.anchors_per_seq, e.seed = int(anchors_per_seq), int(seed)
        e.accuracy = _ptr(acc, ctypes.c_double)
        _train_eval(self._handle(), cstr(data_dir), cstr(hidden_dir), ctypes.byref(e))
        return {"tau": e.tau, "accuracy": acc, "n_blocks": e.n_blocks}


# Imports of the additions below (kept here so the top of the file stays as it was).
import tempfile  # noqa: E402

from ._lib import Error  # noqa: E402



class Eval(ctypes.Structure):
    """Mirror of `dflash_eval`."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t), ("anchors_per_seq", ctypes.c_int32),
        ("seed", ctypes.c_uint64), ("accuracy", _D), ("tau", ctypes.c_double),
        ("n_blocks", ctypes.c_int64),
    ]


_acceptance = bind("dflash_trainer_acceptance", [_P, _SMP, _I32])
_eval_init = bind("dflash_eval_init", [ctypes.POINTER(Eval), ctypes.c_size_t], None)
_train_eval = bind("dflash_trainer_eval", [_P, ctypes.c_char_p, ctypes.c_char_p,
                                         ctypes.POINTER(Eval)], errors=missing_path(1, 2))
_cfg_load = bind("dflash_drafter_config_load", [ctypes.c_char_p, ctypes.POINTER(DrafterConfig)],
                 errors=files(0))
_cfg_save = bind("dflash_drafter_config_save", [ctypes.POINTER(DrafterConfig), ctypes.c_char_p])
_cfg_validate = bind("dflash_drafter_config_validate", [ctypes.POINTER(DrafterConfig)])
_load_head = bind("dflash_target_load_head", [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                              ctypes.c_int32, ctypes.c_int32, _F, _F],
                  errors=missing_path(0))


def load_config(path):
    """Read and validate a drafter config.json -> DrafterConfig."""
    cfg = DrafterConfig()
    _cfg_load(cstr(path), ctypes.byref(cfg))
    return cfg


def save_config(config, path):
    """Write a config (dict, JSON text, path or DrafterConfig) as config.json, atomically."""
    _cfg_save(ctypes.byref(parse_config(config)), cstr(path))


def validate_config(cfg):
    """Check a DrafterConfig (e.g. after changing its fields); raises Error
    DFLASH_E_CONFIG naming the field."""
    _cfg_validate(ctypes.byref(cfg))


def load_target_head(path, vocab_size, hidden_size, embed_name=None, lm_head_name=None):
    """The target's frozen token embedding and LM head, float32 [vocab, hidden]
    each, from its checkpoint (a .safetensors file, an index or a directory).
    Without an LM head tensor the embedding is returned twice (tied)."""
    embed = np.empty((vocab_size, hidden_size), dtype=np.float32)
    lm_head = np.empty((vocab_size, hidden_size), dtype=np.float32)
    _load_head(cstr(path), cstr(embed_name), cstr(lm_head_name), vocab_size, hidden_size,
               _ptr(embed, ctypes.c_float), _ptr(lm_head, ctypes.c_float))
    return embed, lm_head


class TrainStats(ctypes.Structure):
    """Mirror of `dflash_train_stats`: a run's last step, as its progress callback sees it."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("step", ctypes.c_int64),
                ("last_step", ctypes.c_int64), ("epoch", ctypes.c_int32),
                ("loss", ctypes.c_double), ("grad_norm", ctypes.c_double),
                ("lr", ctypes.c_double), ("tokens", ctypes.c_int64),
                ("tokens_per_s", ctypes.c_double), ("elapsed_s", ctypes.c_double),
                ("stop_reason", ctypes.c_int32), ("spool", ctypes.c_int32),
                ("spool_wait_s", ctypes.c_double), ("checkpoint_step", ctypes.c_int64),
                ("selector_loss", ctypes.c_double)]


# dflash_train_stop, by value: why dflash_train_run returned (TrainStats.stop_reason).
_STOP_REASONS = ("none", "finished", "max_steps", "requested", "error")


def _run_summary(s, out_dir):
    """train_run's result from the run's TrainStats: the keys of `dflash train`'s JSON summary
    (without launch) and how the run ended, from the fields, never from metrics.jsonl."""
    r = {"steps": s.step, "epoch": s.epoch, "tokens": s.tokens, "final_loss": s.loss,
         "elapsed_s": s.elapsed_s,
         "checkpoint": os.fsdecode(out_dir),
         "checkpoint_step": s.checkpoint_step,
         "stop_reason": _STOP_REASONS[s.stop_reason]
         if 0 <= s.stop_reason < len(_STOP_REASONS) else s.stop_reason}
    if s.spool:  # a spool run's wait for the producer's shards
        r["spool_wait_s"] = s.spool_wait_s
    return r


_TRAIN_PROGRESS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(TrainStats), ctypes.c_void_p)


class TrainRunOptions(ctypes.Structure):
    """Mirror of `dflash_train_run_options`."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t), ("config_path", ctypes.c_char_p),
        ("target_path", ctypes.c_char_p), ("embed_name", ctypes.c_char_p),
        ("lm_head_name", ctypes.c_char_p), ("data_dir", ctypes.c_char_p),
        ("hidden_dir", ctypes.c_char_p), ("out_dir", ctypes.c_char_p),
        ("epochs", ctypes.c_int32), ("batch_size", ctypes.c_int32),
        ("save_every", ctypes.c_int32), ("resume", ctypes.c_int32),
        ("max_steps", ctypes.c_int64), ("bf16", ctypes.c_int32),
        ("trainer", ctypes.POINTER(TrainerOptions)), ("labels", ctypes.c_int32),
        ("final_norm_name", ctypes.c_char_p), ("progress", _TRAIN_PROGRESS),
        ("progress_user", ctypes.c_void_p),
        ("save_every_s", ctypes.c_double), ("allow_settings_change", ctypes.c_int32),
        ("schedule_steps", ctypes.c_int64),
        ("spool_wait_s", ctypes.c_double), ("spool_reuse", ctypes.c_int32),
    ]


_run_defaults = bind("dflash_train_run_options_init",
                     [ctypes.POINTER(TrainRunOptions), ctypes.c_size_t], None)
# The paths of a train_run call (its one argument: byref(TrainRunOptions)) that must exist.
_RUN_PATHS = tuple((lambda args, f=f: getattr(args[0]._obj, f))
                   for f in ("config_path", "target_path", "data_dir", "hidden_dir"))
_train_run = bind("dflash_train_run", [ctypes.POINTER(TrainRunOptions), ctypes.POINTER(TrainStats)],
                  errors=missing_path(*_RUN_PATHS))
_RUN_FIELDS = ("epochs", "batch_size", "save_every", "max_steps", "save_every_s",
               "schedule_steps", "spool_wait_s", "spool_reuse")
# schedule_steps="epochs": DFLASH_SCHEDULE_EPOCHS, the epochs' length even with max_steps.
_SCHEDULE_EPOCHS = -1


def _holds_anything(out_dir):
    """Whether out_dir (a folder or s3:// prefix) holds anything, as `dflash train` checks."""
    path = os.fsdecode(out_dir)
    if "://" not in path:
        return os.path.isdir(path) and any(os.scandir(path))
    from .storage import Storage
    with Storage() as st:
        return bool(st.list(path if path.endswith("/") else path + "/"))


def _run_interruptibly(o, progress):
    """dflash_train_run with Ctrl-C: while it runs (on the main thread), SIGINT only sets a
    flag, which the run's progress callback (after each step) answers; the run saves its state
    and stops, and KeyboardInterrupt is raised here (the CancelledError chained). The callback
    also draws the progress bar to `progress` (None: no bar; True: standard error)."""
    interrupted, bar = [], []
    stats = TrainStats(struct_size=ctypes.sizeof(TrainStats))

    def on_progress(stats, _user):
        s = stats.contents
        if progress is not None:
            if not bar:
                from .progress import Progress
                bar.append(Progress("train", "steps", total=s.last_step,
                                    stream=None if progress is True else progress))
            bar[0].update(s.step, note=f"loss {s.loss:.4f}  {s.tokens_per_s:.0f} tok/s")
        return 1 if interrupted else 0

    o.progress = _TRAIN_PROGRESS(on_progress)
    try:
        old = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    except ValueError:  # not the main thread: Ctrl-C is not this thread's to take
        old = None
    try:
        _train_run(ctypes.byref(o), ctypes.byref(stats))
    except Error as e:
        if interrupted and e.status == "DFLASH_E_CANCELLED":
            raise KeyboardInterrupt(str(e)) from e
        raise
    finally:
        if bar:
            bar[0].close()
        if old is not None:
            signal.signal(signal.SIGINT, old)
    if interrupted:  # after the last step: the run is whole, the interrupt still the caller's
        raise KeyboardInterrupt
    return stats


def train_run(config, target, data_dir, hidden_dir, out_dir, resume=False, bf16=False,
              progress=None, embed_name=None, lm_head_name=None, backend="cpu", labels="data",
              final_norm_name=None, overwrite=False, allow_settings_change=False, **options):
    """Train a drafter end to end (what `dflash train` runs) and return its summary.

    config: a drafter config (path, dict, JSON text or DrafterConfig); target:
    the target checkpoint holding the embedding and LM head; data_dir and
    hidden_dir: the tokenized dataset and its hidden-state store. out_dir gets
    config.json + model.safetensors, train_state/ and metrics.jsonl (one line
    per step). progress: None (silent), True (standard error) or a path, file
    object or descriptor the progress lines are appended to.
    Keyword options: epochs, batch_size, save_every, max_steps, save_every_s, schedule_steps
    (the learning-rate schedule's length: by default max_steps when it ends the run early,
    else the epochs'; "epochs" keeps the epochs' with max_steps), spool_wait_s and
    spool_reuse (a spool:PATH hidden_dir, as `dflash train --spool-wait` and
    `--spool-reuse`), and the trainer options of Trainer (lr, seed, num_anchors, n_threads,
    warmup_ratio, grad_reduce_bf16, dist_timeout_s, ...).
    labels: "data" (the data's next tokens) or "target" (the target's greedy ones: the
    store's target ids, or vLLM's final layer through the target's final norm
    final_norm_name and LM head), as `dflash train --labels`.
    As the command: an out_dir that holds anything is refused (ExistsError) unless resume
    continues the run in it or overwrite=True replaces it; resume with other settings
    (lr, batch_size, num_anchors, warmup_ratio, epochs, ...) than the run's is refused
    (MismatchError naming each change) unless allow_settings_change=True. Ctrl-C
    (KeyboardInterrupt) stops the run after the step in flight with its checkpoint and
    train_state/ saved (resume=True continues it), then raises KeyboardInterrupt; the
    state is also saved every save_every_s seconds (1800; 0: never).
    The summary is a dict of `dflash train`'s summary keys (steps, epoch, tokens, final_loss,
    elapsed_s, checkpoint: out_dir as a str, spool_wait_s for a spool run) from the run's
    stats, with stop_reason ("finished" or "max_steps") and checkpoint_step (the step of the
    checkpoint this call wrote; 0 when a resumed run had no step left to train). It returned
    out_dir before; that is result["checkpoint"] now.
    """
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other")
    warn_generic_blas()
    if not resume and not overwrite and _holds_anything(out_dir):
        raise ExistsError(status_code("DFLASH_E_EXISTS"), f"{os.fsdecode(out_dir)} is not empty (an earlier run?): "
                          "resume=True continues it, overwrite=True replaces it")
    o = TrainRunOptions()
    _run_defaults(ctypes.byref(o), ctypes.sizeof(o))
    topt = TrainerOptions()  # o.trainer points at it: alive until the call returns
    _opts_default(ctypes.byref(topt), ctypes.sizeof(topt))
    o.trainer = ctypes.pointer(topt)
    topt.backend = {"cpu": 0, "cuda": 1}[backend]
    if labels not in ("data", "target"):
        raise ValueError(f"labels must be 'data' or 'target', not {labels!r}")
    o.labels = 1 if labels == "target" else 0
    o.final_norm_name = cstr(final_norm_name)
    for k, v in options.items():
        if k == "schedule_steps" and v == "epochs":
            o.schedule_steps = _SCHEDULE_EPOCHS
        elif k in _RUN_FIELDS:
            setattr(o, k, v)
        elif k in _OPTION_NAMES:
            setattr(topt, k, v)
        else:
            raise TypeError(f"unknown train_run option {k!r}")
    o.target_path, o.data_dir = cstr(target), cstr(data_dir)
    o.hidden_dir, o.out_dir = cstr(hidden_dir), cstr(out_dir)
    o.embed_name, o.lm_head_name = cstr(embed_name), cstr(lm_head_name)
    o.resume, o.bf16 = int(bool(resume)), int(bool(bf16))
    o.allow_settings_change = int(bool(allow_settings_change))
    with tempfile.TemporaryDirectory(prefix="dflash-config-") as tmp:
        if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
            o.config_path = cstr(config)
        else:
            o.config_path = cstr(os.path.join(tmp, "config.json"))
            save_config(config, o.config_path.decode())
        stats = _run_interruptibly(o, progress)
    return _run_summary(stats, out_dir)


class TrainPlanOptions(ctypes.Structure):
    """Mirror of `dflash_train_plan_options`."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("world_size", ctypes.c_int32),
                ("seq_len", ctypes.c_int32), ("num_anchors", ctypes.c_int32),
                ("batch_size", ctypes.c_int32), ("vocab_chunk", ctypes.c_int32),
                ("zero1", ctypes.c_int32), ("gpu_bytes", ctypes.c_uint64),
                ("reserve_bytes", ctypes.c_uint64), ("smem_per_block", ctypes.c_uint64),
                ("pcie", ctypes.c_int32), ("device", ctypes.c_int32),
                ("optimizer", ctypes.c_int32)]


class TrainPlan(ctypes.Structure):
    """Mirror of `dflash_train_plan`: bytes per GPU by term."""
    _fields_ = [("struct_size", ctypes.c_size_t)] + [(name, ctypes.c_uint64) for name in (
        "n_params", "weights", "masters", "moments", "grads", "activations", "frozen", "reserve",
        "total", "gpu_bytes")] + [
        ("attention_rows", ctypes.c_int32), ("attention_key_tile", ctypes.c_int32),
        ("attention_smem", ctypes.c_uint64), ("sequences_per_step", ctypes.c_int32),
        ("device_name", ctypes.c_char * 96)]


_plan_defaults = bind("dflash_train_plan_options_init",
                      [ctypes.POINTER(TrainPlanOptions), ctypes.c_size_t],
                      None)
_plan = bind("dflash_train_plan_compute", [ctypes.POINTER(DrafterConfig),
                                           ctypes.POINTER(TrainPlanOptions),
                                           ctypes.POINTER(TrainPlan)])


def train_plan(config, **options):
    """GPU memory per rank of the CUDA backend for `config` (what `dflash train
    --plan` prints): a dict of byte counts (n_params, weights, masters, moments,
    grads, activations, frozen, reserve, total, gpu_bytes), the attention's
    tiles (attention_rows, attention_key_tile, attention_smem: bytes per block),
    sequences_per_step, "fits" and, when the memory or the attention's shared
    memory does not fit, "reason" (the library's message). Options: world_size,
    seq_len, num_anchors, batch_size (0: the trainer's pick), vocab_chunk, zero1, gpu_bytes,
    reserve_bytes, smem_per_block (the GPU's shared memory per block; 0: not checked), pcie
    (1: GPUs without NVLink, where several ranks take 4 sequences per step), device (>= 0:
    the memory, shared memory and links of that CUDA device; its name in "device_name"),
    optimizer (1: Muon, whose step's workspace joins the activations)."""
    o = TrainPlanOptions()
    _plan_defaults(ctypes.byref(o), ctypes.sizeof(o))
    names = {f for f, _ in TrainPlanOptions._fields_} - {"struct_size"}
    for k, v in options.items():
        if k not in names:
            raise TypeError(f"unknown train_plan option {k!r}")
        setattr(o, k, int(v))
    plan = TrainPlan(struct_size=ctypes.sizeof(TrainPlan))
    out = {}
    try:
        _plan(ctypes.byref(parse_config(config)), ctypes.byref(o), ctypes.byref(plan))
    except Error as e:
        if e.status not in ("DFLASH_E_NOMEM", "DFLASH_E_UNSUPPORTED", "DFLASH_E_NO_DEVICE"):
            raise
        out["reason"] = e.message
    out.update({name: getattr(plan, name) for name, _ in TrainPlan._fields_[1:]})
    out["device_name"] = plan.device_name.decode("utf-8", "replace")
    out["fits"] = "reason" not in out
    return out

# ---- speculative-walk evaluation ------------------------------------------------


class EvalWalk(ctypes.Structure):
    """Mirror of `dflash_eval_walk`."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t), ("max_tokens", ctypes.c_int32),
        ("accuracy", _D), ("step_hist", ctypes.POINTER(ctypes.c_int64)),
        ("sequences", ctypes.c_int64), ("steps", ctypes.c_int64), ("tokens", ctypes.c_int64),
        ("walk_tau", ctypes.c_double), ("walk_tau_se", ctypes.c_double),
        ("positions", ctypes.c_int64), ("position_tau", ctypes.c_double),
        ("position_tau_se", ctypes.c_double),
        ("scored", ctypes.c_int64), ("selector_accuracy", ctypes.c_double),
        ("backbone_accuracy", ctypes.c_double), ("candidate_recall", ctypes.c_double),
        ("labels", ctypes.c_int32),
        ("conf_predicted", _D), ("conf_observed", _D), ("conf_count", ctypes.POINTER(ctypes.c_int64)),
        ("prob_tau", ctypes.c_double), ("prob_tau_se", ctypes.c_double),
        ("conf_ece", ctypes.c_double),
    ]


_I64 = ctypes.POINTER(ctypes.c_int64)
_walk = bind("dflash_trainer_walk", [_P, _SMP, ctypes.c_int32, _I64, _I64, _I32, _I64])
_eval_walk_default = bind("dflash_eval_walk_init", [ctypes.POINTER(EvalWalk), ctypes.c_size_t],
                          None)
_eval_walk = bind("dflash_trainer_eval_walk", [_P, ctypes.c_char_p, ctypes.c_char_p,
                                             ctypes.POINTER(EvalWalk)], errors=missing_path(1, 2))


def walk(trainer, input_ids, loss_mask, hidden, max_tokens=0):
    """The speculative walk on one sequence (dflash_trainer_walk): anchors
    chained as greedy speculative decoding takes them, from the first token
    of each supervised run; each step gains the accepted drafts plus the
    target's token. Returns dict(tokens, steps, tau=tokens/steps,
    accept=int32 [len] (acceptance at every anchor position, -1 elsewhere),
    step_hist=int64 [B] (steps that gained 1..B tokens; DSpark, B drafts a block: [B + 1]))."""
    ids, mask, hid, _ = trainer._inputs(input_ids, loss_mask, hidden, [])
    accept = np.zeros(ids.size, dtype=np.int32)
    hist = np.zeros(trainer._drafts() + 1, dtype=np.int64)
    tokens, steps = ctypes.c_int64(), ctypes.c_int64()
    _walk(trainer._handle(), ctypes.byref(trainer._sample(ids, mask, hid, None)), max_tokens,
          ctypes.byref(tokens), ctypes.byref(steps), _ptr(accept, ctypes.c_int32),
          _ptr(hist, ctypes.c_int64))
    return {"tokens": tokens.value, "steps": steps.value,
            "tau": tokens.value / steps.value if steps.value else 0.0,
            "accept": accept, "step_hist": hist}


def eval_walk(trainer, data_dir, hidden_dir, max_tokens=0, labels="data"):
    """Held-out evaluation (dflash_trainer_eval_walk) over a tokenized dataset
    and its hidden-state store: dict with walk_tau (tokens / verification
    steps, what live greedy speculative decoding gets) and walk_tau_se,
    position_tau (uniform anchors, every position) and position_tau_se, the
    counts, accuracy [B-1] by block position and step_hist [B]; over the
    `scored` positions selector_accuracy (the drafted tokens: DFlash 2's
    selector path), backbone_accuracy (the plain argmax) and candidate_recall
    (the true token among the top-K candidates; None for DFlash 1). labels: "data"
    (drafts compared with the data's next tokens) or "target" (with the store's target ids:
    what greedy verification accepts; the number to compare with live acceptance when the
    held-out answers were sampled at T > 0), as `dflash eval --labels`.

    A DSpark drafter drafts B tokens a block (accuracy [B], step_hist [B + 1]) and adds
    prob_tau / prob_tau_se (the teacher-forced probabilistic tau; None when the store holds
    no target final state), and with the confidence head conf_predicted, conf_observed
    (float64 [B]) and conf_count (int64 [B]): per slot, over the walk's steps that reached
    it, the mean sigmoid(confidence logit) and the fraction accepted, and conf_ece (None
    without the head). A DFlash drafter gives None for all of them."""
    if labels not in ("data", "target"):
        raise ValueError(f"labels must be 'data' or 'target', not {labels!r}")
    B, nd = trainer.block_size, trainer._drafts()
    dspark = bool(trainer.config.dspark)
    acc = np.zeros(nd, dtype=np.float64)
    hist = np.zeros(nd + 1, dtype=np.int64)
    cp, co = np.zeros(B, dtype=np.float64), np.zeros(B, dtype=np.float64)
    cn = np.zeros(B, dtype=np.int64)
    w = EvalWalk()
    _eval_walk_default(ctypes.byref(w), ctypes.sizeof(w))
    w.max_tokens = max_tokens
    w.labels = 1 if labels == "target" else 0
    w.accuracy = _ptr(acc, ctypes.c_double)
    w.step_hist = _ptr(hist, ctypes.c_int64)
    if dspark:
        w.conf_predicted, w.conf_observed = _ptr(cp, ctypes.c_double), _ptr(co, ctypes.c_double)
        w.conf_count = _ptr(cn, ctypes.c_int64)
    _eval_walk(trainer._handle(), cstr(data_dir), cstr(hidden_dir), ctypes.byref(w))
    skip = ("struct_size", "max_tokens", "accuracy", "step_hist", "labels", "conf_predicted",
            "conf_observed", "conf_count")
    out = {f: getattr(w, f) for f, _ in EvalWalk._fields_ if f not in skip}
    out.update(accuracy=acc, step_hist=hist)
    if out["candidate_recall"] < 0:
        out["candidate_recall"] = None  # DFlash 1: no candidates
    for f in ("prob_tau", "prob_tau_se", "conf_ece"):
        if out[f] < 0:
            out[f] = None  # DFlash, no final state, no confidence head
    has_conf = out["conf_ece"] is not None
    out.update(conf_predicted=cp if has_conf else None, conf_observed=co if has_conf else None,
               conf_count=cn if has_conf else None)
    return out


Trainer.walk = walk
Trainer.eval_walk = eval_walk


# ---- block logits --------------------------


_logits = bind("dflash_trainer_logits", [_P, _SMP, _F])


def logits(trainer, input_ids, hidden, anchors):
    """The drafter's logits for whole blocks (dflash_trainer_logits): block n is
    input_ids[anchors[n]] then B-1 mask tokens at positions anchors[n]..+B-1,
    seeing the context before anchors[n]. float32 [n_anchors, B, vocab],
    position 0 included."""
    ids, _, hid, anc = trainer._inputs(input_ids, None, hidden, anchors)
    out = np.zeros((anc.size, trainer.block_size, trainer.config.vocab_size), dtype=np.float32)
    _logits(trainer._handle(), ctypes.byref(trainer._sample(ids, None, hid, anc)),
            _ptr(out, ctypes.c_float))
    return out


Trainer.logits = logits
