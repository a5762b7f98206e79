"""An independent PyTorch implementation of the DSpark drafter's objective, written from
spec/dspark.md (sections 1 and 2), on top of torch_drafter.py's DFlash backbone (which the
spec keeps unchanged): anchor-first blocks whose slot k predicts x_{a+k+1}, the vanilla Markov
head z_k = LM(norm(h_k)) + W2 W1[prev_k] with teacher-forced prev_k = x_{a+k}, the confidence
head on [norm(h_k); W1[prev_k]], and L = 0.1 CE + 0.9 L1 + 1.0 BCE(c, c* detached), each
normalised by sum w, w_k = exp(-k / gamma) times the prefix mask.

Dense and per slot, in any dtype (the oracle runs float64). `mutate` names one deliberate
defect, so that the oracle can show its comparison would catch it.
"""
import math

import torch
import torch.nn.functional as F

import torch_drafter as base

ALPHA_CE, ALPHA_L1, ALPHA_CONF = 0.1, 0.9, 1.0


def param_shapes(cfg):
    """DFlash's tensors plus the Markov and (when enabled) confidence heads; W2 has V_d rows
    (cfg's draft_vocab_size when pruned, else V)."""
    H, V, r = cfg["hidden_size"], cfg["vocab_size"], cfg["markov_rank"]
    Vd = cfg.get("draft_vocab_size") or V
    shapes = base.param_shapes(cfg)
    shapes["markov_head.markov_w1.weight"] = (V, r)
    shapes["markov_head.markov_w2.weight"] = (Vd, r)
    if cfg.get("enable_confidence_head"):
        shapes["confidence_head.proj.weight"] = (1, H + r)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def slots(B, S, loss_mask, anchors, gamma, mutate=None):
    """(block row t, label position p, previous-token position, w) of every supervised slot:
    the prefix mask ends a block at its first slot past the sequence or unsupervised."""
    shift = 0 if mutate == "dflash_label_shift" else 1
    out = []
    for n, a in enumerate(anchors):
        for k in range(B):
            p = int(a) + k + shift
            if p >= S or not loss_mask[p]:
                break
            w = math.exp(-k / gamma) if gamma > 0 else 1.0
            prev = p if mutate == "prev_is_label" else p - 1
            out.append((n * B + k, p, prev, w))
    return out


def loss_fn(cfg, P, embed, lm_head, input_ids, loss_mask, hidden, target_final, anchors, gamma,
            mutate=None, kept=None):
    """kept: a pruned draft vocabulary's ascending target ids (spec/dspark.md section 4): the
    drafter's head is lm_head[kept]; a label maps to its index in kept, and one outside it
    adds no CE (its L1 and BCE stay, and its weight stays in sum w); L1 is against the target
    renormalized over kept, c* = sum_kept min(p, q) with q the target over the full vocabulary
    (mutation "cstar_renormalized": c* from the renormalized L1 instead)."""
    if kept is not None:
        return _pruned_loss(cfg, P, embed, lm_head, input_ids, loss_mask, hidden, target_final,
                            anchors, gamma, mutate, torch.as_tensor(kept).long())
    B = base.block_size(cfg)
    S = input_ids.shape[0]
    hf = base.final_hidden(cfg, P, embed, input_ids, hidden, anchors)
    rows = slots(B, S, loss_mask, anchors, gamma, mutate)
    t = torch.tensor([r[0] for r in rows])
    lab = input_ids[torch.tensor([r[1] for r in rows])].long()
    prev = input_ids[torch.tensor([r[2] for r in rows])].long()
    w = torch.tensor([r[3] for r in rows], dtype=hf.dtype)
    x = hf[t]
    e = P["markov_head.markov_w1.weight"][prev]
    z = x @ lm_head.T
    if mutate != "no_markov_bias":
        z = z + e @ P["markov_head.markov_w2.weight"].T
    ce = F.cross_entropy(z, lab, reduction="none")
    total = ALPHA_CE * (w * ce).sum()
    if target_final is not None:
        p = z.softmax(-1)
        # q_k: the target's distribution of x_{a+k+1}, from its state at a + k
        qpos = torch.tensor([r[1] - 1 for r in rows])
        q = (target_final[qpos] @ lm_head.T).softmax(-1)
        l1 = (p - q).abs().sum(-1)
        total = total + ALPHA_L1 * (w * l1).sum()
        if cfg.get("enable_confidence_head"):
            cstar = (1 - 0.5 * l1).clamp(0, 1)
            if mutate != "no_stop_gradient":
                cstar = cstar.detach()
            s = torch.cat([x, e], -1) @ P["confidence_head.proj.weight"][0] + \
                P["confidence_head.proj.bias"][0]
            bce = F.binary_cross_entropy_with_logits(s, cstar, reduction="none")
            total = total + ALPHA_CONF * (w * bce).sum()
    return total / w.sum()


