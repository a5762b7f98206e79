"""Oracle: z-lab's reference DFlash2DraftModel against libdflash's DFlash 2 drafters.

For tiny random DFlash 2 drafters (GQA, a sliding layer, conv_kernel_size 1..3,
conv_group_size 8 and 16) libdflash saves a checkpoint (config.json with
architectures ["DFlash2DraftModel"] + float32 model.safetensors) and then:

1. z-lab's DFlash2DraftModel (PyPI dflash==0.1.0, `import dflash.model`) loads
   it with from_pretrained and no missing / unexpected / mismatched key, and
   every tensor of its state_dict equals ours (so no parameter is left at
   torch.empty's garbage);
2. its float32 logits (backbone + the grouped dynamic causal convolutions:
   the candidate selector's rescoring is not part of dflash_trainer_logits)
   equal dflash_trainer_logits for whole blocks, one reference forward per
   block as dflash_generate drafts it, anchors 0 (no context), early, middle
   and near the end; bound 1e-5 relative (max|l_c - l_ref| / max|l_ref|);
3. negative control: the same reference model with its convolutions reset to
   the identity differs from ours by far more than the bound, so the test
   sees the convolutions;
4. identity initialisation: a fresh DFlash 2 trainer's logits equal those of
   a DFlash 1 trainer given the same backbone weights (bound 1e-6 absolute),
   and so do its predictions (the fresh selector adds nothing);
5. a DFlash 2 drafter trains on the CPU backend (forward_backward gives a
   finite loss; its gradients are checked in test_dflash2.c and
   tests/reference/torch_dflash2_selector.py);
6. the candidate selector: greedy dflash_trainer_propose's tokens equal z-lab's
   greedy propose (CandidateSelector.select at temperature 0, walking each
   block from its anchor token) at every drafted position, and differ from
   the plain argmax of the logits at some (so the test sees the rescoring);
7. sampling (dflash_trainer_propose, temperature 8: the random selector's
   scores spread over tens of units): z-lab's select, made to walk the path
   libdflash drew (its _sample_probs replaced by a pick of our token), has
   the same candidates and the same q at every position (bound 2e-5
   absolute; z-lab's q at temperature 10 is far away, the negative
   control); the same seed draws the same tokens, also when the block
   shares the call with other anchors or not, another seed other tokens;
   greedy propose is predict; and the first drafted token's frequencies
   over 600 seeds match its q (4.5 standard errors);
8. evaluation (first config): dflash_trainer_eval_walk's selector accuracy,
   backbone accuracy and candidate recall over a dataset written here equal
   the counts computed from z-lab's model at every anchor position (greedy
   propose, argmax and torch.topk of its logits).

Needs the second pinned environment (.venv-ref, see oracle_reference.py):
it re-runs itself there and exits 77 (skip) when that is absent.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
from refenv import reexec_in_ref_env  # noqa: E402

reexec_in_ref_env(__file__)
sys.path.insert(0, HERE)
import oracle_reference as ref  # noqa: E402  (its helpers: configs, anchors, reference logits)

import tempfile  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

lib, libtrain = ref.lib, ref.libtrain
REL_TOL = 1e-5
IDENTITY_TOL = 1e-6


def make_config(k, g, top_k=8, r=16, **kw):
    cfg = ref.make_config(**kw)
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(conv_kernel_size=k, conv_group_size=g, selector_top_k=top_k,
                                selector_rank=r)
    return cfg


CASES = [
    ("GQA 4/2, k=2, g=16, B=8",
     make_config(2, 16, H=64, I=96, L=2, nh=4, nkv=2, d=16, V=211, B=8, K=3), 48),
    ("GQA 4/1, sliding (window 5) + full, k=3, g=8, B=6",
     make_config(3, 8, H=48, I=64, L=3, nh=4, nkv=1, d=12, V=97, B=6, K=2,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 window=5), 40),
    ("GQA 8/2, k=3, g=16, B=16",
     make_config(3, 16, H=64, I=80, L=2, nh=8, nkv=2, d=8, V=151, B=16, K=2), 64),
    ("MHA 2/2, k=1, g=8, B=4",
     make_config(1, 8, H=32, I=48, L=1, nh=2, nkv=2, d=16, V=73, B=4, K=1), 30),
]


def random_params(trainer, rng):
    """Backbone as oracle_reference; the convolutions well away from the
    identity (base kernels 1 + noise at tap 0, noise elsewhere; dynamic
    kernels of order 1), random selector."""
    P = ref.random_params(trainer, rng)
    for name, shape in trainer._info:
        if name.endswith("base_kernel"):
            b = 0.4 * rng.standard_normal(shape)
            H = trainer.config.hidden_size
            b.reshape(2, -1, H)[:, 0, :] += 1.0
            P[name] = b.astype(np.float32)
        elif "kernel_projection" in name:
            P[name] = (rng.standard_normal(shape) * 0.6 / np.sqrt(shape[1])).astype(np.float32)
        elif name.startswith("candidate_selector."):
            P[name] = rng.standard_normal(shape).astype(np.float32)
    return P


def zlab_name(name):
    return name + ".weight" if name.endswith("_codebook") else name


def load_reference(ref_mod, ckpt, ours):
    problems = []
    model, info = ref_mod.DFlash2DraftModel.from_pretrained(
        ckpt, dtype=torch.float32, output_loading_info=True)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(k):
            problems.append(f"from_pretrained {k}: {sorted(info[k])[:8]}")
    sd = model.state_dict()
    want = {zlab_name(n): v for n, v in ours.items()}
    extra = sorted(set(sd) - set(want) - {"rotary_emb.inv_freq", "rotary_emb.original_inv_freq"})
    if extra:
        problems.append(f"reference tensors libdflash lacks: {extra[:8]}")
    for n, v in want.items():
        if n not in sd:
            problems.append(f"reference lacks {n}")
        elif tuple(sd[n].shape) != v.shape:
            problems.append(f"{n}: shape {tuple(sd[n].shape)} in the reference, ours {v.shape}")
        elif not torch.equal(sd[n], torch.from_numpy(v)):
            problems.append(f"{n} differs after loading")
    return model.eval(), problems


def conv_to_identity(model):
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0, :] = 1.0
                conv.kernel_projection.weight.zero_()


def trains(tr, ids, hidden, anchors):
    """The CPU backend trains a DFlash 2 drafter (block CE + selector loss)."""
    try:
        loss = tr.forward_backward(ids, np.ones(len(ids), np.uint8), hidden, anchors)
    except lib.Error as exc:
        return f"training refused with {exc.status}: {exc.message}"
    if not (np.isfinite(loss) and loss > 0):
        return f"training a DFlash 2 drafter gave loss {loss}"
    return None


def identity_error(cfg, embed, lm_head, ids, hidden, anchors):
    """max |fresh DFlash 2 - DFlash 1 with the same backbone|."""
    cfg1 = dict(cfg, architectures=["DFlashDraftModel"])
    cfg1["dflash_config"] = {k: v for k, v in cfg["dflash_config"].items()
                             if not k.startswith(("conv_", "selector_"))}
    with libtrain.Trainer(cfg, embed, lm_head, seed=3, n_threads=2) as t2, \
            libtrain.Trainer(cfg1, embed, lm_head, seed=9, n_threads=2) as t1:
        p2 = t2.parameters()
        t1.set_parameters({n: p2[n] for n in t1.names()})
        l2 = libtrain.logits(t2, ids, hidden, anchors)
        l1 = libtrain.logits(t1, ids, hidden, anchors)
        err = float(np.max(np.abs(l2 - l1)))
        if not np.array_equal(t2.predict(ids, hidden, anchors), t1.predict(ids, hidden, anchors)):
            err = max(err, float("inf"))  # the fresh selector must not change the argmax path
        return err, trains(t2, ids, hidden, anchors)


def run_case(ref_mod, name, cfg, S, seed, with_eval=False):
    rng = np.random.default_rng(seed)
    H, V, B = cfg["hidden_size"], cfg["vocab_size"], cfg["block_size"]
    K = len(cfg["dflash_config"]["target_layer_ids"])
    mask_id = cfg["dflash_config"]["mask_token_id"]
    embed = rng.standard_normal((V, H)).astype(np.float32)
    lm_head = (0.5 * rng.standard_normal((V, H))).astype(np.float32)
    ids = rng.integers(0, V - 1, size=S).astype(np.int32)
    hidden = rng.standard_normal((S, K * H)).astype(np.float32)
    anchors = ref.anchors_for(S, B)
    failures = []
    with tempfile.TemporaryDirectory(prefix="dflash2-ref-") as tmp:
        ckpt = os.path.join(tmp, "drafter")
        with libtrain.Trainer(cfg, embed, lm_head, seed=1, n_threads=2) as tr:
            tr.set_parameters(random_params(tr, rng))
            tr.save(ckpt)
            ours = libtrain.logits(tr, ids, hidden, anchors)
            our_path = tr.predict(ids, hidden, anchors)
            params = tr.parameters()
        from safetensors.numpy import load_file
        saved = load_file(os.path.join(ckpt, "model.safetensors"))
        model, problems = load_reference(ref_mod, ckpt, saved)
        failures += problems
        with libtrain.Trainer.from_checkpoint(ckpt, _target(tmp, embed, lm_head),
                                              n_threads=2) as back:
            if not np.array_equal(libtrain.logits(back, ids, hidden, anchors), ours):
                failures.append("logits differ after save + from_checkpoint")
            # z-lab's own save_pretrained writes the codebooks without ".weight" too;
            # a file with nn.Embedding's names loads as well.
            from safetensors.numpy import load_file, save_file
            renamed = os.path.join(tmp, "renamed.safetensors")
            save_file({zlab_name(k): v for k, v in
                       load_file(os.path.join(ckpt, "model.safetensors")).items()}, renamed)
            back.set_parameters({n: np.zeros_like(v) for n, v in back.parameters().items()})
            back.load(renamed)
            if not np.array_equal(libtrain.logits(back, ids, hidden, anchors), ours):
                failures.append("logits differ after loading codebooks named .weight")
    refl = ref.reference_logits(ref_mod, model, embed, lm_head, ids, hidden, anchors, B, mask_id)
    errs = [ref.rel_err(ours[i], refl[i]) for i in range(len(anchors))]
    worst = max(errs)
    if not worst <= REL_TOL:
        bad = [f"anchor {a}: {e:.2e}" for a, e in zip(anchors, errs) if not e <= REL_TOL]
        failures.append(f"logits differ (bound {REL_TOL:g}): " + ", ".join(bad))
    ref_path = reference_paths(model, embed, lm_head, ids, hidden, anchors, B, mask_id)
    wrong = int(np.sum(our_path != ref_path))
    if wrong:
        failures.append(f"selector: {wrong} of {our_path.size} greedy tokens differ from z-lab's "
                        f"propose")
    rescored = int(np.sum(ref_path != np.argmax(ours[:, 1:], axis=-1)))
    if not rescored:
        failures.append("negative control: the selector's path equals the logits' argmax")
    with libtrain.Trainer(cfg, embed, lm_head, seed=1, n_threads=2) as tr:
        tr.set_parameters(params)
        sampled, q_worst, q_control = sampling_failures(
            ref_mod, tr, model, embed, lm_head, ids, hidden, anchors, B, mask_id,
            cfg["dflash_config"]["selector_top_k"])
        failures += sampled
        if with_eval:
            failures += eval_failures(tr, model, embed, lm_head, B, mask_id, cfg, rng)
    conv_to_identity(model)
    plain = ref.reference_logits(ref_mod, model, embed, lm_head, ids, hidden, anchors, B, mask_id)
    sens = min(ref.rel_err(ours[i], plain[i]) for i in range(len(anchors)))
    if not sens > 100 * REL_TOL:
        failures.append(f"negative control: identity convolutions change the logits by only "
                        f"{sens:.2e}")
    ident, train_err = identity_error(cfg, embed, lm_head, ids, hidden, anchors)
    if not ident <= IDENTITY_TOL:
        failures.append(f"fresh DFlash 2 vs DFlash 1 with the same backbone: max abs logit "
                        f"difference {ident:.2e} > {IDENTITY_TOL:g}")
    if train_err:
        failures.append(train_err)
    status = "ok" if not failures else "FAIL"
    print(f"{status} {name}: {len(anchors)} blocks at anchors {anchors} (S={S}), max relative "
          f"logit difference {worst:.2e}; identity convolutions in the reference {sens:.2e} "
          f"away; fresh DFlash 2 vs DFlash 1 max abs {ident:.2e}; selector path "
          f"{our_path.size - wrong}/{our_path.size} equal ({rescored} differ from the argmax); "
          f"sampled q within {q_worst:.2e} of z-lab's (temperature {CONTROL_T:g}: {q_control:.2e} "
          f"away)")
    for f in failures:
        print("   ", f)
    return not failures


def output_head(lm_head):
    head = torch.nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
    head.weight.data = torch.from_numpy(lm_head)
    return head


def reference_hidden(model, embed, ids, hidden, a, B, mask_id):
    """z-lab's final hidden states of block positions 1..B-1 after anchor a
    (as dflash_generate drafts) and the anchor token [1]."""
    block = torch.tensor([int(ids[a])] + [mask_id] * (B - 1))
    noise = torch.nn.functional.embedding(block, torch.from_numpy(embed))[None]
    ctx = torch.from_numpy(hidden[:a])[None]
    h = model(position_ids=torch.arange(a + B)[None], noise_embedding=noise,
              target_hidden=ctx)[:, 1 - B:, :]
    return h, block[None, 0]


def reference_paths(model, embed, lm_head, ids, hidden, anchors, B, mask_id):
    """z-lab's greedy propose for each block, as dflash_generate calls it."""
    head = output_head(lm_head)
    out = []
    with torch.no_grad():
        for a in anchors:
            h, anchor = reference_hidden(model, embed, ids, hidden, a, B, mask_id)
            path, _, _ = model.propose(h, anchor, head, 0.0)
            out.append(path[0].numpy())
    return np.stack(out).astype(np.int32)


