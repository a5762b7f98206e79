"""Checkpoints that SGLang and vLLM run as they are.

Neither engine imports without CUDA, so each engine's reading of a checkpoint is
re-stated here from its own code, read (not copied) in the pinned wheels:

- SGLang 0.5.23: sglang/srt/models/dflash.py (DFlashDraftModel.__init__ builds the
  parameters; load_weights maps checkpoint names: q/k/v_proj -> qkv_proj shards,
  gate/up_proj -> gate_up_proj shards, an optional "model." prefix, unknown names
  silently skipped, missing ones never checked), sglang/srt/configs/model_config.py
  (_get_and_verify_dtype: the draft's dtype under --dtype auto is config "dtype",
  float32 when absent, and a float32 config is built in float16),
  sglang/srt/layers/rotary_embedding/factory.py + yarn.py (YaRN: the keys passed
  on are attn_factor, mscale, mscale_all_dim, beta_*; attention_factor is not one).
- vLLM 0.33.0: vllm/model_executor/models/qwen3_dflash.py (DFlashQwen3ForCausalLM:
  every name gets "model." before AutoWeightsLoader, the same stacked q/k/v and
  gate/up shards; embed_tokens/lm_head come from the target), qwen3_dflash2.py
  (attention_conv / mlp_conv: base_kernel [2, taps, H], kernel_projection
  [2 taps H/g, H], built with block_size = 1 + num_speculative_tokens;
  candidate_selector codebooks [V, r], hidden_projection [r, H]),
  vllm/model_executor/layers/rotary_embedding/yarn_scaling_rope.py (attention_factor
  first, then mscale/mscale_all_dim when both are non-zero, then mscale(f)),
  vllm/config/speculative.py (the draft runs in the target's dtype).
- transformers (modeling_rope_utils._compute_yarn_parameters): attention_factor
  first, else mscale/mscale_all_dim when both are truthy, else mscale(f).

The tests fail on a config.json without "dtype" or a YaRN rope_scaling without
mscale/mscale_all_dim (SGLang's scale is then mscale(f) = 1.416 at factor 64 where
libdflash trained with 1.0)."""
import json
import math
import pathlib
import struct

import numpy as np
import pytest

import libdflash

# ---- the engines' YaRN attention scale (the factor on cos/sin, so on q and k) ----


def _m(f, m=1.0):
    return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0


def hf_scale(rs):
    """transformers: attention_factor wins; else the mscale ratio if both are set."""
    f = rs["factor"]
    if rs.get("attention_factor") is not None:
        return rs["attention_factor"]
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return _m(f, rs["mscale"]) / _m(f, rs["mscale_all_dim"])
    return _m(f)


def vllm_scale(rs):
    """vLLM 0.33.0 YaRNScalingRotaryEmbedding: as transformers."""
    f = rs["factor"]
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return _m(f, rs["mscale"]) / _m(f, rs["mscale_all_dim"])
    return _m(f)


def sglang_scale(rs):
    """SGLang 0.5.23 YaRNScalingRotaryEmbedding: the mscale ratio when both keys are
    present (not None), else mscale(f); times attn_factor (default 1). The key
    attention_factor is never read."""
    f = rs["factor"]
    if rs.get("mscale") is not None and rs.get("mscale_all_dim") is not None:
        s = _m(f, rs["mscale"]) / _m(f, rs["mscale_all_dim"])
    else:
        s = _m(f)
    return s * rs.get("attn_factor", 1)


# ---- checkpoints written by libdflash ------------------------------------------

H, V = 32, 41
BASE = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
    "hidden_size": H, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": V,
    "num_target_layers": 12, "block_size": 4, "rope_theta": 50000.0,
    "dflash_config": {"mask_token_id": 40, "target_layer_ids": [2, 6, 9]},
}
# The Kimi K2.x target's YaRN (docs/drafter.md): factor 64 over 4096, mscale 1/1,
# so transformers' attention factor is 1.0.
KIMI_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# A Qwen-style YaRN without mscale: attention factor mscale(4) = 1.1386.
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}


def config(yarn=None, dflash2=False):
    cfg = json.loads(json.dumps(BASE))
    if yarn:
        cfg["rope_scaling"] = dict(yarn)
        cfg["max_position_embeddings"] = int(yarn["factor"] * yarn["original_max_position_embeddings"])
    if dflash2:
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["dflash_config"].update(conv_kernel_size=3, conv_group_size=8, selector_top_k=5,
                                    selector_rank=6)
    return cfg


