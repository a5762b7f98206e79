"""`dflash train --labels target`: the drafter's CE targets are the target's own greedy tokens
(label at position t = the target's argmax at t-1) instead of the data's, from target ids the
producer stored (HiddenWriter.append(..., target_ids=...), in a store or a spool) or from the
final-layer slot of vLLM's hs_*.safetensors through the target's final norm and LM head."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import libdflash
from libdflash.hidden import write_dataset
from libdflash.train import default_loss_gamma, logits, sample_anchors

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_train_cli as ttc  # noqa: E402

CLI = os.environ.get("DFLASH_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="DFLASH_CLI not set (run through meson test)")
V, H, B = ttc.V, ttc.H, ttc.B
ARGS = ["--threads", "1", "--batch", "2", "--anchors", "8", "--seed", "3", "--lr", "5e-3",
        "--quiet"]


def train(root, hidden, out, *extra, data="train", check=True):
    r = subprocess.run([CLI, "train", "--config", str(root / "drafter.json"), "--target",
                        str(root / "target"), "--data", str(root / data), "--hidden",
                        str(hidden), "-o", str(out), *ARGS, *extra],
                       capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def copy_store(src, dst, tids_of):
    """dst: the samples of store `src`, with target_ids tids_of(sid) (None: none)."""
    s = libdflash.HiddenStore(src)
    with libdflash.HiddenWriter(dst, num_layers=s.num_layers, hidden_size=s.hidden_size) as w:
        for sid in s.ids():
            w.append(sid, s.read(sid), target_ids=tids_of(sid))


def dataset_ids(root, name="train"):
    with libdflash.Dataset(root / name) as ds:
        return {sid: np.array(ids, np.int32) for sid, ids, _ in ds}


def model_bytes(out):
    return (out / "model.safetensors").read_bytes()


def test_target_ids_equal_to_the_data_give_the_data_labels_run(tmp_path):
    """Target ids that ARE the data's next tokens: --labels target trains byte for byte what
    --labels data does (and a store carrying ids trains data labels as one without them)."""
    ttc.make_world(tmp_path, n_train=12, n_test=2)
    ids = dataset_ids(tmp_path)
    # tids[t] is the prediction of token t+1; the last one predicts past the end (unused).
    copy_store(tmp_path / "train-hidden", tmp_path / "with-ids",
               lambda sid: np.append(ids[sid][1:], 0))
    assert libdflash.HiddenStore(tmp_path / "with-ids").has_target_ids() == "stored"
    assert libdflash.HiddenStore(tmp_path / "train-hidden").has_target_ids() is None
    train(tmp_path, tmp_path / "train-hidden", tmp_path / "data", "--epochs", "2")
    train(tmp_path, tmp_path / "with-ids", tmp_path / "run-target", "--epochs", "2",
          "--labels", "target")
    train(tmp_path, tmp_path / "with-ids", tmp_path / "data2", "--epochs", "2")
    assert model_bytes(tmp_path / "run-target") == model_bytes(tmp_path / "data")
    assert model_bytes(tmp_path / "data2") == model_bytes(tmp_path / "data")


def first_step_loss(out):
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]


def hand_ce(trainer, ids, hidden, anchors, labels):
    """sum(w * CE) / sum(w) over the blocks' positions 1..B-1 (every token supervised), the CE
    computed here from the drafter's logits: w_k = exp(-(k-1)/gamma)."""
    lg = logits(trainer, ids, hidden, anchors).astype(np.float64)
    gamma = default_loss_gamma(B)
    num = den = 0.0
    for n, a in enumerate(anchors):
        for k in range(1, B):
            p = a + k
            if p >= len(ids):
                continue
            row = lg[n, k]
            ce = np.log(np.exp(row - row.max()).sum()) + row.max() - row[labels[p]]
            w = np.exp(-(k - 1) / gamma)
            num, den = num + w * ce, den + w
    return num / den


