"""DSpark's pruned draft vocabularies (spec/dspark.md sections 4-5): the selection against a
reference written from the spec (ties, fill), the dataset's supervised counts, the checkpoint's
d2t / t2d / lm_head.weight written, read back and each malformed table refused by name, and
training with a pruned vocabulary (loss finite and falling, labels outside it dropped)."""
import json

import numpy as np
import pytest

import libdflash
from libdflash import train
from libdflash.safetensors import SafeTensors, write_safetensors

V, H, VD = 61, 16, 24

CFG = {
    "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
    "hidden_size": H, "intermediate_size": 24, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": V,
    "num_target_layers": 12, "block_size": 4, "tie_word_embeddings": False,
    "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": [2, 6]},
    "markov_rank": 6, "markov_head_type": "vanilla", "enable_confidence_head": True,
    "confidence_head_with_markov": True, "sample_from_anchor": True,
    "draft_vocab_size": VD,
}


def select_reference(counts, vd):
    """Written from the spec: the vd most frequent ids (ties: the lower id), filled with the
    lowest unused ids, ascending."""
    used = sorted((i for i in range(len(counts)) if counts[i] > 0),
                  key=lambda i: (-counts[i], i))[:vd]
    fill = [i for i in range(len(counts)) if i not in set(used)][:vd - len(used)]
    return sorted(used + fill)


@pytest.mark.parametrize("seed", range(8))
def test_selection_matches_the_spec(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 300))
    # few distinct counts (many ties) and many zeros (the fill)
    counts = rng.integers(0, 4, n) * (rng.random(n) < 0.4)
    vd = int(rng.integers(1, n + 1))
    kept, cov = train.draft_vocab_select(counts, vd)
    assert kept.tolist() == select_reference(counts.tolist(), vd)
    total = counts.sum()
    assert cov == pytest.approx(counts[kept].sum() / total if total else 0.0, rel=1e-12)


def test_selection_ties_fill_and_refusals():
    counts = np.array([0, 5, 3, 5, 0, 3, 1, 0], dtype=np.int64)
    # 5, 5 (ids 1, 3), then the tie at 3 goes to id 2 before 5
    assert train.draft_vocab_select(counts, 3)[0].tolist() == [1, 2, 3]
    # every seen id, then the lowest unused ones (0, 4)
    kept, cov = train.draft_vocab_select(counts, 7)
    assert kept.tolist() == [0, 1, 2, 3, 4, 5, 6] and cov == 1.0
    kept, cov = train.draft_vocab_select(np.zeros(5, np.int64), 2)
    assert kept.tolist() == [0, 1] and cov == 0.0
    with pytest.raises(libdflash.Error, match="draft_vocab_size 9 must be in 1..vocab_size 8"):
        train.draft_vocab_select(counts, 9)
    with pytest.raises(libdflash.Error, match=r"counts\[2\] is negative"):
        train.draft_vocab_select(np.array([1, 1, -1], np.int64), 2)


def test_dataset_counts_and_selection(tmp_path):
    rng = np.random.default_rng(3)
    want = np.zeros(V, np.int64)
    with libdflash.DatasetWriter(tmp_path / "ds") as w:
        for i in range(12):
            ids = rng.integers(0, 20, 30).astype(np.int32)
            ids[::3] = rng.integers(0, V, 10)
            mask = (rng.random(30) < 0.6).astype(np.uint8)
            w.add(f"s{i}", ids, mask)
            np.add.at(want, ids[mask.astype(bool)], 1)
        w.finish()
    with libdflash.Dataset(tmp_path / "ds") as ds:
        np.testing.assert_array_equal(ds.token_counts(V), want)
        kept, cov = train.draft_vocab_from_dataset(ds, V, VD)
        assert kept.tolist() == select_reference(want.tolist(), VD)
        assert cov == pytest.approx(want[kept].sum() / want.sum())
        with pytest.raises(libdflash.Error, match="outside the vocabulary"):
            ds.token_counts(5)


