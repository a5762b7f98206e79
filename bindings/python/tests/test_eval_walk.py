"""The speculative walk (libdflash.train.walk / eval_walk, `dflash eval`):
checked against a walk written here in numpy over the drafter's own greedy
predictions (Trainer.predict), on a small world a trained drafter partly
predicts."""
import json
import os
import subprocess

import numpy as np
import pytest

import libdflash
from libdflash.hidden import write_dataset
from libdflash.train import eval_walk, walk
from test_engine_checkpoint import launch

V, H, B = 17, 32, 4


def make_world(root, n=12):
    """Token chains x[t+1] = perm_c[x[t]], code c in the hidden states (as
    test_train_cli.py), with a prompt and two supervised runs per sample,
    and every 5th token replaced by noise so acceptance varies."""
    rng = np.random.default_rng(1)
    perms = [rng.permutation(16) for _ in range(4)]
    codes = rng.standard_normal((4, H)).astype(np.float32)
    samples, hid = [], {}
    for i in range(n):
        S = int(rng.integers(30, 50))
        c = int(rng.integers(4))
        x = [int(rng.integers(16))]
        for t in range(S - 1):
            x.append(int(perms[c][x[-1]]) if t % 5 else int(rng.integers(16)))
        mask = np.zeros(S, np.uint8)
        cut = int(rng.integers(12, S - 10))
        mask[4:cut] = 1
        mask[cut + 3:] = 1
        samples.append((f"s{i}", np.array(x, np.int32), mask))
        hid[f"s{i}"] = codes[c][None] + 0.1 * rng.standard_normal((S, H)).astype(np.float32)
    write_dataset(root / "data", samples)
    with libdflash.HiddenWriter(root / "hidden", num_layers=1, hidden_size=H) as w:
        for sid, h in hid.items():
            w.append(sid, h)
    embed = rng.standard_normal((V, H)).astype(np.float32)
    cfg = {"architectures": ["DFlashDraftModel"], "hidden_size": H, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "vocab_size": V, "num_target_layers": 8, "block_size": B,
           "dflash_config": {"mask_token_id": 16, "target_layer_ids": [3]}}
    return samples, hid, embed, cfg


def trained(samples, hid, embed, cfg, steps=150):
    t = libdflash.Trainer(cfg, embed, embed, seed=0, lr=1e-2, total_steps=steps, n_threads=1)
    for k in range(steps):
        sid, ids, mask = samples[k % len(samples)]
        anchors = np.arange(4, len(ids) - B, dtype=np.int32)
        t.forward_backward(ids, mask, hid[sid], anchors)
        t.step()
    return t


def runs(mask, max_tokens):
    """Maximal runs [s, e) of mask = 1, each cut to max_tokens."""
    out, s = [], 0
    while s < len(mask):
        if not mask[s]:
            s += 1
            continue
        e = s
        while e < len(mask) and mask[e]:
            e += 1
        out.append((s, min(e, s + max_tokens) if max_tokens else e))
        s = e
    return out


def reference(t, ids, mask, hidden, max_tokens=0):
    """Acceptance at every anchor position from single-anchor predictions,
    then the chained walk: (tokens, steps, accept, hits, counts)."""
    accept = np.full(len(ids), -1, np.int32)
    hits, counts = np.zeros(B - 1), np.zeros(B - 1)
    tokens = steps = 0
    for s, e in runs(mask, max_tokens):
        for p in range(s, e - 1):
            pred = t.predict(ids[:e], hidden[:e], [p])[0]
            a = 0
            while a < B - 1 and p + a + 1 < e and pred[a] == ids[p + a + 1]:
                a += 1
            accept[p] = a
            for k in range(1, B):
                if p + k < e:
                    hits[k - 1] += pred[k - 1] == ids[p + k]
                    counts[k - 1] += 1
        p = s
        while p < e - 1:
            gain = min(accept[p] + 1, e - 1 - p)
            tokens, steps, p = tokens + gain, steps + 1, p + gain
    return tokens, steps, accept, hits, counts


def ratio_se(x, n):
    """Delta-method standard error of sum(x) / sum(n) over units."""
    x, n = np.asarray(x, float), np.asarray(n, float)
    r = x.sum() / n.sum()
    return r, np.sqrt(((x - r * n) ** 2).sum() / (len(x) * (len(x) - 1))) / n.mean()


