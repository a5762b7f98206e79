"""Oracle: z-lab's reference DFlashDraftModel against libdflash's checkpoints.

For tiny random drafters in several configurations (GQA, sliding + full layers,
YaRN, partial_rotary_factor), libdflash saves a checkpoint (config.json +
model.safetensors, float32) and then:

1. the reference model -- class DFlashDraftModel of PyPI dflash==0.1.0, its
   `import dflash.model` (beside the bindings, now `libdflash`) --
   loads it with from_pretrained and strict key matching (no missing,
   unexpected or mismatched key; load_state_dict(strict=True) as well);
2. its float32 logits for whole blocks equal dflash_trainer_logits: for an
   anchor a the reference gets target_hidden = hidden[:a] at positions
   0..a-1 and the block (token a, then B-1 mask tokens) at a..a+B-1, exactly
   as dflash_generate calls it; anchors include 0 (no context) and the last
   positions of the sequence. Error per block: max|l_c - l_ref| / max|l_ref|,
   bound 1e-5 (float32 on both sides: the difference is summation order,
   ~1e-7..1e-6 here; a wrong mask entry, rope position or norm is 1e-2..1);
3. vLLM speculators 0.9.0's DFlash converter (speculators/convert/dflash,
   z-lab format -> speculators) converts and validates the checkpoint
   against a tiny verifier folder, and the converted draft tensors equal ours.

partial_rotary_factor: the reference model does not implement it. With
default RoPE transformers' Qwen3RotaryEmbedding ignores the key (every dim
turns); with YaRN the tables cover int(head_dim * factor) dims and the
reference's apply_rotary_pos_emb fails on the shape. Those cases run the
reference with transformers' own partial-rotary convention patched in (the
inverse frequencies over the rotated width, and Phi-3's apply_rotary_pos_emb,
which turns q[..., :rot] and passes the rest, as llama.cpp's n_rot does);
the script also shows how far the unpatched reference is.

Needs the second pinned environment (scripts/requirements-ref.txt, made by
scripts/deps.sh at .venv-ref; DFLASH_REF_PYTHON names another interpreter):
it re-runs itself there and exits 77 (skip) when that is absent.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
from refenv import reexec_in_ref_env  # noqa: E402

reexec_in_ref_env(__file__)

import importlib  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402

try:
    import numpy as np  # noqa: E402
    import torch  # noqa: E402
    import transformers  # noqa: E402
    from safetensors.numpy import save_file  # noqa: E402
    from safetensors.torch import load_file  # noqa: E402
except ImportError as exc:  # pragma: no cover
    print(f"skip: the reference environment lacks a package: {exc}")
    sys.exit(77)

sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
lib = importlib.import_module("libdflash")
if not os.path.abspath(lib.__file__).startswith(os.path.join(ROOT, "bindings", "python")):
    print(f"FAIL: imported {lib.__file__}, not libdflash's bindings from this tree")
    sys.exit(1)
libtrain = importlib.import_module(lib.__name__ + ".train")

REL_TOL = 1e-5
ZLAB_VERSION = "0.1.0"
SPECULATORS_VERSION = "0.9.0"


def load_reference_module():
    """z-lab's dflash.model, imported by its own name: libdflash's bindings are
    `libdflash`, so `import dflash` beside them must find z-lab's package (a
    failure here means the bindings shadow it again)."""
    dist = importlib.metadata.distribution("dflash")
    if dist.version != ZLAB_VERSION:
        raise RuntimeError(f"dflash {dist.version} is installed; the oracle pins {ZLAB_VERSION}")
    mod = importlib.import_module("dflash.model")
    path = os.path.realpath(mod.__file__)
    expected = os.path.realpath(str(dist.locate_file("dflash/model.py")))
    if path != expected:
        print(f"FAIL: `import dflash` found {path}, not z-lab's {expected}")
        sys.exit(1)
    return mod, path


# ---- configurations -------------------------------------------------------------

def make_config(H, I, L, nh, nkv, d, V, B, K, n_target=12, theta=10000.0, rope=None,
                layer_types=None, window=None, partial_rotary_factor=None):
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": d,
        "rms_norm_eps": 1e-6, "rope_theta": theta, "rope_scaling": rope,
        "max_position_embeddings": 4096, "vocab_size": V, "num_target_layers": n_target,
        "block_size": B,
        "dflash_config": {"mask_token_id": V - 1, "block_size": B,
                          "target_layer_ids": list(range(1, 1 + 2 * K, 2))},
    }
    if rope:
        cfg["max_position_embeddings"] = int(rope["factor"] * rope["original_max_position_embeddings"])
    if layer_types:
        cfg["layer_types"] = layer_types
        cfg["use_sliding_window"] = True
        cfg["sliding_window"] = window
    if partial_rotary_factor is not None:
        cfg["partial_rotary_factor"] = partial_rotary_factor
    return cfg


def anchors_for(S, B):
    """Anchor 0 (no context), early, middle, and the last positions (blocks
    reaching past the sequence)."""
    return sorted({0, 1, B // 2 + 1, S // 2, S - B, S - 2, S - 1})


CASES = [
    ("GQA 4/2, plain RoPE, B=8",
     make_config(H=64, I=96, L=2, nh=4, nkv=2, d=16, V=211, B=8, K=3), 48),
    ("sliding (window 5) + full layers, GQA 4/1, B=6",
     make_config(H=48, I=64, L=3, nh=4, nkv=1, d=12, V=97, B=6, K=2,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 window=5), 40),
    ("YaRN (theta 5e4, factor 8, original 16, derived attention factor), GQA 8/2, B=16",
     make_config(H=64, I=80, L=2, nh=8, nkv=2, d=8, V=151, B=16, K=2, theta=50000.0,
                 rope={"rope_type": "yarn", "factor": 8.0,
                       "original_max_position_embeddings": 16, "beta_fast": 32.0,
                       "beta_slow": 1.0}), 64),
    ("YaRN with explicit attention factor + sliding layer (window 4), GQA 4/2, B=4",
     make_config(H=32, I=48, L=2, nh=4, nkv=2, d=8, V=73, B=4, K=1, theta=1e6,
                 rope={"type": "yarn", "factor": 4.0, "attention_factor": 1.25,
                       "original_max_position_embeddings": 8},
                 layer_types=["full_attention", "sliding_attention"], window=4), 30),
    ("partial_rotary_factor 0.5 (8 of 16 dims turn), plain RoPE, GQA 4/2, B=8",
     make_config(H=64, I=96, L=2, nh=4, nkv=2, d=16, V=127, B=8, K=2,
                 partial_rotary_factor=0.5), 40),
    ("partial_rotary_factor 0.25 with YaRN, GQA 2/1, B=8",
     make_config(H=32, I=48, L=2, nh=2, nkv=1, d=32, V=89, B=8, K=2, theta=50000.0,
                 rope={"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 16},
                 partial_rotary_factor=0.25), 40),
]


def random_params(trainer, rng):
    P = {}
    for name, shape in trainer._info:
        if len(shape) == 1:
            P[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            P[name] = (rng.standard_normal(shape) / np.sqrt(shape[1]) * 1.5).astype(np.float32)
    return P


# ---- the reference model ----------------------------------------------------------

def patch_partial_rotary(ref_mod, model, cfg):
    """transformers' partial-rotary convention in the reference model (see the
    module docstring): frequencies over the rotated width and Phi-3's rotation
    of q[..., :rot] (the reference slices cos/sin to the block for queries)."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply
    rot = int(cfg["head_dim"] * cfg["partial_rotary_factor"])
    rope = cfg.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") == "default":
        # Qwen3RotaryEmbedding's default ignores partial_rotary_factor.
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
        model.rotary_emb.inv_freq = inv
        model.rotary_emb.original_inv_freq = inv.clone()
    assert model.rotary_emb.inv_freq.shape[0] == rot // 2

    def partial_apply(q, k, cos, sin, unsqueeze_dim=1):
        q_len = q.size(-2)
        q_embed, _ = phi3_apply(q, q, cos[..., -q_len:, :], sin[..., -q_len:, :],
                                unsqueeze_dim=unsqueeze_dim)
        _, k_embed = phi3_apply(k, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return q_embed, k_embed

    ref_mod.apply_rotary_pos_emb = partial_apply


def reference_logits(ref_mod, model, embed, lm_head, ids, hidden, anchors, B, mask_id,
                     ctx_extra=0):
    """One reference forward per block, as dflash_generate drafts it
    (ctx_extra > 0: a wrong context, for the negative control)."""
    head = torch.nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
    head.weight.data = torch.from_numpy(lm_head)
    emb = torch.from_numpy(embed)
    out = []
    with torch.no_grad():
        for a in anchors:
            block = torch.tensor([int(ids[a])] + [mask_id] * (B - 1))
            noise = torch.nn.functional.embedding(block, emb)[None]
            c = min(a + ctx_extra, len(ids))
            ctx = torch.from_numpy(hidden[:c])[None]
            pos = torch.arange(c + B)[None]
            h = model(position_ids=pos, noise_embedding=noise, target_hidden=ctx)
            out.append(model.compute_logits(h, head)[0].numpy())
    return np.stack(out)


def load_reference(ref_mod, ckpt):
    """from_pretrained with strict key matching; returns (model, problems)."""
    problems = []
    model, info = ref_mod.DFlashDraftModel.from_pretrained(
        ckpt, dtype=torch.float32, output_loading_info=True)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(k):
            problems.append(f"from_pretrained {k}: {sorted(info[k])[:8]}")
    sd = load_file(os.path.join(ckpt, "model.safetensors"))
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as exc:
        problems.append(f"load_state_dict(strict=True): {exc}")
    return model.eval(), problems


# ---- speculators' converter -------------------------------------------------------

def import_converter():
    """speculators 0.9.0's DFlash converter. Its package imports FSDP2 names that
    torch 2.5 keeps under torch.distributed._composable.fsdp (public from 2.6):
    they are aliased, nothing else of speculators is touched."""
    dist = importlib.metadata.distribution("speculators")
    if dist.version != SPECULATORS_VERSION:
        raise RuntimeError(f"speculators {dist.version} is installed; the oracle pins "
                           f"{SPECULATORS_VERSION}")
    import torch.distributed.fsdp as fsdp
    if not hasattr(fsdp, "fully_shard"):
        import torch.distributed._composable.fsdp as fsdp2
        fsdp.fully_shard = fsdp2.fully_shard
        fsdp.MixedPrecisionPolicy = fsdp2.MixedPrecisionPolicy
    logging.getLogger("speculators").setLevel(logging.ERROR)
    try:
        from loguru import logger
        logger.remove()
    except ImportError:
        pass
    from speculators.convert.dflash.converter import DFlashConverter
    return DFlashConverter


def write_verifier(folder, cfg, embed, lm_head, rng):
    """A tiny Qwen3 target folder: config.json, and the tensors the converter
    reads from it (embedding, LM head, final norm)."""
    os.makedirs(folder, exist_ok=True)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    conf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": H,
            "intermediate_size": 2 * H, "num_hidden_layers": cfg["num_target_layers"],
            "num_attention_heads": cfg["num_attention_heads"],
            "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
            "vocab_size": V, "max_position_embeddings": cfg["max_position_embeddings"],
            "rms_norm_eps": 1e-6, "rope_theta": cfg["rope_theta"], "tie_word_embeddings": False}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(conf, f)
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": lm_head,
               "model.norm.weight": (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)},
              os.path.join(folder, "model.safetensors"))