def _setup(seed=0):
    rng = np.random.default_rng(seed)
    embed = rng.standard_normal((V, H)).astype(np.float32)
    head = (0.5 * rng.standard_normal((V, H))).astype(np.float32)
    kept = np.sort(rng.choice(V, VD, replace=False)).astype(np.int32)
    return rng, embed, head, kept


def _sample(rng, S=40):
    ids = rng.integers(0, V - 1, S).astype(np.int32)
    mask = np.ones(S, np.uint8)
    hid = rng.standard_normal((S, 2 * H)).astype(np.float32)
    final = rng.standard_normal((S, H)).astype(np.float32)
    return ids, mask, hid, final


def test_checkpoint_round_trip(tmp_path):
    rng, embed, head, kept = _setup(1)
    ids, mask, hid, final = _sample(rng)
    with libdflash.Trainer(CFG, embed, head, seed=2, init_std=0.3) as tr:
        assert tr.draft_vocab().tolist() == list(range(VD))  # the fresh default
        tr.set_draft_vocab(kept)
        tr.save(tmp_path / "ck")
        params = tr.parameters()
        drafts = tr.predict(ids, hid, [0, 9, 30])
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == VD and cfg["dflash_config"]["draft_vocab_size"] == VD
    with SafeTensors(tmp_path / "ck" / "model.safetensors") as st:
        d2t, t2d = st["d2t"], st["t2d"]
        assert d2t.dtype == np.int64 and d2t.shape == (VD,)
        np.testing.assert_array_equal(d2t, kept - np.arange(VD))
        assert t2d.dtype == np.bool_ and t2d.shape == (V,)
        np.testing.assert_array_equal(np.flatnonzero(t2d), kept)
        np.testing.assert_array_equal(st["lm_head.weight"], head[kept])
        assert st["markov_head.markov_w2.weight"].shape == (VD, 6)
        assert st["markov_head.markov_w1.weight"].shape == (V, 6)
    with libdflash.Trainer(CFG, embed, head, seed=9) as back:
        back.load(tmp_path / "ck")
        assert back.draft_vocab().tolist() == kept.tolist()
        for k, v in back.parameters().items():
            np.testing.assert_array_equal(v, params[k])
        got = back.predict(ids, hid, [0, 9, 30])
        np.testing.assert_array_equal(got, drafts)
        assert set(got.ravel().tolist()) <= set(kept.tolist())  # target ids of kept rows
        lg = back.logits(ids, hid, [9])
        off = np.setdiff1d(np.arange(V), kept)
        assert np.isneginf(lg[..., off]).all() and np.isfinite(lg[..., kept]).all()
    # a checkpoint with tables, read by a drafter that is not pruned
    full = dict(CFG)
    del full["draft_vocab_size"]
    with libdflash.Trainer(full, embed, head) as tr:
        with pytest.raises(libdflash.Error, match="d2t"):
            tr.load(tmp_path / "ck")


def _rewrite(src, dst, **change):
    with SafeTensors(src) as st:
        t = {k: np.array(st[k]) for k in st.keys()}
    for k, v in change.items():
        if v is None:
            t.pop(k)
        else:
            t[k] = v
    write_safetensors(dst, t)