# The random selector's scores spread over tens of units (codebooks N(0, 1)),
# so a temperature of that order keeps q from being one-hot.
SAMPLE_T, CONTROL_T, PROB_TOL, FREQ_DRAWS = 8.0, 10.0, 2e-5, 600


def zlab_q_along(ref_mod, model, h, anchor, head, K, path, temperature):
    """z-lab's select at `temperature`, each draw replaced by the index of
    our token `path[i]` among its candidates (torch.topk, sorted=False, as
    select takes them): its (path, candidates, q) along our path."""
    with torch.no_grad():
        _, zc = torch.topk(model.compute_logits(h, head), K, dim=-1, sorted=False)
    step = iter(range(len(path)))

    def pick(q):
        i = next(step)
        where = (zc[0, i] == int(path[i])).nonzero()
        if not len(where):
            raise AssertionError(f"position {i}: our token {int(path[i])} is not among z-lab's "
                                 f"candidates")
        return where[0]

    real = ref_mod._sample_probs
    ref_mod._sample_probs = pick
    try:
        with torch.no_grad():
            return model.propose(h, anchor, head, temperature)
    finally:
        ref_mod._sample_probs = real


def q_error(ours_c, ours_q, cand, q):
    """max |q_ours - q_zlab| by token, or inf when the candidate sets differ."""
    theirs = dict(zip(cand.tolist(), q.tolist()))
    mine = dict(zip(ours_c.tolist(), ours_q.tolist()))
    if set(theirs) != set(mine):
        return float("inf")
    return max(abs(mine[t] - theirs[t]) for t in mine)


