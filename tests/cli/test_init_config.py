#!/usr/bin/env python3
"""`dflash init-config` against z-lab's published drafter shapes (docs/drafter.md):
a Qwen3-8B-shaped and a Kimi-K2.6-shaped target config.json (K2.6 nests the text model in
text_config, attends with MLA and uses DeepSeek-style YaRN) give the reference drafters'
layers, target layers, heads, vocabulary and mask token; YaRN's attention factor is the one
transformers derives. Needs DFLASH_CLI."""
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CLI = os.environ.get("DFLASH_CLI")

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": None,
            "max_position_embeddings": 40960, "tie_word_embeddings": False}
KIMI_K26 = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "vision_config": {"hidden_size": 1152},
            "text_config": {"model_type": "kimi_k2", "hidden_size": 7168,
                            "intermediate_size": 18432, "moe_intermediate_size": 2048,
                            "num_hidden_layers": 61, "num_attention_heads": 64,
                            "num_key_value_heads": 64, "qk_nope_head_dim": 128,
                            "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512,
                            "vocab_size": 163840, "rms_norm_eps": 1e-05, "rope_theta": 50000.0,
                            "max_position_embeddings": 262144,
                            "rope_scaling": {"type": "yarn", "factor": 64.0,
                                             "original_max_position_embeddings": 4096,
                                             "beta_fast": 1.0, "beta_slow": 1.0,
                                             "mscale": 1.0, "mscale_all_dim": 1.0}}}


def init(d, target, *extra):
    return subprocess.run([CLI, "init-config", "--target", str(target), *extra], cwd=d,
                          capture_output=True, text=True)


def draft_vocab(d):
    """--arch dspark --draft-vocab N --data DIR: draft_vocab_size N in both places, the kept
    set's coverage printed (it equals the N most frequent supervised tokens' share)."""
    # The dataset is written through the Python package, which loads this build's library:
    # an ASan build's aborts a plain interpreter (no except clause catches that), so a child
    # process tries first.
    probe = subprocess.run([sys.executable, "-c", "import numpy, libdflash"], cwd=d,
                           capture_output=True, text=True)  # not the build folder's .so
    if probe.returncode != 0:
        print("draft vocabulary not checked: the Python package does not load here "
              f"(exit {probe.returncode}): {probe.stderr.strip()[-300:]}")
        return
    import numpy as np
    import libdflash
    (d / "small").mkdir()
    (d / "small" / "config.json").write_text(json.dumps(dict(QWEN3_8B, vocab_size=50)))
    rng = np.random.default_rng(0)
    counts = np.zeros(50, np.int64)
    with libdflash.DatasetWriter(d / "ds") as w:
        for i in range(6):
            ids = rng.integers(0, 30, 40).astype(np.int32)
            mask = (rng.random(40) < 0.5).astype(np.uint8)
            w.add(f"s{i}", ids, mask)
            np.add.at(counts, ids[mask.astype(bool)], 1)
        w.finish()
    r = init(d, d / "small", "-o", "p.json", "--arch", "dspark", "--mask-token-id", "49",
             "--draft-vocab", "10", "--data", str(d / "ds"))
    assert r.returncode == 0, r.stderr
    p = json.loads((d / "p.json").read_text())
    assert p["draft_vocab_size"] == 10 and p["dflash_config"]["draft_vocab_size"] == 10, p
    top = sorted(range(50), key=lambda i: (-counts[i], i))[:10]
    cov = 100.0 * counts[top].sum() / counts.sum()
    assert f"draft vocabulary 10 of 50 tokens, covering {cov:.4f}%" in r.stderr, (cov, r.stderr)
    r = init(d, d / "small", "-o", "p2.json", "--arch", "dspark", "--mask-token-id", "49",
             "--draft-vocab", "51", "--data", str(d / "ds"))
    assert r.returncode == 1 and "draft_vocab_size" in r.stderr, r.stderr
    r = init(d, d / "small", "-o", "p3.json", "--mask-token-id", "49", "--draft-vocab", "10",
             "--data", str(d / "ds"))
    assert r.returncode == 2 and "dspark only" in r.stderr, r.stderr
    r = init(d, d / "small", "-o", "p4.json", "--arch", "dspark", "--mask-token-id", "49",
             "--draft-vocab", "10")
    assert r.returncode == 2 and "go together" in r.stderr, r.stderr
    print("init-config --draft-vocab: OK")