def test_malformed_tables_refused(tmp_path):
    rng, embed, head, kept = _setup(2)
    with libdflash.Trainer(CFG, embed, head, seed=2) as tr:
        tr.set_draft_vocab(kept)
        tr.save(tmp_path / "ck")
        before = tr.parameters()
    src = tmp_path / "ck" / "model.safetensors"
    d2t = (kept - np.arange(VD)).astype(np.int64)
    t2d = np.zeros(V, bool)
    t2d[kept] = True
    dup = d2t.copy()
    dup[5] = kept[4] - 5  # entry 5 repeats entry 4's id
    desc = d2t.copy()
    desc[5], desc[6] = kept[6] - 5, kept[5] - 6
    high = d2t.copy()
    high[-1] = V - (VD - 1)  # id V
    neg = d2t.copy()
    neg[0] = -1
    t2d_off = t2d.copy()
    t2d_off[kept[3]] = False
    cases = [
        ({"d2t": None}, "lacks tensor d2t"),
        ({"t2d": None}, "lacks tensor t2d"),
        ({"d2t": d2t[:-1]}, r"tensor d2t must be \[24\]"),
        ({"t2d": t2d[:-1]}, r"tensor t2d must be \[61\]"),
        ({"d2t": d2t.astype(np.int32)}, "tensor d2t has dtype I32"),
        ({"d2t": high}, "tensor d2t: entry 23 maps to target id 61, outside the vocabulary"),
        ({"d2t": neg}, "tensor d2t: entry 0 maps to target id -1"),
        ({"d2t": dup}, "tensor d2t: entry 5 .* strictly ascending \\(a duplicate\\)"),
        ({"d2t": desc}, "tensor d2t: entry 6 .* strictly ascending \\(out of order\\)"),
        ({"t2d": t2d_off}, f"tensor t2d\\[{kept[3]}\\] is false but d2t keeps"),
        ({"lm_head.weight": head[:VD - 1]}, r"tensor lm_head.weight must be \[24, 16\]"),
    ]
    with libdflash.Trainer(CFG, embed, head, seed=5) as tr:
        fresh = tr.parameters()
        for i, (change, msg) in enumerate(cases):
            bad = tmp_path / f"bad{i}.safetensors"
            _rewrite(src, bad, **change)
            with pytest.raises(libdflash.Error, match=msg):
                tr.load(bad)
            # nothing changed by a refused load
            assert tr.draft_vocab().tolist() == list(range(VD))
            for k, v in tr.parameters().items():
                np.testing.assert_array_equal(v, fresh[k])
        tr.load(src)
        assert tr.draft_vocab().tolist() == kept.tolist()
        np.testing.assert_array_equal(tr.parameters()["fc.weight"], before["fc.weight"])
    with libdflash.Trainer(CFG, embed, head) as tr:
        with pytest.raises(libdflash.Error, match="23 ids given, draft_vocab_size is 24"):
            tr.set_draft_vocab(kept[:-1])
        with pytest.raises(libdflash.Error, match="strictly ascending"):
            tr.set_draft_vocab(kept[::-1])


def test_training_with_a_pruned_vocabulary():
    rng, embed, head, _ = _setup(4)
    ids, mask, hid, final = _sample(rng, 48)
    # the kept set from this sequence's supervised tokens, so some labels fall outside it
    counts = np.bincount(ids, minlength=V).astype(np.int64)
    kept, cov = train.draft_vocab_select(counts, VD)
    assert 0 < cov < 1
    anchors = [0, 5, 11, 20, 31, 40]
    with libdflash.Trainer(CFG, embed, head, seed=3, init_std=0.1, lr=3e-3,
                           warmup_ratio=0.0, total_steps=40) as tr:
        with pytest.raises(libdflash.Error, match="pruned draft vocabulary"):
            tr.forward_backward(ids, mask, hid, anchors, target_final=final)
        tr.set_draft_vocab(kept)
        losses = []
        for _ in range(30):
            tr.zero_grad()
            losses.append(tr.forward_backward(ids, mask, hid, anchors, target_final=final))
            tr.step()
        assert np.isfinite(losses).all()
        assert losses[-1] < 0.8 * losses[0], losses
        # labels outside the kept set add no CE: with none inside, CE alone is 0 and so are
        # the gradients
        off = np.setdiff1d(np.arange(V - 1), kept).astype(np.int32)
        oov = rng.choice(off, 48).astype(np.int32)
        tr.zero_grad()
        assert tr.forward_backward(oov, mask, hid, [0, 9, 30]) == 0.0
        assert all(not np.any(g) for g in tr.gradients().values())
        # and with the target's state their L1 and BCE stay
        assert tr.forward_backward(oov, mask, hid, [0, 9, 30], target_final=final) > 0