def sampling_failures(ref_mod, tr, model, embed, lm_head, ids, hidden, anchors, B, mask_id, K):
    """Item 7 of the docstring; returns (failures, worst q error, control)."""
    failures = []
    out = tr.propose(ids, hidden, anchors, temperature=SAMPLE_T, seed=11)
    again = tr.propose(ids, hidden, anchors, temperature=SAMPLE_T, seed=11)
    part = tr.propose(ids, hidden, anchors[1::2], temperature=SAMPLE_T, seed=11)
    other = tr.propose(ids, hidden, anchors, temperature=SAMPLE_T, seed=12)
    if not (np.array_equal(out["tokens"], again["tokens"]) and
            np.array_equal(out["probs"], again["probs"])):
        failures.append("sampling: the same seed drew other tokens")
    if not np.array_equal(part["tokens"], out["tokens"][1::2]):
        failures.append("sampling: a block's draw depends on the other anchors of the call")
    if np.array_equal(other["tokens"], out["tokens"]):
        failures.append("sampling: seeds 11 and 12 drew the same tokens")
    if not np.array_equal(tr.propose(ids, hidden, anchors)["tokens"],
                          tr.predict(ids, hidden, anchors)):
        failures.append("propose at temperature 0 differs from predict")
    head, worst, control = output_head(lm_head), 0.0, float("inf")
    for bi, a in enumerate(anchors):
        with torch.no_grad():
            h, anchor = reference_hidden(model, embed, ids, hidden, a, B, mask_id)
        for T in (SAMPLE_T, CONTROL_T):
            path, cand, q = zlab_q_along(ref_mod, model, h, anchor, head, K, out["tokens"][bi],
                                         T)
            if T == SAMPLE_T and not np.array_equal(path[0].numpy(), out["tokens"][bi]):
                failures.append(f"sampling: z-lab's select left our path at anchor {a}")
            errs = [q_error(out["candidates"][bi, i], out["probs"][bi, i], cand[0, i], q[0, i])
                    for i in range(B - 1)]
            if T == SAMPLE_T:
                worst = max(worst, max(errs))
            else:
                control = min(control, max(errs))
    if not worst <= PROB_TOL:
        failures.append(f"sampling: q differs from z-lab's by {worst:.2e} (bound {PROB_TOL:g})")
    if not control > 100 * PROB_TOL:
        failures.append(f"negative control: z-lab's q at temperature {CONTROL_T:g} is only "
                        f"{control:.2e} from ours at {SAMPLE_T:g}")
    return failures + frequency_failures(tr, ids, hidden, int(anchors[-2])), worst, control