def save(tmp_path, cfg, bf16):
    rng = np.random.default_rng(3)
    e = rng.standard_normal((V, H)).astype(np.float32)
    d = tmp_path / "ckpt"
    with libdflash.Trainer(cfg, e, e.copy(), seed=1) as t:
        t.save(str(d), bf16=bf16)
    return json.loads((d / "config.json").read_text()), header(d / "model.safetensors")


def header(path):
    """The safetensors header: {name: (dtype, shape)} (format: u64 length + JSON)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    h = json.loads(raw[8:8 + n])
    h.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in h.items()}


# ---- the engines' parameters and name mapping ------------------------------------

STACKED = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]


def engine_params(cfg, prefix):
    """{param name: {shard: shape}} of the draft module both engines build; a
    stacked parameter lists one shape per shard, a plain one under shard None."""
    dc = cfg["dflash_config"]
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    k = len(dc["target_layer_ids"])
    p = {f"{prefix}fc.weight": {None: (h, k * h)}, f"{prefix}hidden_norm.weight": {None: (h,)},
         f"{prefix}norm.weight": {None: (h,)}}
    for n in range(cfg["num_hidden_layers"]):
        ly = f"{prefix}layers.{n}."
        p[ly + "input_layernorm.weight"] = {None: (h,)}
        p[ly + "post_attention_layernorm.weight"] = {None: (h,)}
        p[ly + "self_attn.qkv_proj.weight"] = {"q": (q, h), "k": (kv, h), "v": (kv, h)}
        p[ly + "self_attn.o_proj.weight"] = {None: (h, q)}
        p[ly + "self_attn.q_norm.weight"] = {None: (hd,)}
        p[ly + "self_attn.k_norm.weight"] = {None: (hd,)}
        p[ly + "mlp.gate_up_proj.weight"] = {0: (i, h), 1: (i, h)}
        p[ly + "mlp.down_proj.weight"] = {None: (h, i)}
        if "DFlash2DraftModel" in cfg["architectures"]:
            taps, g = dc["conv_kernel_size"], dc["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                p[f"{ly}{conv}.base_kernel"] = {None: (2, taps, h)}
                p[f"{ly}{conv}.kernel_projection.weight"] = {None: (2 * taps * (h // g), h)}
    if "DFlash2DraftModel" in cfg["architectures"]:
        r, v = dc["selector_rank"], cfg["vocab_size"]
        p[f"{prefix}candidate_selector.predecessor_codebook"] = {None: (v, r)}
        p[f"{prefix}candidate_selector.successor_codebook"] = {None: (v, r)}
        p[f"{prefix}candidate_selector.hidden_projection.weight"] = {None: (r, h)}
    return p


def load(params, tensors, rename):
    """Replay a load_weights loop: (loaded {param: shards}, names the engine skips,
    shape mismatches)."""
    loaded, skipped, bad = {}, [], []
    for name, (_, shape) in tensors.items():
        name2 = rename(name)
        for param, weight, shard in STACKED:
            if f".{weight}." in name2:
                target, key = name2.replace(weight, param), shard
                break
        else:
            target, key = name2, None
        if target not in params or key not in params[target]:
            skipped.append(name)
            continue
        if params[target][key] != shape:
            bad.append((name, shape, params[target][key]))
        loaded.setdefault(target, set()).add(key)
    return loaded, skipped, bad


def sglang_rename(name):
    """dflash.py resolve_param_name: the name, or it without / with "model."; the
    draft module's own names carry no prefix."""
    return name.removeprefix("model.")


def vllm_rename(name):
    """qwen3_dflash.py load_weights: "model." before every name but lm_head / d2t."""
    return name if "lm_head" in name else "model." + name


def check_engine(cfg, tensors, prefix, rename):
    params = engine_params(cfg, prefix)
    loaded, skipped, bad = load(params, tensors, rename)
    missing = [(p, s) for p, shards in params.items() for s in shards
               if s not in loaded.get(p, ())]
    assert not skipped, f"tensors the engine would ignore: {skipped}"
    assert not missing, f"parameters the engine would leave unloaded: {missing}"
    assert not bad, f"mis-shaped tensors: {bad}"


SG_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def sglang_auto_dtype(cfg):
    """model_config.py _get_and_verify_dtype with --dtype auto (not gemma)."""
    d = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return "float16" if d == "float32" else d


