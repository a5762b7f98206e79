"""An independent PyTorch implementation of the DFlash drafter and its loss,
written from the model description (docs/drafter.md) and the public reference
trainer's conventions, with a dense attention mask and full logits: the
opposite of libdflash's packed, chunked C code, so the two share no shortcut.

Runs in any dtype (the oracles use float64, so the comparison measures the C
float32 rounding error alone).
"""
import math

import torch
import torch.nn.functional as F


def rmsnorm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotary_dims(cfg):
    """int(head_dim * partial_rotary_factor): the leading dims of each head that turn."""
    prf = cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get(
        "partial_rotary_factor") or 1.0
    return int(cfg["head_dim"] * prf)


def rope_inv_freq(cfg, dtype=torch.float64):
    """inv_freq [rot/2] and attention factor, plain or YaRN (Hugging Face's rules,
    over the rotated width rot = rotary_dims(cfg))."""
    d = rotary_dims(cfg)
    base = cfg.get("rope_theta", 10000.0)
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=dtype) / d))
    rs = cfg.get("rope_scaling") or {}
    if (rs.get("rope_type") or rs.get("type") or "default") != "yarn":
        return inv, 1.0
    factor = rs["factor"]
    orig = rs.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 32768)
    beta_fast, beta_slow = rs.get("beta_fast", 32.0), rs.get("beta_slow", 1.0)
    attn = rs.get("attention_factor")
    if attn is None:
        attn = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def corr_dim(rot):
        return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=dtype) - low) / (high - low)).clamp(0, 1)
    extrap = 1 - ramp
    inv = (inv / factor) * (1 - extrap) + inv * extrap
    return inv, attn


def apply_rope(x, pos, inv_freq, attn):
    """x [rows, heads, d] rotated at positions pos [rows] (rotate-half layout) over
    its first 2 * len(inv_freq) dims; the rest pass through (partial rotary)."""
    freqs = pos.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = (emb.cos() * attn)[:, None, :], (emb.sin() * attn)[:, None, :]
    n = 2 * inv_freq.shape[0]
    xr, xp = x[..., :n], x[..., n:]
    half = n // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos.to(x.dtype) + rot * sin.to(x.dtype), xp], dim=-1)


def dflash_mask(anchors, S, B, window=None):
    """Dense [T, S+T] allow-mask: block n, offset j sees context s < anchor
    (window: s >= anchor + j - (W-1)) and its own block (window: causal, left
    bound j - (W-1))."""
    N = len(anchors)
    T = N * B
    m = torch.zeros(T, S + T, dtype=torch.bool)
    for n, a in enumerate(anchors):
        for j in range(B):
            t = n * B + j
            lo = 0 if window is None else max(0, a + j - (window - 1))
            m[t, lo:min(a, S)] = True
            for jj in range(B):
                ok = True
                if window is not None:
                    ok = jj <= j and jj >= j - (window - 1)
                m[t, S + n * B + jj] = ok
    return m


def param_shapes(cfg):
    H, K = cfg["hidden_size"], len(cfg["dflash_config"]["target_layer_ids"])
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d, I = cfg["head_dim"], cfg["intermediate_size"]
    shapes = {"fc.weight": (H, K * H), "hidden_norm.weight": (H,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nh * d, H),
            p + "self_attn.k_proj.weight": (nkv * d, H),
            p + "self_attn.v_proj.weight": (nkv * d, H),
            p + "self_attn.o_proj.weight": (H, nh * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        })
    shapes["norm.weight"] = (H,)
    return shapes


def block_size(cfg):
    return (cfg.get("dflash_config") or {}).get("block_size") or cfg["block_size"]


def final_hidden(cfg, P, embed, input_ids, hidden, anchors):
    """Drafter output after the final norm, [T, H], T = len(anchors) * B."""
    B = block_size(cfg)
    S = input_ids.shape[0]
    eps = cfg.get("rms_norm_eps", 1e-6)
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    d = cfg["head_dim"]
    mask_id = cfg["dflash_config"]["mask_token_id"]
    inv_freq, attn = rope_inv_freq(cfg)
    anchors = [int(a) for a in anchors]
    T = len(anchors) * B

    ctx = rmsnorm(hidden @ P["fc.weight"].T, P["hidden_norm.weight"], eps)
    tokens = torch.tensor([int(input_ids[a]) if j == 0 else mask_id
                           for a in anchors for j in range(B)])
    h = embed[tokens]
    pos_block = torch.tensor([a + j for a in anchors for j in range(B)])
    pos_all = torch.cat([torch.arange(S), pos_block])
    layer_types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        window = cfg.get("sliding_window") if layer_types[i] == "sliding_attention" else None
        allow = dflash_mask(anchors, S, B, window)
        x = rmsnorm(h, P[p + "input_layernorm.weight"], eps)
        q = (x @ P[p + "self_attn.q_proj.weight"].T).view(T, nh, d)
        q = apply_rope(rmsnorm(q, P[p + "self_attn.q_norm.weight"], eps), pos_block, inv_freq, attn)
        kv_in = torch.cat([ctx, x], dim=0)
        k = (kv_in @ P[p + "self_attn.k_proj.weight"].T).view(S + T, nkv, d)
        k = apply_rope(rmsnorm(k, P[p + "self_attn.k_norm.weight"], eps), pos_all, inv_freq, attn)
        v = (kv_in @ P[p + "self_attn.v_proj.weight"].T).view(S + T, nkv, d)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
        scores = scores.masked_fill(~allow[None], float("-inf"))
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, nh * d)
        h = h + o @ P[p + "self_attn.o_proj.weight"].T
        x2 = rmsnorm(h, P[p + "post_attention_layernorm.weight"], eps)
        mlp = F.silu(x2 @ P[p + "mlp.gate_proj.weight"].T) * (x2 @ P[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ P[p + "mlp.down_proj.weight"].T
    return rmsnorm(h, P["norm.weight"], eps)


def position_weights(cfg, loss_mask, anchors, gamma):
    """w [T]: exp(-(k-1)/gamma) * loss_mask[a+k] * (a+k < S), zero at k = 0."""
    B = block_size(cfg)
    S = loss_mask.shape[0]
    w, labels_pos = [], []
    for a in anchors:
        for k in range(B):
            p = int(a) + k
            ok = k >= 1 and p < S and bool(loss_mask[p])
            decay = math.exp(-(k - 1) / gamma) if gamma > 0 else 1.0
            w.append(decay if ok else 0.0)
            labels_pos.append(min(p, S - 1))
    return torch.tensor(w, dtype=torch.float64), torch.tensor(labels_pos)


def loss_fn(cfg, P, embed, lm_head, input_ids, loss_mask, hidden, anchors, gamma):
    hf = final_hidden(cfg, P, embed, input_ids, hidden, anchors)
    logits = hf @ lm_head.T
    w, lp = position_weights(cfg, loss_mask, anchors, gamma)
    ce = F.cross_entropy(logits, input_ids[lp].long(), reduction="none")
    w = w.to(ce.dtype)
    return (ce * w).sum() / w.sum()