def frequency_failures(tr, ids, hidden, a):
    """The first drafted token over FREQ_DRAWS seeds against its q (the same
    for every seed: its predecessor is the anchor's token)."""
    first = [tr.propose(ids, hidden, [a], temperature=SAMPLE_T, seed=s) for s in
             range(FREQ_DRAWS)]
    cand, q = first[0]["candidates"][0, 0], first[0]["probs"][0, 0].astype(np.float64)
    drawn = np.array([f["tokens"][0, 0] for f in first])
    print(f"    sampling at anchor {a}: first drafted token's q max {q.max():.3f} over {q.size} "
          f"candidates; {len(set(drawn.tolist()))} distinct tokens drawn in {FREQ_DRAWS} seeds")
    bad = []
    for c, p in zip(cand, q):
        freq = float(np.mean(drawn == c))
        if abs(freq - p) > 4.5 * np.sqrt(p * (1 - p) / FREQ_DRAWS) + 1.0 / FREQ_DRAWS:
            bad.append(f"token {c}: drawn {freq:.3f}, q {p:.3f}")
    if not np.all(np.isin(drawn, cand)):
        bad.append("a drawn token is not a candidate")
    return [f"sampling frequencies at anchor {a} over {FREQ_DRAWS} seeds: " + "; ".join(bad)] \
        if bad else []