def test_target_labels_loss_equals_a_hand_computed_ce(tmp_path):
    """One sample, one step: the run's first loss (before any update) is the CE of the
    drafter's logits against labels[p] = target_ids[p-1], computed here in numpy; the same
    computation against the data's tokens gives the data-labels run's loss (which checks the
    hand computation itself), and the two differ."""
    ttc.make_world(tmp_path, n_train=1, n_test=1)
    ids = dataset_ids(tmp_path)
    (sid, x), = ids.items()
    rng = np.random.default_rng(7)
    tids = rng.integers(0, V, len(x)).astype(np.int32)
    copy_store(tmp_path / "train-hidden", tmp_path / "with-ids", lambda s: tids)
    one = ["--epochs", "1", "--max-steps", "1", "--batch", "1"]
    train(tmp_path, tmp_path / "with-ids", tmp_path / "run-target", *one, "--labels", "target")
    train(tmp_path, tmp_path / "with-ids", tmp_path / "data", *one)
    store = libdflash.HiddenStore(tmp_path / "with-ids")
    np.testing.assert_array_equal(store.target_ids(sid), tids)
    hidden = store.read(sid)
    # The run's anchors (epoch 0, dataset index 0) and initial weights (seed 3).
    anchors = sample_anchors(np.ones(len(x), np.uint8), B, 8, 3, 0)
    emb = libdflash.SafeTensors(tmp_path / "target" / "model.safetensors")
    cfg = json.loads((tmp_path / "drafter.json").read_text())
    with libdflash.Trainer(cfg, emb["model.embed_tokens.weight"], emb["lm_head.weight"],
                           seed=3) as tr:
        want_t = hand_ce(tr, x, hidden, anchors, np.append(x[:1], tids[:-1]))
        want_d = hand_ce(tr, x, hidden, anchors, x)
    got_t, got_d = first_step_loss(tmp_path / "run-target"), first_step_loss(tmp_path / "data")
    assert got_d == pytest.approx(want_d, rel=1e-5)
    assert got_t == pytest.approx(want_t, rel=1e-5)
    assert abs(got_t - got_d) > 0.1, (got_t, got_d)


def test_labels_target_refuses_a_store_without_them(tmp_path):
    ttc.make_world(tmp_path, n_train=4, n_test=1)
    r = train(tmp_path, tmp_path / "train-hidden", tmp_path / "run", "--labels", "target",
              check=False)
    assert r.returncode == 1
    assert "--labels target" in r.stderr and str(tmp_path / "train-hidden") in r.stderr
    assert "neither the target's greedy tokens" in r.stderr
    r = train(tmp_path, tmp_path / "train-hidden", tmp_path / "run2", "--labels", "nope",
              check=False)
    assert r.returncode == 2


def test_spool_carries_target_ids(tmp_path):
    """A spool written with target ids (the whole run published before training: one sample,
    so the spool's order is the offline order) trains --labels target exactly as the offline
    store does; without them the spool's sample is refused by id."""
    ttc.make_world(tmp_path, n_train=1, n_test=1)
    (sid, x), = dataset_ids(tmp_path).items()
    tids = np.random.default_rng(8).integers(0, V, len(x)).astype(np.int32)
    copy_store(tmp_path / "train-hidden", tmp_path / "with-ids", lambda s: tids)
    src = libdflash.HiddenStore(tmp_path / "with-ids")
    for name, t in (("spool", tids), ("spool-bare", None)):
        with libdflash.HiddenWriter(tmp_path / name, num_layers=1, hidden_size=H,
                                    shard_bytes=1 << 16, spool_budget=1 << 20) as w:
            for _ in range(2):
                w.append(sid, src.read(sid), target_ids=t)
                w.end_epoch()
    ep = ["--epochs", "2", "--batch", "1", "--labels", "target", "--spool-wait", "5"]
    train(tmp_path, tmp_path / "with-ids", tmp_path / "offline", *ep)
    train(tmp_path, f"spool:{tmp_path / 'spool'}", tmp_path / "spooled", *ep)
    assert model_bytes(tmp_path / "spooled") == model_bytes(tmp_path / "offline")
    r = train(tmp_path, f"spool:{tmp_path / 'spool-bare'}", tmp_path / "bare", *ep, check=False)
    assert r.returncode == 1 and f"sample {sid}" in r.stderr and "no target ids" in r.stderr, \
        r.stderr