ST_DTYPES = {"BF16": "bfloat16", "F32": "float32"}

CASES = [
    pytest.param(None, False, True, id="dflash1-bf16"),
    pytest.param(None, False, False, id="dflash1-f32"),
    pytest.param(KIMI_YARN, False, True, id="dflash1-kimi-yarn-bf16"),
    pytest.param(QWEN_YARN, True, True, id="dflash2-qwen-yarn-bf16"),
    pytest.param(None, True, False, id="dflash2-f32"),
]


@pytest.mark.parametrize("yarn,two,bf16", CASES)
def test_engines_load_every_tensor(tmp_path, yarn, two, bf16):
    cfg, tensors = save(tmp_path, config(yarn, two), bf16)
    check_engine(cfg, tensors, "", sglang_rename)
    check_engine(cfg, tensors, "model.", vllm_rename)
    rs = cfg.get("rope_scaling")
    if rs:  # the factor libdflash trained with, in every engine
        for f in (hf_scale, vllm_scale, sglang_scale):
            assert f(rs) == pytest.approx(rs["attention_factor"], rel=1e-12), (f.__name__, rs)


@pytest.mark.parametrize("yarn,two,bf16", CASES)
def test_dtype_names_the_stored_weights(tmp_path, yarn, two, bf16):
    cfg, tensors = save(tmp_path, config(yarn, two), bf16)
    stored = {ST_DTYPES[d] for d, _ in tensors.values()}
    assert stored == {"bfloat16" if bf16 else "float32"}
    assert cfg.get("dtype") == cfg.get("torch_dtype") == stored.pop()
    # Under --dtype auto SGLang builds a bf16 checkpoint's draft in bf16 (a bf16
    # target's hidden states then enter fc unconverted, as they must); a float32
    # one in float16, which is why its launch line carries --dtype.
    assert sglang_auto_dtype(cfg) == ("bfloat16" if bf16 else "float16")


@pytest.mark.parametrize("yarn,want", [(KIMI_YARN, 1.0), (QWEN_YARN, _m(4.0))],
                         ids=["kimi", "qwen"])
def test_yarn_scale_agrees_across_engines(tmp_path, yarn, want):
    cfg, _ = save(tmp_path, config(yarn), True)
    rs = cfg["rope_scaling"]
    # what libdflash trained with (transformers' reading of the input config)
    assert rs["attention_factor"] == pytest.approx(want, rel=1e-12)
    for name, f in (("transformers", hf_scale), ("vllm", vllm_scale), ("sglang", sglang_scale)):
        assert f(rs) == pytest.approx(want, rel=1e-12), (name, f(rs), rs)
    # The checkpoint reads back as it was trained.
    back = libdflash.train.parse_config(json.dumps(cfg))
    assert back.rope_attention_factor == pytest.approx(want, rel=1e-12)


def test_yarn_factor_1_with_another_scale_is_refused(tmp_path):
    cfg = config({"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
                  "attention_factor": 1.2})
    with pytest.raises(libdflash.Error, match="SGLang"):
        save(tmp_path, cfg, True)


# ---- the serving flags: docs/deployment.md "Serving the checkpoint", `dflash train`'s summary and
# `dflash eval --json` (test_train_cli.py, test_eval_walk.py check the CLI prints these)


def launch(ckpt, block, dtype, dspark=False, pruned=False):
    """vLLM: the method (else guessed from the folder name) and num_speculative_tokens =
    block_size - 1 (vLLM never reads block_size; DFlash 2's convolutions are built with
    1 + num_speculative_tokens). SGLang: DFLASH, the draft path, the block as draft tokens,
    and --dtype bfloat16 for a float32 checkpoint (--dtype auto would build it in float16).
    DSpark (anchor-first: block_size drafts): vLLM's method "dspark" with block_size slots;
    SGLang's DSPARK with gamma + 1 = block_size + 1 draft tokens (gamma =
    speculative_num_draft_tokens - 1), and no SGLang line for a pruned vocabulary (SGLang
    refuses it, test_dspark_engines_read_the_checkpoint)."""
    n = block if dspark else block - 1
    out = {"vllm": "--speculative-config '" + json.dumps(
        {"method": "dspark" if dspark else "dflash", "model": str(ckpt),
         "num_speculative_tokens": n}) + "'"}
    if not pruned:
        out["sglang"] = (f"--speculative-algorithm {'DSPARK' if dspark else 'DFLASH'} "
                         f"--speculative-draft-model-path {ckpt} "
                         f"--speculative-num-draft-tokens {block + 1 if dspark else block}"
                         + ("" if dtype in ("bfloat16", "float16") else " --dtype bfloat16"))
    return out


