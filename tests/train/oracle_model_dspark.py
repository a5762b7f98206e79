"""Oracle: a DSpark drafter through the whole model (backbone, anchor-first rows, Markov and
confidence heads, 0.1 CE + 0.9 L1 + 1.0 BCE) on libdflash's float32 CPU trainer against a
float64 PyTorch autograd written from spec/dspark.md (tests/reference/torch_dspark.py).
Compares the loss and EVERY parameter gradient, with oracle_model.py's measure and bounds
(max|g_c - g_ref| / max|g_ref| <= 1e-4, loss 1e-5 relative), and the greedy chain
(dflash_trainer_propose) token for token.

Pruned draft vocabularies (spec/dspark.md section 4) too: the kept set picked by
dflash_draft_vocab_select equals the spec's rule written here, and the loss (labels outside the
kept set add no CE; L1 against the renormalized teacher; c* from the full-vocabulary target)
and the chain (picked in V_d, mapped to target ids) equal the reference's.

Then the mutation check: the same C result against the reference with one defect each (the
Markov bias dropped, DFlash's label shift, the previous token taken from the label's slot, no
stop-gradient on c*; pruned: c* from the renormalized teacher) must FAIL those bounds, so each is something this oracle catches.

Exit 77 (skip) when torch or numpy is missing.
"""
import sys

from oracle_env import np, torch  # noqa: E402  (numpy, torch or exit 77; the paths)
import torch_dspark as ref  # noqa: E402
from libdflash import Error  # noqa: E402
from libdflash.train import Trainer, draft_vocab_select  # noqa: E402
from oracle_model import make_config, rel_err, GRAD_TOL, LOSS_TOL  # noqa: E402

MUTATIONS = ["no_markov_bias", "dflash_label_shift", "prev_is_label", "no_stop_gradient"]


def dspark_config(rank, conf, **kw):
    cfg = make_config(**kw)
    cfg["architectures"] = ["Qwen3DSparkModel"]
    cfg.update({"markov_rank": rank, "markov_head_type": "vanilla",
                "enable_confidence_head": conf, "confidence_head_with_markov": True,
                "sample_from_anchor": True, "tie_word_embeddings": False})
    return cfg


def random_params(cfg, rng):
    P = {}
    for name, shape in ref.param_shapes(cfg).items():
        if len(shape) == 1:
            P[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            P[name] = (rng.standard_normal(shape) / np.sqrt(shape[1]) * 1.5).astype(np.float32)
    return P


def select_reference(counts, vd):
    """spec/dspark.md section 4, written from the spec: the vd most frequent ids, ties to the
    lower id, filled with the lowest unused ids, ascending."""
    order = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))
    kept = sorted(order[:vd])
    return kept


def reference(cfg, P, tensors, anchors, gamma, mutate=None, kept=None):
    Pt = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in P.items()}
    loss = ref.loss_fn(cfg, Pt, *tensors, anchors, gamma, mutate=mutate, kept=kept)
    loss.backward()
    # a tensor the loss does not reach (the heads without the final state) has gradient 0
    return loss.item(), {k: v.grad.numpy() if v.grad is not None else np.zeros(v.shape)
                         for k, v in Pt.items()}


def compare(loss_c, grads_c, loss_t, grads_t):
    """Failures of the C result against one reference (empty: it matches)."""
    out = []
    lerr = abs(loss_c - loss_t) / abs(loss_t)
    if lerr > LOSS_TOL:
        out.append(f"loss {loss_c} vs {loss_t} (rel {lerr:.2e})")
    worst = (0.0, "")
    for name, g in grads_t.items():
        e = rel_err(grads_c[name], g)
        worst = max(worst, (e, name))
        if not e <= GRAD_TOL:
            out.append(f"grad {name}: rel {e:.2e}")
    return out, (lerr, worst)