def greedy_chain(cfg, P, embed, lm_head, input_ids, hidden, anchors, kept=None):
    """[n_anchors, B] greedy drafts: d_k = argmax(LM(norm(h_k)) + W2 W1[d_{k-1}]), d_{-1} the
    anchor's token (spec/dspark.md section 6, as llama.cpp drafts at T = 0). Pruned (kept):
    the argmax over the kept rows, mapped to its target id before the next step."""
    B = base.block_size(cfg)
    ids = list(range(cfg["vocab_size"])) if kept is None else [int(k) for k in kept]
    if kept is not None:
        lm_head = lm_head[torch.as_tensor(kept).long()]
    hf = base.final_hidden(cfg, P, embed, input_ids, hidden, anchors)
    W1, W2 = P["markov_head.markov_w1.weight"], P["markov_head.markov_w2.weight"]
    out = []
    for n, a in enumerate(anchors):
        prev, row = int(input_ids[int(a)]), []
        for k in range(B):
            z = hf[n * B + k] @ lm_head.T + W2 @ W1[prev]
            prev = ids[int(torch.argmax(z))]
            row.append(prev)
        out.append(row)
    return out


def _pruned_loss(cfg, P, embed, lm_head, input_ids, loss_mask, hidden, target_final, anchors,
                 gamma, mutate, kept):
    B, V = base.block_size(cfg), cfg["vocab_size"]
    S = input_ids.shape[0]
    t2d = torch.full((V,), -1, dtype=torch.long)
    t2d[kept] = torch.arange(len(kept))
    head = lm_head[kept]
    hf = base.final_hidden(cfg, P, embed, input_ids, hidden, anchors)
    rows = slots(B, S, loss_mask, anchors, gamma, mutate)
    t = torch.tensor([r[0] for r in rows])
    lab = t2d[input_ids[torch.tensor([r[1] for r in rows])].long()]
    prev = input_ids[torch.tensor([r[2] for r in rows])].long()
    w = torch.tensor([r[3] for r in rows], dtype=hf.dtype)
    x = hf[t]
    e = P["markov_head.markov_w1.weight"][prev]
    z = x @ head.T
    if mutate != "no_markov_bias":
        z = z + e @ P["markov_head.markov_w2.weight"].T
    inv = lab >= 0
    ce = F.cross_entropy(z[inv], lab[inv], reduction="none")
    total = ALPHA_CE * (w[inv] * ce).sum()
    if target_final is not None:
        p = z.softmax(-1)
        qpos = torch.tensor([r[1] - 1 for r in rows])
        zt = target_final[qpos] @ lm_head.T
        q = zt[:, kept].softmax(-1)  # the teacher renormalized over the kept rows
        l1 = (p - q).abs().sum(-1)
        total = total + ALPHA_L1 * (w * l1).sum()
        if cfg.get("enable_confidence_head"):
            if mutate == "cstar_renormalized":
                cstar = (1 - 0.5 * l1).clamp(0, 1)
            else:
                qf = zt.softmax(-1)[:, kept]  # over the full vocabulary
                cstar = torch.minimum(p, qf).sum(-1).clamp(0, 1)
            if mutate != "no_stop_gradient":
                cstar = cstar.detach()
            s = torch.cat([x, e], -1) @ P["confidence_head.proj.weight"][0] + \
                P["confidence_head.proj.bias"][0]
            bce = F.binary_cross_entropy_with_logits(s, cstar, reduction="none")
            total = total + ALPHA_CONF * (w * bce).sum()
    return total / w.sum()