def bf16_exact(a):
    """float32 values a bf16 hidden-state store keeps exactly."""
    return (np.ascontiguousarray(a, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


def eval_reference(model, embed, lm_head, samples, hid, B, mask_id, K):
    """Counts over every scored position (anchors p in [s, e-1) of each
    supervised run, block positions k with p + k < e) from z-lab's model:
    scored, greedy-propose hits, argmax hits, true token in torch.topk."""
    head, n = output_head(lm_head), np.zeros(4, np.int64)
    with torch.no_grad():
        for sid, ids, mask in samples:
            for s, e in runs(mask):
                for p in range(s, e - 1):
                    h, anchor = reference_hidden(model, embed, ids, hid[sid], p, B, mask_id)
                    logits = model.compute_logits(h, head)[0]
                    path = model.propose(h, anchor, head, 0.0)[0][0]
                    top = torch.topk(logits, K, dim=-1).indices
                    for k in range(1, min(B, e - p)):
                        y = int(ids[p + k])
                        n += [1, int(path[k - 1]) == y, int(torch.argmax(logits[k - 1])) == y,
                              bool((top[k - 1] == y).any())]
    return n


def runs(mask):
    out, s = [], 0
    while s < len(mask):
        if not mask[s]:
            s += 1
            continue
        e = s
        while e < len(mask) and mask[e]:
            e += 1
        out.append((s, e))
        s = e
    return out


def eval_failures(tr, model, embed, lm_head, B, mask_id, cfg, rng):
    """Item 8: dflash_trainer_eval_walk's new fields against eval_reference, on
    samples whose supervised tokens follow the drafter's own greedy path in
    part (so the accuracies are neither 0 nor 1)."""
    import libdflash
    from libdflash.hidden import write_dataset
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    Kh, K = len(cfg["dflash_config"]["target_layer_ids"]), cfg["dflash_config"]["selector_top_k"]
    samples, hid = [], {}
    for i in range(3):
        S = 24 + 5 * i
        ids = rng.integers(0, V - 1, size=S).astype(np.int32)
        h = bf16_exact(rng.standard_normal((S, Kh * H)))
        for p in range(4, S - B, B - 1):  # plant the drafter's own drafts (acceptance > 0)
            ids[p + 1:p + B] = tr.predict(ids, h, [p])[0][: S - p - 1]
        mask = np.zeros(S, np.uint8)
        mask[3:S - 6], mask[S - 4:] = 1, 1
        samples.append((f"s{i}", ids, mask))
        hid[f"s{i}"] = h
    with tempfile.TemporaryDirectory(prefix="dflash2-eval-") as tmp:
        write_dataset(os.path.join(tmp, "data"), samples)
        with libdflash.HiddenWriter(os.path.join(tmp, "hidden"), num_layers=Kh,
                                    hidden_size=H) as w:
            for sid, h in hid.items():
                w.append(sid, h)
        got = tr.eval_walk(os.path.join(tmp, "data"), os.path.join(tmp, "hidden"))
    n = eval_reference(model, embed, lm_head, samples, hid, B, mask_id, K)
    want = {"scored": int(n[0]), "selector_accuracy": n[1] / n[0],
            "backbone_accuracy": n[2] / n[0], "candidate_recall": n[3] / n[0]}
    print(f"    eval: {n[0]} positions scored; selector accuracy {got['selector_accuracy']:.4f} "
          f"(z-lab {want['selector_accuracy']:.4f}), backbone {got['backbone_accuracy']:.4f} "
          f"(z-lab {want['backbone_accuracy']:.4f}), candidate recall "
          f"{got['candidate_recall']:.4f} (z-lab {want['candidate_recall']:.4f})")
    bad = [f"{k} {got[k]} != {v}" for k, v in want.items() if not abs(got[k] - v) < 1e-12]
    if len({round(v, 9) for k, v in want.items() if k != "scored"}) < 3:
        bad.append("negative control: selector accuracy, backbone accuracy and recall "
                   "coincide, the test cannot tell them apart")
    return [f"eval: {'; '.join(bad)}"] if bad else []


def _target(tmp, embed, lm_head):
    from safetensors.numpy import save_file
    path = os.path.join(tmp, "target.safetensors")
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}, path)
    return path


def main():
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    ref_mod, path = ref.load_reference_module()
    print(f"reference: {path} (dflash {ref.ZLAB_VERSION}) DFlash2DraftModel, transformers "
          f"{transformers.__version__}, torch {torch.__version__}; libdflash {lib.__file__}")
    ok = 0
    for i, (name, cfg, S) in enumerate(CASES):
        ok += run_case(ref_mod, name, cfg, S, seed=1800 + i, with_eval=i == 0)
    print(f"{ok} passed, {len(CASES) - ok} failed")
    return 0 if ok == len(CASES) else 1


if __name__ == "__main__":
    sys.exit(main())