def run_case(name, cfg, S, anchors, holes, gamma, with_final, seed, draft_vocab=0):
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    K = len(cfg["dflash_config"]["target_layer_ids"])
    embed = rng.standard_normal((V, H)).astype(np.float32)
    lm_head = (0.5 * rng.standard_normal((V, H))).astype(np.float32)
    ids = rng.integers(0, V - 1, size=S).astype(np.int32)
    mask = np.ones(S, dtype=np.uint8)
    for lo, hi in holes:
        mask[lo:hi] = 0
    hidden = rng.standard_normal((S, K * H)).astype(np.float32)
    final = rng.standard_normal((S, H)).astype(np.float32) if with_final else None
    kept, extra = None, ""
    if draft_vocab:
        # the kept set from the sequence's supervised counts, by the library and the spec
        cfg = dict(cfg, draft_vocab_size=draft_vocab)
        counts = np.bincount(ids[mask.astype(bool)], minlength=V).astype(np.int64)
        kept, cov = draft_vocab_select(counts, draft_vocab)
        if kept.tolist() != select_reference(counts, draft_vocab):
            print(f"FAIL {name}: selection {kept.tolist()} vs {select_reference(counts, draft_vocab)}")
            return False
        t2d = np.zeros(V, dtype=bool)
        t2d[kept] = True
        labels = [int(ids[p]) for (_, p, _, _) in ref.slots(cfg["block_size"], S, mask, anchors,
                                                            gamma if gamma else 4.0)]
        oov = sum(not t2d[x] for x in labels)
        if oov == 0 or oov == len(labels):
            print(f"FAIL {name}: {oov} of {len(labels)} labels outside the kept set (want some)")
            return False
        extra = f", V_d {draft_vocab} (coverage {cov:.3f}, {oov}/{len(labels)} labels OOV)"
    P = random_params(cfg, rng)
    with Trainer(cfg, embed, lm_head, seed=1, loss_gamma=gamma, vocab_chunk=16,
                 n_threads=2) as tr:
        if sorted(tr.names()) != sorted(P):
            print(f"FAIL {name}: tensors {tr.names()} vs the spec's {sorted(P)}")
            return False
        tr.set_parameters(P)
        if kept is not None:
            # a fresh pruned trainer does not train before its kept ids are set
            try:
                tr.forward_backward(ids, mask, hidden, anchors, target_final=final)
                print(f"FAIL {name}: trained before set_draft_vocab")
                return False
            except Error:
                pass
            tr.set_draft_vocab(kept)
            if tr.draft_vocab().tolist() != kept.tolist():
                print(f"FAIL {name}: draft_vocab() does not return the kept ids")
                return False
        loss_c = tr.forward_backward(ids, mask, hidden, anchors, target_final=final)
        grads_c = tr.gradients()
        drafts_c = tr.predict(ids, hidden, anchors)
    f64 = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    tensors = (f64(embed), f64(lm_head), torch.tensor(ids), torch.tensor(mask), f64(hidden),
               None if final is None else f64(final))
    gamma = gamma if gamma != 0 else 4.0  # DSpark's default: DeepSpec's gamma 4 at any B
    loss_t, grads_t = reference(cfg, P, tensors, anchors, gamma, kept=kept)
    failures, (lerr, worst) = compare(loss_c, grads_c, loss_t, grads_t)
    Pt = {k: torch.tensor(v, dtype=torch.float64) for k, v in P.items()}
    drafts_t = ref.greedy_chain(cfg, Pt, tensors[0], tensors[1], tensors[2], tensors[4], anchors,
                                kept=kept)
    if drafts_c.tolist() != drafts_t:
        failures.append(f"greedy chain {drafts_c.tolist()} vs {drafts_t}")
    # Each mutation must be caught (only those this case can see: the stop-gradient and the
    # head need the target's final state and the confidence head).
    caught = []
    muts = MUTATIONS + (["cstar_renormalized"] if kept is not None else [])
    for mut in muts:
        if mut in ("no_stop_gradient", "cstar_renormalized") and not (
                with_final and cfg["enable_confidence_head"]):
            continue
        m_fail, _ = compare(loss_c, grads_c,
                            *reference(cfg, P, tensors, anchors, gamma, mut, kept=kept))
        (caught if m_fail else failures).append(mut if m_fail else f"mutation {mut} not caught")
    status = "ok" if not failures else "FAIL"
    print(f"{status} {name}: loss {loss_c:.6f} (rel err {lerr:.1e}), {len(grads_t)} gradients, "
          f"worst rel err {worst[0]:.2e} ({worst[1]}), drafts {drafts_c.shape}, "
          f"mutations caught: {', '.join(caught)}{extra}")
    for f in failures:
        print("   ", f)
    return not failures


CASES = [
    # name, config, S, anchors, loss-mask holes, gamma, with the target's final state
    ("B=4, rank 6, confidence head, holes end blocks early",
     dspark_config(6, True, H=32, I=48, L=2, nh=4, nkv=2, d=8, V=97, B=4, K=2),
     40, [0, 1, 7, 20, 33, 37, 38], [(10, 14), (30, 31)], 4.0, True),
    ("B=8, rank 8, YaRN, anchors whose block leaves the sequence, default gamma",
     dspark_config(8, True, H=48, I=64, L=2, nh=4, nkv=2, d=16, V=131, B=8, K=3,
                   theta=50000.0,
                   rope={"rope_type": "yarn", "factor": 64.0,
                         "original_max_position_embeddings": 32}),
     30, [0, 3, 11, 22, 26, 28], [(15, 18)], 0.0, True),
    ("B=5, rank 4, no confidence head, sliding layer",
     dspark_config(4, False, H=24, I=32, L=2, nh=4, nkv=2, d=6, V=53, B=5, K=1,
                   layer_types=["sliding_attention", "full_attention"], window=3),
     32, [2, 9, 15, 27, 30], [(20, 22)], 2.5, True),
    ("B=4, CE alone (no target final state)",
     dspark_config(6, True, H=16, I=24, L=1, nh=2, nkv=1, d=8, V=41, B=4, K=1),
     24, [0, 5, 12, 21, 22], [(8, 9)], 4.0, False),
    # pruned draft vocabularies (spec/dspark.md section 4): the kept set picked from the
    # sequence's supervised tokens, some labels outside it
    ("B=4, rank 6, confidence head, pruned V_d 20 of 97",
     dspark_config(6, True, H=32, I=48, L=2, nh=4, nkv=2, d=8, V=97, B=4, K=2),
     40, [0, 1, 7, 20, 33, 37, 38], [(10, 14), (30, 31)], 4.0, True, 20),
    ("B=5, rank 4, no confidence head, pruned V_d 20 of 53",
     dspark_config(4, False, H=24, I=32, L=2, nh=4, nkv=2, d=6, V=53, B=5, K=1,
                   layer_types=["sliding_attention", "full_attention"], window=3),
     32, [2, 9, 15, 27, 30], [(20, 22)], 2.5, True, 20),
    ("B=4, CE alone, pruned V_d 12 of 41",
     dspark_config(6, True, H=16, I=24, L=1, nh=2, nkv=1, d=8, V=41, B=4, K=1),
     24, [0, 5, 12, 21, 22], [(8, 9)], 4.0, False, 12),
]


def main():
    torch.set_num_threads(1)
    ok = sum(run_case(*case[:7], seed=300 + i, draft_vocab=case[7] if len(case) > 7 else 0)
             for i, case in enumerate(CASES))
    print(f"{ok} passed, {len(CASES) - ok} failed")
    return 0 if ok == len(CASES) else 1


if __name__ == "__main__":
    sys.exit(main())