def check_converter(Converter, ckpt, verifier, cfg, tmp):
    out = os.path.join(tmp, "speculators")
    Converter().convert(input_path=ckpt, output_path=out, base_model=verifier, validate=True)
    with open(os.path.join(out, "config.json")) as f:
        conv = json.load(f)
    problems = []
    want_ids = [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]
                if i + 1 != cfg["num_target_layers"]]
    if conv.get("aux_hidden_state_layer_ids") != want_ids:
        problems.append(f"aux_hidden_state_layer_ids {conv.get('aux_hidden_state_layer_ids')} "
                        f"!= {want_ids}")
    if conv.get("block_size") != cfg["block_size"]:
        problems.append(f"block_size {conv.get('block_size')} != {cfg['block_size']}")
    ours = load_file(os.path.join(ckpt, "model.safetensors"))
    theirs = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            theirs.update(load_file(os.path.join(out, name)))
    for k, v in ours.items():
        if k not in theirs:
            problems.append(f"converted checkpoint lacks {k}")
        elif not torch.equal(theirs[k].float(), v.float()):
            problems.append(f"converted {k} differs")
    return problems


# ---- one case ---------------------------------------------------------------------

def rel_err(a, b):
    scale = float(np.max(np.abs(b)))
    return float(np.max(np.abs(a - b))) / (scale if scale > 0 else 1.0)