@pytest.mark.parametrize("max_tokens", [0, 9])
def test_walk_matches_a_numpy_walk(tmp_path, max_tokens):
    samples, hid, embed, cfg = make_world(tmp_path)
    with trained(samples, hid, embed, cfg) as t:
        tok, st, px, pn = [], [], [], []
        hits, counts = np.zeros(B - 1), np.zeros(B - 1)
        for sid, ids, mask in samples:
            got = walk(t, ids, mask, hid[sid], max_tokens=max_tokens)
            want = reference(t, ids, mask, hid[sid], max_tokens)
            assert (got["tokens"], got["steps"]) == want[:2], sid
            np.testing.assert_array_equal(got["accept"], want[2])
            assert got["step_hist"].sum() == got["steps"]
            assert (got["step_hist"] * np.arange(1, B + 1)).sum() == got["tokens"]
            tok.append(want[0]), st.append(want[1])
            a = want[2][want[2] >= 0]
            px.append((a + 1).sum()), pn.append(a.size)
            hits += want[3]
            counts += want[4]
        res = eval_walk(t, tmp_path / "data", tmp_path / "hidden", max_tokens=max_tokens)
    tau, se = ratio_se(tok, st)
    ptau, pse = ratio_se(px, pn)
    print(f"max_tokens {max_tokens}: walk tau {tau:.3f} +- {se:.3f} ({sum(st)} steps), "
          f"every-position tau {ptau:.3f} +- {pse:.3f}")
    # The drafter learned something: 3 SEs above an untrained drafter's 1.0 (a fixed
    # threshold such as 1.2 held for one init seed in six); chaining lowers tau.
    assert tau - 3 * se > 1.0 and tau < ptau
    assert (res["tokens"], res["steps"], res["sequences"]) == (sum(tok), sum(st), len(samples))
    assert res["positions"] == sum(pn)
    assert res["walk_tau"] == pytest.approx(tau, rel=1e-12)
    assert res["walk_tau_se"] == pytest.approx(se, rel=1e-9)
    assert res["position_tau"] == pytest.approx(ptau, rel=1e-12)
    assert res["position_tau_se"] == pytest.approx(pse, rel=1e-9)
    np.testing.assert_allclose(res["accuracy"], hits / counts, rtol=1e-12)
    # DFlash 1 drafts the plain argmax: both accuracies are the drafts', no candidates.
    assert res["scored"] == counts.sum()
    assert res["selector_accuracy"] == pytest.approx(hits.sum() / counts.sum(), rel=1e-12)
    assert res["backbone_accuracy"] == res["selector_accuracy"]
    assert res["candidate_recall"] is None


def dflash2(cfg):
    """The same drafter as DFlash 2 (top-4 candidates, rank 8)."""
    cfg = dict(cfg, architectures=["DFlash2DraftModel"])
    cfg["dflash_config"] = dict(cfg["dflash_config"], conv_kernel_size=2, conv_group_size=8,
                                selector_top_k=4, selector_rank=8)
    return cfg


CLI = os.environ.get("DFLASH_CLI")


@pytest.mark.skipif(not CLI, reason="DFLASH_CLI not set (run through meson test)")
@pytest.mark.parametrize("two", [False, True], ids=["dflash1", "dflash2"])
def test_cli_eval_prints_the_walk(tmp_path, two):
    samples, hid, embed, cfg = make_world(tmp_path)
    cfg = dflash2(cfg) if two else cfg
    (tmp_path / "target").mkdir()
    libdflash.write_safetensors(tmp_path / "target" / "model.safetensors",
                             {"model.embed_tokens.weight": embed, "lm_head.weight": embed})
    with trained(samples, hid, embed, cfg) as t:
        t.save(tmp_path / "ckpt")
        t.save(tmp_path / "ckpt16", bf16=True)
        want = eval_walk(t, tmp_path / "data", tmp_path / "hidden", max_tokens=20)
    cmd = [CLI, "eval", "--checkpoint", tmp_path / "ckpt", "--target", tmp_path / "target",
           "--data", tmp_path / "data", "--hidden", tmp_path / "hidden", "--max-tokens", "20"]
    got = json.loads(subprocess.run([str(c) for c in cmd] + ["--json"], capture_output=True,
                                    text=True, check=True).stdout)
    for k in ("walk_tau", "walk_tau_se", "position_tau", "position_tau_se"):
        assert got[k] == pytest.approx(want[k], abs=1e-6), k
    assert (got["steps"], got["tokens"]) == (want["steps"], want["tokens"])
    assert got["scored"] == want["scored"] > 0
    for k in ("selector_accuracy", "backbone_accuracy"):
        assert got[k] == pytest.approx(want[k], abs=1e-6), k
    # the serving flags (docs/deployment.md, "Serving the checkpoint"; test_engine_checkpoint.py)
    assert got["launch"] == launch(tmp_path / "ckpt", B, "float32")
    cmd16 = [str(c) for c in cmd] + ["--json"]
    cmd16[cmd16.index(str(tmp_path / "ckpt"))] = str(tmp_path / "ckpt16")
    got16 = json.loads(subprocess.run(cmd16, capture_output=True, text=True, check=True).stdout)
    assert got16["launch"] == launch(tmp_path / "ckpt16", B, "bfloat16")
    text = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          check=True).stdout
    assert f"walk tau {want['walk_tau']:.4f} +- {want['walk_tau_se']:.4f}" in text
    line = (f"accuracy over every position ({want['scored']}): drafted "
            f"{want['selector_accuracy']:.4f}, backbone argmax {want['backbone_accuracy']:.4f}")
    if two:  # the selector's numbers (checked against z-lab's model in oracle_dflash2.py)
        assert 0 < want["candidate_recall"] <= 1
        assert got["candidate_recall"] == pytest.approx(want["candidate_recall"], abs=1e-6)
        line += f", candidate recall (top-K) {want['candidate_recall']:.4f}"
    else:
        assert got["candidate_recall"] is None and want["candidate_recall"] is None
    assert line + "\n" in text