def test_spool_summary_reports_the_trainers_wait(tmp_path):
    """dflash train's summary carries spool_wait_s, its own count of the seconds it waited for
    the producer's shards: here the producer publishes epoch 1 only after ~2 s."""
    ttc.make_world(tmp_path, n_train=2, n_test=1)
    src = libdflash.HiddenStore(tmp_path / "train-hidden")
    spool = tmp_path / "spool"
    code = f"""
import time, libdflash
src = libdflash.HiddenStore({str(tmp_path / 'train-hidden')!r})
with libdflash.HiddenWriter({str(spool)!r}, num_layers=1, hidden_size={H}, shard_bytes=1 << 16,
                            spool_budget=1 << 20) as w:
    for e in range(2):
        if e:
            time.sleep(2.0)
        for sid in src.ids():
            w.append(sid, src.read(sid))
        w.end_epoch()
"""
    prod = subprocess.Popen([sys.executable, "-c", code])
    r = train(tmp_path, f"spool:{spool}", tmp_path / "run", "--epochs", "2", "--spool-wait", "30")
    assert prod.wait(timeout=60) == 0
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert 1.5 <= summary["spool_wait_s"] < 30, summary
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["spool_wait_s"] == summary["spool_wait_s"]


def rmsnorm(x, w, eps):
    import torch
    x = torch.as_tensor(x, dtype=torch.float32)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * torch.as_tensor(w)


def test_vllm_final_layer_labels_are_torchs_argmax(tmp_path):
    """vLLM's files with --labels target: the trainer turns each file's final-layer slot into
    the target's greedy tokens through the target's model.norm.weight (eps from its config.json)
    and LM head. Trained exactly as a libdflash store holding torch's argmax of the same
    norm + head as target ids (byte-identical checkpoints), unlike data labels."""
    torch = pytest.importorskip("torch")
    from test_vllm_hidden import write_vllm
    rng = np.random.default_rng(11)
    K, S, n = 2, 24, 5
    samples = [(f"s{i}", rng.integers(0, 16, S).astype(np.int32), np.ones(S, bool))
               for i in range(n)]
    write_dataset(tmp_path / "train", samples)
    states = [rng.standard_normal((S, K + 1, H)).astype(np.float32) for _ in samples]
    decoded = write_vllm(tmp_path / "vllm", [(s[1], x) for s, x in zip(samples, states)])
    head = rng.standard_normal((V, H)).astype(np.float32)
    norm_w = (1 + 0.3 * rng.standard_normal(H)).astype(np.float32)
    eps = 1e-5
    (tmp_path / "target").mkdir()
    libdflash.write_safetensors(tmp_path / "target" / "model.safetensors", {
        "model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
        "lm_head.weight": head, "model.norm.weight": norm_w})
    (tmp_path / "target" / "config.json").write_text(json.dumps({"rms_norm_eps": eps}))
    cfg = {"architectures": ["DFlashDraftModel"], "hidden_size": H, "intermediate_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "vocab_size": V, "num_target_layers": 8, "block_size": B,
           "dflash_config": {"mask_token_id": 16, "target_layer_ids": [2, 5]}}
    (tmp_path / "drafter.json").write_text(json.dumps(cfg))
    store = libdflash.HiddenStore(tmp_path / "vllm")
    assert store.has_target_ids() == "vllm"
    changed = 0
    with libdflash.HiddenWriter(tmp_path / "store", num_layers=K, hidden_size=H) as w:
        for (sid, ids, _), x, f in zip(samples, decoded, range(n)):
            np.testing.assert_array_equal(store.final_layer(f"hs_{f}"), x[:, K, :])
            want = (rmsnorm(x[:, K, :], norm_w, eps) @ torch.as_tensor(head).T).argmax(-1)
            changed += int((want.numpy()[:-1] != ids[1:]).sum())
            w.append(sid, x[:, :K, :].reshape(S, K * H), target_ids=want.to(torch.int32))
    assert changed > n * (S - 1) // 2  # the labels differ from the data's
    ep = ["--epochs", "2", "--labels", "target"]
    train(tmp_path, tmp_path / "vllm", tmp_path / "run-vllm", *ep)
    train(tmp_path, tmp_path / "store", tmp_path / "run-store", *ep)
    train(tmp_path, tmp_path / "vllm", tmp_path / "run-data", "--epochs", "2")
    assert model_bytes(tmp_path / "run-vllm") == model_bytes(tmp_path / "run-store")
    assert model_bytes(tmp_path / "run-vllm") != model_bytes(tmp_path / "run-data")
    # Without the final norm in the target: refused, naming the tensor.
    libdflash.write_safetensors(tmp_path / "target" / "model.safetensors", {
        "model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
        "lm_head.weight": head})
    r = train(tmp_path, tmp_path / "vllm", tmp_path / "run-nonorm", *ep, check=False)
    assert r.returncode == 1 and "model.norm.weight" in r.stderr, r.stderr