def test_readme_launch_lines_are_the_checked_ones():
    doc = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "deployment.md").read_text()
    sec = doc[doc.index("## Serving the checkpoint"):]
    end = sec.find("\n## ", 5)
    sec = sec if end < 0 else sec[:end]
    lines = [ln.strip() for ln in sec.splitlines()]
    for dtype in ("bfloat16", "float32"):
        for engine, flags in launch("drafter/", 16, dtype).items():
            assert flags in lines, (engine, dtype, flags)  # the whole line, as printed
        for engine, flags in launch("dspark/", 8, dtype, dspark=True).items():
            assert flags in lines, ("dspark", engine, dtype, flags)


# ---- DSpark (Qwen3DSparkModel, spec/dspark.md section 5) ----------------------------------
#
# Neither engine's DSpark code runs without CUDA either; their reading is re-stated from
# their sources as spec/dspark.md cites them ([VL], [SG]: main, read 2026-12):
# - vLLM vllm/model_executor/models/qwen3_dspark.py: Qwen3DSparkForCausalLM reads the HF
#   config's top-level attributes: markov_rank (required), draft_vocab_size (None: vocab_size),
#   enable_confidence_head and confidence_head_with_markov (both default False: a checkpoint
#   without them loses its confidence head, and one without the second builds a [1, H] head),
#   logit_scale (default 1.0, applied to the LM head and the Markov bias alike). load_weights:
#   t2d skipped, d2t -> draft_id_to_target_id (offsets: target = i + d2t[i]), lm_head as is,
#   every other name under "model."; a reduced vocabulary (draft_vocab_size < the target's)
#   must ship lm_head and d2t; the confidence head is dropped when its weights are absent.
#   markov_w1 [V, r], markov_w2 [V_d, r], confidence_head.proj [1, H + r] with bias.
# - SGLang python/sglang/srt/speculative/dspark_components/dspark_config.py
#   (parse_dspark_draft_config: markov_rank from dspark_config / text_config / the top level,
#   > 0; markov_head_type required then, one of vanilla/gated/rnn; mask_token_id from the same
#   places or dflash_config, below the target vocabulary; speculators_model_type "dspark"
#   marks the speculators convention; gamma = speculative_num_draft_tokens - 1, else
#   block_size) and python/sglang/srt/models/dspark.py (DSparkDraftMixin: the speculators
#   convention refused; VanillaMarkov builds markov_w1 AND markov_w2 over vocab_size; the
#   confidence head proj [1, H + r] with bias, both required once built; names under
#   embed_tokens. / lm_head. / rotary_emb. skipped, the target's LM head used; a markov or
#   confidence name it lacks refused, other unknown names skipped by DFlash's loader).

R = 6
DSPARK = {**BASE, "architectures": ["Qwen3DSparkModel"], "tie_word_embeddings": False,
          "markov_rank": R, "markov_head_type": "vanilla", "enable_confidence_head": True,
          "confidence_head_with_markov": True, "sample_from_anchor": True, "num_anchors": 32}