def dspark(cfg, conf=True):
    """The same backbone as a DSpark drafter (rank 4; spec/dspark.md section 5's keys)."""
    cfg = dict(cfg, architectures=["Qwen3DSparkModel"], markov_rank=4,
               markov_head_type="vanilla", enable_confidence_head=conf,
               confidence_head_with_markov=True, sample_from_anchor=True,
               tie_word_embeddings=False)
    return cfg


@pytest.mark.skipif(not CLI, reason="DFLASH_CLI not set (run through meson test)")
@pytest.mark.parametrize("final", [True, False], ids=["final_state", "no_final_state"])
def test_cli_eval_dspark(tmp_path, final):
    """`dflash eval` on a DSpark drafter: B drafts a block under DFlash's keys, the
    probabilistic tau (null and said so without the store's final state) and the confidence
    calibration, in --json and in the text, equal to eval_walk's."""
    samples, hid, embed, cfg = make_world(tmp_path)
    if final:  # a second store with the target's final state (any [S, H] values)
        rng = np.random.default_rng(3)
        with libdflash.HiddenWriter(tmp_path / "hidden_f", num_layers=1, hidden_size=H,
                                    final_state=True) as w:
            for sid, h in hid.items():
                w.append(sid, h, final_state=rng.standard_normal(h.shape).astype(np.float32))
    store = tmp_path / ("hidden_f" if final else "hidden")
    (tmp_path / "target").mkdir()
    libdflash.write_safetensors(tmp_path / "target" / "model.safetensors",
                                {"model.embed_tokens.weight": embed, "lm_head.weight": embed})
    with libdflash.Trainer(dspark(cfg), embed, embed, seed=0, init_std=0.3, n_threads=1) as t:
        t.save(tmp_path / "ckpt")
        want = eval_walk(t, tmp_path / "data", store)
    assert want["accuracy"].shape == (B,) and want["step_hist"].shape == (B + 1,)
    assert want["step_hist"].sum() == want["steps"] > 0
    assert (want["step_hist"] * np.arange(1, B + 2)).sum() == want["tokens"]
    assert (want["prob_tau"] is not None) == final
    assert want["conf_ece"] is not None and 0 <= want["conf_ece"] <= 1
    assert want["conf_count"][0] == want["steps"]  # every step reaches slot 0
    cmd = [str(c) for c in [CLI, "eval", "--checkpoint", tmp_path / "ckpt", "--target",
                            tmp_path / "target", "--data", tmp_path / "data", "--hidden", store]]
    got = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True,
                                    check=True).stdout)
    assert (got["drafter"], got["drafts_per_block"], got["block_size"]) == ("dspark", B, B)
    # served as DSpark: vLLM's method "dspark" with a draft at each of the B slots, SGLang's
    # DSPARK with a verify window of B + 1
    assert got["launch"] == {
        "vllm": f"--speculative-config '{{\"method\": \"dspark\", \"model\": \"{tmp_path / 'ckpt'}\", "
                f"\"num_speculative_tokens\": {B}}}'",
        "sglang": f"--speculative-algorithm DSPARK --speculative-draft-model-path {tmp_path / 'ckpt'}"
                  f" --speculative-num-draft-tokens {B + 1} --dtype bfloat16"}, got["launch"]
    assert got["walk_tau"] == pytest.approx(want["walk_tau"], abs=1e-6)
    assert got["tokens_per_step_histogram"] == want["step_hist"].tolist()
    assert len(got["accuracy"]) == len(got["position_accuracy"]) == B
    assert got["confidence_count"] == want["conf_count"].tolist()
    assert got["confidence_ece"] == pytest.approx(want["conf_ece"], abs=1e-6)
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert f"walk tau {want['walk_tau']:.4f} +- {want['walk_tau_se']:.4f}" in text
    assert f"confidence ECE {want['conf_ece']:.4f}\n" in text
    if final:
        assert got["probabilistic_tau"] == pytest.approx(want["prob_tau"], abs=1e-6)
        assert 1 <= want["prob_tau"] <= B + 1
        assert (f"probabilistic tau {want['prob_tau']:.4f} +- {want['prob_tau_se']:.4f}"
                in text)
    else:
        assert got["probabilistic_tau"] is None and got["probabilistic_tau_se"] is None
        assert "probabilistic tau unavailable: the store holds no target final state" in text