def main():
    if not CLI:
        print("SKIP: needs DFLASH_CLI")
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for name, cfg in (("qwen", QWEN3_8B), ("kimi", KIMI_K26)):
            (d / name).mkdir()
            (d / name / "config.json").write_text(json.dumps(cfg))
        r = init(d, d / "qwen", "-o", "q.json")
        assert r.returncode == 0, r.stderr
        q = json.loads((d / "q.json").read_text())
        want = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "vocab_size": 151936, "num_target_layers": 36, "block_size": 16,
                "rope_theta": 1000000}
        assert {k: q[k] for k in want} == want, q
        assert q["architectures"] == ["DFlashDraftModel"]
        assert q["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
        assert q["dflash_config"]["mask_token_id"] == 151669
        assert q["dflash_config"]["block_size"] == 16 and not q.get("rope_scaling")
        r = init(d, d / "kimi" / "config.json", "-o", "k.json", "--block", "8")
        assert r.returncode == 0, r.stderr
        k = json.loads((d / "k.json").read_text())
        want = {"hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 6,
                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                "vocab_size": 163840, "num_target_layers": 61, "block_size": 8,
                "rope_theta": 50000}
        assert {x: k[x] for x in want} == want, k
        assert k["dflash_config"]["target_layer_ids"] == [1, 12, 24, 35, 47, 58]
        assert k["dflash_config"]["mask_token_id"] == 163838
        rs = k["rope_scaling"]
        assert rs["factor"] == 64 and rs["original_max_position_embeddings"] == 4096
        # transformers' YaRN with mscale == mscale_all_dim: get_mscale(f, 1) / get_mscale(f, 1)
        assert math.isclose(rs["attention_factor"], 1.0), rs
        # Qwen's documented YaRN set-up (factor 4 over 32768 on a 40960-position config):
        # max_position_embeddings made to agree with factor x original, which transformers
        # 4.51-4.55 read instead of the factor; a partial rotary factor is kept.
        yarn = dict(QWEN3_8B, partial_rotary_factor=0.5,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 32768})
        (d / "yarn.json").write_text(json.dumps(yarn))
        r = init(d, d / "yarn.json", "-o", "y.json")
        assert r.returncode == 0, r.stderr
        y = json.loads((d / "y.json").read_text())
        assert y["max_position_embeddings"] == 131072 and y["rope_scaling"]["factor"] == 4
        assert y["partial_rotary_factor"] == 0.5, y
        # Layers and a family-less target.
        r = init(d, d / "qwen", "-o", "q3.json", "--layers", "3")
        assert r.returncode == 0, r.stderr
        assert json.loads((d / "q3.json").read_text())["dflash_config"]["target_layer_ids"] == \
            [1, 17, 33]
        # More drafter layers than distinct target layers: refused, not repeated (it was
        # [1, 1, 1, 2, ...] for 50 layers over an 8-layer target).
        (d / "small.json").write_text(json.dumps(dict(QWEN3_8B, num_hidden_layers=8)))
        r = init(d, d / "small.json", "-o", "s50.json", "--layers", "50")
        assert r.returncode == 1 and "--layers 5 at most" in r.stderr, r.stderr
        assert "repeat target layer 1" in r.stderr and not (d / "s50.json").exists(), r.stderr
        r = init(d, d / "small.json", "-o", "s5.json", "--layers", "5")
        assert r.returncode == 0, r.stderr
        assert json.loads((d / "s5.json").read_text())["dflash_config"]["target_layer_ids"] == \
            [1, 2, 3, 4, 5]
        other = dict(QWEN3_8B, vocab_size=32000, model_type="llama")
        (d / "other.json").write_text(json.dumps(other))
        r = init(d, d / "other.json", "-o", "o.json")
        assert r.returncode == 1 and "--mask-token-id" in r.stderr, r.stderr
        r = init(d, d / "other.json", "-o", "o.json", "--mask-token-id", "31999")
        assert r.returncode == 0, r.stderr
        # Never overwrites; missing target and usage errors are named.
        r = init(d, d / "qwen", "-o", "q.json")
        assert r.returncode == 1 and "exists" in r.stderr
        r = init(d, d / "nowhere", "-o", "n.json")
        assert r.returncode == 1 and "nowhere" in r.stderr
        r = init(d, d / "qwen", "--layers", "zero")
        assert r.returncode == 2 and "--layers" in r.stderr
        # A vocabulary above 2^32 is refused by name, not cut to 32 bits (2^32 + 7 was 7).
        (d / "huge.json").write_text(json.dumps(dict(QWEN3_8B, vocab_size=2**32 + 7)))
        r = init(d, d / "huge.json", "-o", "h.json", "--mask-token-id", "1")
        assert r.returncode == 1 and "vocab_size 4294967303" in r.stderr, r.stderr
        assert not (d / "h.json").exists()
        # DFlash 2: the architecture and its sizes, which the library parses back.
        r = init(d, d / "qwen", "-o", "d2.json", "--arch", "dflash2", "--selector-top-k", "8")
        assert r.returncode == 0 and "DFlash 2" in r.stderr, r.stderr
        d2 = json.loads((d / "d2.json").read_text())
        assert d2["architectures"] == ["DFlash2DraftModel"], d2
        got = {k: d2["dflash_config"].get(k, d2.get(k)) for k in
               ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")}
        assert got == {"conv_kernel_size": 2, "conv_group_size": 16, "selector_top_k": 8,
                       "selector_rank": 256}, d2
        assert {k: d2[k] for k in ("hidden_size", "num_hidden_layers")} == \
            {"hidden_size": 4096, "num_hidden_layers": 5}
        r = init(d, d / "qwen", "-o", "d3.json", "--arch", "dflash3")
        assert r.returncode == 2 and "--arch" in r.stderr
        draft_vocab(d)
    print("init-config: Qwen3-8B and Kimi K2.6 shapes give z-lab's drafter configs: OK")


if __name__ == "__main__":
    main()