def dspark_save(tmp_path, vd, bf16):
    cfg = json.loads(json.dumps(DSPARK))
    if vd:
        cfg["draft_vocab_size"] = vd
    rng = np.random.default_rng(5)
    e = rng.standard_normal((V, H)).astype(np.float32)
    d = tmp_path / "dspark"
    with libdflash.Trainer(cfg, e, e.copy(), seed=1) as t:
        if vd:
            t.set_draft_vocab(np.arange(1, V, (V - 1) // vd)[:vd])
        t.save(str(d), bf16=bf16)
    return json.loads((d / "config.json").read_text()), header(d / "model.safetensors")


class Refused(Exception):
    pass


def vllm_dspark(cfg, target_vocab):
    """What qwen3_dspark.py builds from config.json: {param: shape} beyond DFlash's, and
    the logit scale it applies."""
    if "markov_rank" not in cfg:
        raise Refused("vLLM: config has no markov_rank (AttributeError)")
    h, v, r = cfg["hidden_size"], cfg["vocab_size"], cfg["markov_rank"]
    vd = cfg.get("draft_vocab_size") or v
    p = {"model.markov_head.markov_w1.weight": (v, r),
         "model.markov_head.markov_w2.weight": (vd, r), "lm_head.weight": (vd, h)}
    if cfg.get("enable_confidence_head", False):
        width = h + (r if cfg.get("confidence_head_with_markov", False) else 0)
        p["model.confidence_head.proj.weight"] = (1, width)
        p["model.confidence_head.proj.bias"] = (1,)
    if vd < target_vocab:
        p["draft_id_to_target_id"] = (vd,)
    return p, cfg.get("logit_scale", 1.0)


def vllm_dspark_load(cfg, tensors, target_vocab):
    params, scale = vllm_dspark(cfg, target_vocab)
    params.update({k: s[None] for k, s in engine_params(cfg, "model.").items()
                   if None in s})
    stacked = {k: s for k, s in engine_params(cfg, "model.").items() if None not in s}
    names = {}
    for name, (dtype, shape) in tensors.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        names[name] = (dtype, shape)
    vd = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    if vd < target_vocab and ("lm_head.weight" not in names or
                              "draft_id_to_target_id" not in names):
        raise Refused("vLLM: a reduced-vocabulary checkpoint needs lm_head and d2t")
    if "model.confidence_head.proj.weight" not in names:  # vLLM drops the head, silently
        params = {k: v for k, v in params.items() if "confidence_head" not in k}
    if vd >= target_vocab:  # lm_head / embed_tokens shared from the target when absent
        params.pop("lm_head.weight", None)
    loaded, skipped, bad = load({**{k: {None: s} for k, s in params.items()}, **stacked},
                                names, lambda n: n)
    missing = [k for k in list(params) + list(stacked) if k not in loaded]
    return loaded, skipped, bad, missing, scale


def sglang_dspark(cfg, target_vocab):
    """dspark_config.py parse_dspark_draft_config + resolve_runtime_config, and dspark.py's
    modules: ({param: shape} beyond DFlash's, gamma)."""
    dc = cfg.get("dspark_config") or {}
    rank = dc.get("markov_rank", cfg.get("markov_rank", 0)) or 0
    if rank <= 0:
        raise Refused("SGLang: DSpark draft requires markov_rank > 0")
    head = dc.get("markov_head_type", cfg.get("markov_head_type"))
    if head is None:
        raise Refused("SGLang: DSpark requires markov_head_type when markov_rank > 0")
    if str(head).lower() not in ("vanilla", "gated", "rnn"):
        raise Refused(f"SGLang: unsupported markov_head_type {head!r}")
    mask = dc.get("mask_token_id", cfg.get("mask_token_id",
                                           cfg.get("dflash_config", {}).get("mask_token_id")))
    if mask is None or not 0 <= mask < target_vocab:
        raise Refused(f"SGLang: mask_token_id {mask} missing or outside the target vocabulary")
    if cfg.get("speculators_model_type") == "dspark":
        raise Refused("SGLang: the speculators DSpark convention is refused")
    gamma = cfg.get("dflash_config", {}).get("block_size", cfg.get("block_size"))
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    p = {"markov_head.markov_w1.weight": (v, rank), "markov_head.markov_w2.weight": (v, rank)}
    with_markov = cfg.get("confidence_head_with_markov", rank > 0)
    p["confidence_head.proj.weight"] = (1, h + (rank if with_markov else 0))
    p["confidence_head.proj.bias"] = (1,)
    return p, gamma


def sglang_dspark_load(cfg, tensors, target_vocab):
    params, gamma = sglang_dspark(cfg, target_vocab)
    names = {n: t for n, t in tensors.items()
             if not n.startswith(("embed_tokens.", "lm_head.", "rotary_emb."))}
    for n in names:
        if n.startswith(("markov_head.", "confidence_head.")) and n not in params:
            raise Refused(f"SGLang: unexpected DSpark weight {n}")
    all_params = {**{k: {None: s} for k, s in params.items()}, **engine_params(cfg, "")}
    loaded, skipped, bad = load(all_params, names, sglang_rename)
    if bad:  # default_weight_loader asserts the shape
        raise Refused(f"SGLang: mis-shaped {bad}")
    missing = [(k, s) for k, shards in all_params.items() for s in shards
               if s not in loaded.get(k, ())]
    return skipped, missing, gamma


@pytest.mark.parametrize("vd,bf16", [(0, True), (0, False), (20, True), (20, False)],
                         ids=["full-bf16", "full-f32", "pruned-bf16", "pruned-f32"])
def test_dspark_engines_read_the_checkpoint(tmp_path, vd, bf16):
    cfg, tensors = dspark_save(tmp_path, vd, bf16)
    # spec/dspark.md section 5: the keys, in both places, and those never written
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["tie_word_embeddings"] is False
    for where in (cfg, cfg["dflash_config"]):
        assert where["markov_rank"] == R and where["markov_head_type"] == "vanilla"
        assert where["enable_confidence_head"] is True
        assert where["confidence_head_with_markov"] is True
        assert where["sample_from_anchor"] is True and where["num_anchors"] == 32
        assert where.get("draft_vocab_size") == (vd or None)
    for key in ("speculators_model_type", "transformer_layer_config",
                "aux_hidden_state_layer_ids", "logit_scale"):
        assert key not in cfg and key not in cfg["dflash_config"], key
    assert ("d2t" in tensors) == ("t2d" in tensors) == ("lm_head.weight" in tensors) == bool(vd)
    if vd:
        assert tensors["d2t"] == ("I64", (vd,)) and tensors["t2d"] == ("BOOL", (V,))
    assert "embed_tokens.weight" not in tensors

    # vLLM: every tensor lands, with its shape; the heads as trained; no extra scale
    loaded, skipped, bad, missing, scale = vllm_dspark_load(cfg, tensors, V)
    assert not skipped and not bad and not missing, (skipped, bad, missing)
    assert scale == 1.0
    assert "model.confidence_head.proj.weight" in loaded  # not dropped
    # SGLang: the full vocabulary loads (its gamma = block_size when no draft tokens are
    # given); a pruned one is refused (markov_w2 [V_d, r] against its [V, r]), which is why
    # `dflash train` prints no SGLang line for it
    if vd:
        with pytest.raises(Refused, match="mis-shaped.*markov_w2"):
            sglang_dspark_load(cfg, tensors, V)
    else:
        skipped, missing, gamma = sglang_dspark_load(cfg, tensors, V)
        assert not skipped and not missing, (skipped, missing)
        assert gamma == cfg["block_size"]


def test_dspark_engine_rules_refuse_what_libdflash_never_writes(tmp_path):
    """The re-stated rules bite: each key spec/dspark.md section 5 omits or requires,
    changed, is refused or misread by an engine (and refused by libdflash's reader,
    tests/train/test_config.c)."""
    cfg, tensors = dspark_save(tmp_path, 0, True)
    with pytest.raises(Refused, match="speculators"):
        sglang_dspark({**cfg, "speculators_model_type": "dspark"}, V)
    no_head = {k: v for k, v in cfg.items() if k != "markov_head_type"}
    no_head["dflash_config"] = {k: v for k, v in cfg["dflash_config"].items()
                                if k != "markov_head_type"}
    with pytest.raises(Refused, match="markov_head_type"):
        sglang_dspark(no_head, V)
    assert vllm_dspark({**cfg, "logit_scale": 2.0}, V)[1] == 2.0  # would scale the bias too
    # vLLM reads the head flags at the top level only: without them the confidence head is
    # never built, or built [1, H] against our [1, H + r]
    top = {k: v for k, v in cfg.items() if k != "confidence_head_with_markov"}
    loaded, skipped, bad, missing, _ = vllm_dspark_load(top, tensors, V)
    assert bad and "confidence_head" in bad[0][0], bad
    top = {k: v for k, v in cfg.items() if k != "enable_confidence_head"}
    loaded, skipped, bad, missing, _ = vllm_dspark_load(top, tensors, V)
    assert any("confidence_head" in n for n in skipped), skipped
    for key in ("speculators_model_type", "aux_hidden_state_layer_ids", "logit_scale"):
        bad_cfg = {**cfg, key: "dspark" if key == "speculators_model_type" else
                   ([1] if key == "aux_hidden_state_layer_ids" else 2.0)}
        with pytest.raises(libdflash.Error, match=key):
            libdflash.train.parse_config(json.dumps(bad_cfg))
    # a pruned checkpoint without d2t would be refused by vLLM
    pcfg, ptensors = dspark_save(tmp_path / "p", 20, True)
    with pytest.raises(Refused, match="lm_head and d2t"):
        vllm_dspark_load(pcfg, {k: v for k, v in ptensors.items() if k != "d2t"}, V)