def run_case(ref_mod, Converter, name, cfg, S, seed, control=False):
    rng = np.random.default_rng(seed)
    H, V, B = cfg["hidden_size"], cfg["vocab_size"], cfg["block_size"]
    K = len(cfg["dflash_config"]["target_layer_ids"])
    mask_id = cfg["dflash_config"]["mask_token_id"]
    embed = rng.standard_normal((V, H)).astype(np.float32)
    lm_head = (0.5 * rng.standard_normal((V, H))).astype(np.float32)
    ids = rng.integers(0, V - 1, size=S).astype(np.int32)
    hidden = rng.standard_normal((S, K * H)).astype(np.float32)
    anchors = anchors_for(S, B)
    failures = []
    with tempfile.TemporaryDirectory(prefix="dflash-ref-") as tmp:
        ckpt = os.path.join(tmp, "drafter")
        with libtrain.Trainer(cfg, embed, lm_head, seed=1, n_threads=2) as tr:
            tr.set_parameters(random_params(tr, rng))
            tr.save(ckpt)
            ours = libtrain.logits(tr, ids, hidden, anchors)
        with open(os.path.join(ckpt, "config.json")) as f:
            written = json.load(f)
        if "num_target_layers" not in written:
            failures.append("config.json has no num_target_layers")

        model, problems = load_reference(ref_mod, ckpt)
        failures += problems
        partial = cfg.get("partial_rotary_factor", 1.0) != 1.0
        unpatched = None
        if partial:
            try:
                ref = reference_logits(ref_mod, model, embed, lm_head, ids, hidden, anchors, B,
                                       mask_id)
                unpatched = f"{max(rel_err(ours[i], ref[i]) for i in range(len(anchors))):.2e}"
            except RuntimeError as exc:
                unpatched = "fails (" + str(exc).split("\n")[0][:90] + ")"
            original_apply = ref_mod.apply_rotary_pos_emb
            patch_partial_rotary(ref_mod, model, cfg)
        try:
            ref = reference_logits(ref_mod, model, embed, lm_head, ids, hidden, anchors, B,
                                   mask_id)
        finally:
            if partial:
                ref_mod.apply_rotary_pos_emb = original_apply
        errs = [rel_err(ours[i], ref[i]) for i in range(len(anchors))]
        worst = max(errs)
        if not worst <= REL_TOL:
            bad = [f"anchor {a}: {e:.2e}" for a, e in zip(anchors, errs) if not e <= REL_TOL]
            failures.append(f"logits differ (bound {REL_TOL:g}): " + ", ".join(bad))

        if control:
            # The test must see a one-position mistake: the block also seeing its
            # anchor's own target hidden state (which does not exist yet at inference).
            wrong = reference_logits(ref_mod, model, embed, lm_head, ids, hidden, anchors, B,
                                     mask_id, ctx_extra=1)
            sens = min(rel_err(ours[i], wrong[i]) for i in range(len(anchors))
                       if anchors[i] + 1 <= S)
            if not sens > 100 * REL_TOL:
                failures.append(f"negative control: a context one position too long changes "
                                f"the logits by only {sens:.2e}")
            # bf16 checkpoints load strictly too.
            with libtrain.Trainer(cfg, embed, lm_head, seed=1, n_threads=2) as tr:
                tr.save(os.path.join(tmp, "bf16"), bf16=True)
            failures += [p + " (bf16 checkpoint)"
                         for p in load_reference(ref_mod, os.path.join(tmp, "bf16"))[1]]

        verifier = os.path.join(tmp, "verifier")
        write_verifier(verifier, cfg, embed, lm_head, rng)
        try:
            failures += check_converter(Converter, ckpt, verifier, cfg, tmp)
        except Exception as exc:  # the converter refused the checkpoint
            failures.append(f"speculators converter: {type(exc).__name__}: {exc}")

    status = "ok" if not failures else "FAIL"
    extra = f"; unpatched reference: {unpatched}" if unpatched else ""
    if control and not failures:
        extra += f"; negative control (context 1 too long) {sens:.2e}"
    print(f"{status} {name}: {len(anchors)} blocks at anchors {anchors} (S={S}), max relative "
          f"logit difference {worst:.2e}; strict load, converter ok{extra}"
          if not failures else f"{status} {name}: max relative logit difference {worst:.2e}")
    for f in failures:
        print("   ", f)
    return not failures


def main():
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    ref_mod, path = load_reference_module()
    Converter = import_converter()
    print(f"reference: {path} (dflash {ZLAB_VERSION}), transformers {transformers.__version__}, "
          f"torch {torch.__version__}, speculators {SPECULATORS_VERSION}; libdflash "
          f"{lib.__file__}")
    ok = 0
    for i, (name, cfg, S) in enumerate(CASES):
        ok += run_case(ref_mod, Converter, name, cfg, S, seed=1400 + i, control=i == 0)
    print(f"{ok} passed, {len(CASES) - ok} failed")
    return 0 if ok == len(CASES) else 1


if __name__ == "__main__":
    sys.exit(main())
