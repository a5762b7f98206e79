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


def launch(ckpt, block, dtype):
    """vLLM: the method (else guessed from the folder name) and num_speculative_tokens =
    block_size - 1 (vLLM never reads block_size; DFlash 2's convolutions are built with
    1 + num_speculative_tokens). SGLang: DFLASH, the draft path, the block as draft tokens,
    and --dtype bfloat16 for a float32 checkpoint (--dtype auto would build it in float16)."""
    return {"vllm": "--speculative-config '" + json.dumps(
                {"method": "dflash", "model": str(ckpt), "num_speculative_tokens": block - 1})
                    + "'",
            "sglang": f"--speculative-algorithm DFLASH --speculative-draft-model-path {ckpt} "
                      f"--speculative-num-draft-tokens {block}"
                      + ("" if dtype in ("bfloat16", "float16") else " --dtype bfloat16")}


def test_readme_launch_lines_are_the_checked_ones():
    doc = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "deployment.md").read_text()
    sec = doc[doc.index("## Serving the checkpoint"):]
    end = sec.find("\n## ", 5)
    sec = sec if end < 0 else sec[:end]
    lines = [ln.strip() for ln in sec.splitlines()]
    for dtype in ("bfloat16", "float32"):
        for engine, flags in launch("drafter/", 16, dtype).items():
            assert flags in lines, (engine, dtype, flags)  # the whole line, as printed
