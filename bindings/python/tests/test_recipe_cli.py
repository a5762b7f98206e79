"""`dflash train --schedule / --min-lr-ratio / --weighting / --loss-gamma` (the recipe knobs of
src/train/README.md): each reaches the trainer (the metrics' learning rates follow Hugging
Face's schedule rules, computed here; the first loss follows the weighting), and bad values
are usage errors."""
import json
import math

import numpy as np
import pytest

import libdflash
from libdflash.train import logits, sample_anchors

import test_labels as tl
import test_train_cli as ttc

B = ttc.B
ONE = ["--epochs", "1", "--batch", "1"]


def metrics(out):
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def hf_rate(schedule, step, warm, total, floor):
    """transformers' get_{cosine,linear,constant}_schedule_with_warmup, with a floor (metrics
    print 9 significant digits)."""
    if step < warm:
        return step / max(1, warm)
    if schedule == "constant":
        return 1.0
    p = (step - warm) / max(1, total - warm)
    left = max(0.0, 1 - p) if schedule == "linear" else max(0.0, 0.5 * (1 + math.cos(math.pi * p)))
    return floor + (1 - floor) * left


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_rates(tmp_path, schedule):
    ttc.make_world(tmp_path, n_train=10, n_test=1)
    tl.train(tmp_path, tmp_path / "train-hidden", tmp_path / "run", *ONE, "--warmup-ratio", "0.2",
             "--schedule", schedule, "--min-lr-ratio", "0.1")
    m = metrics(tmp_path / "run")
    assert len(m) == 10
    for s, row in enumerate(m):
        want = 5e-3 * hf_rate(schedule, s, 2, 10, 0.1)
        assert row["lr"] == pytest.approx(want, rel=1e-8, abs=1e-15), (s, row["lr"], want)


def first_loss(tr, x, hidden, anchors, weights):
    """sum(w * CE) / sum(w) of the drafter's logits; weights(ce [n, B]) -> w [n, B]."""
    lg = logits(tr, x, hidden, anchors).astype(np.float64)
    ce = np.zeros((len(anchors), B))
    ok = np.zeros((len(anchors), B), bool)
    for n, a in enumerate(anchors):
        for k in range(1, B):
            if a + k < len(x):
                row = lg[n, k]
                ce[n, k] = np.log(np.exp(row - row.max()).sum()) + row.max() - row[x[a + k]]
                ok[n, k] = True
    w = weights(ce, ok) * ok
    return (w * ce).sum() / w.sum()


def adaptive(ce, ok):
    w = np.zeros_like(ce)
    for n in range(ce.shape[0]):
        reach = np.concatenate([[1.0], np.cumprod(np.exp(-ce[n, 1:-1]))])
        w[n, 1:] = reach * ok[n, 1:]
        w[n] *= ok[n].sum() / w[n].sum()
    return w


def test_weighting_reaches_the_loss(tmp_path):
    """The first step's loss (before any update) with each weighting equals the weighted CE
    of the drafter's logits computed here, and the three differ."""
    ttc.make_world(tmp_path, n_train=1, n_test=1)
    (sid, x), = tl.dataset_ids(tmp_path).items()
    store = libdflash.HiddenStore(tmp_path / "train-hidden")
    anchors = sample_anchors(np.ones(len(x), np.uint8), B, 8, 3, 0)
    emb = libdflash.SafeTensors(tmp_path / "target" / "model.safetensors")
    cfg = json.loads((tmp_path / "drafter.json").read_text())
    k = np.arange(B)[None].astype(float)
    gamma = libdflash.train.default_loss_gamma(B)
    rules = {"decay": lambda ce, ok: np.exp(-(k - 1) / gamma) + 0 * ce,
             "none": lambda ce, ok: np.ones_like(ce),
             "adaptive": adaptive}
    got = {}
    with libdflash.Trainer(cfg, emb["model.embed_tokens.weight"], emb["lm_head.weight"],
                           seed=3) as tr:
        for name, rule in rules.items():
            tl.train(tmp_path, tmp_path / "train-hidden", tmp_path / name, *ONE,
                     "--max-steps", "1", "--weighting", name)
            got[name] = metrics(tmp_path / name)[0]["loss"]
            assert got[name] == pytest.approx(first_loss(tr, x, store.read(sid), anchors, rule),
                                              rel=1e-5), name
    assert len({round(v, 6) for v in got.values()}) == 3, got


def test_bad_values_are_usage_errors(tmp_path):
    ttc.make_world(tmp_path, n_train=2, n_test=1)
    for extra in (["--schedule", "step"], ["--weighting", "dpace"],
                  ["--weighting", "none", "--loss-gamma", "3"], ["--min-lr-ratio", "2"]):
        r = tl.train(tmp_path, tmp_path / "train-hidden", tmp_path / "r", *extra, check=False)
        assert r.returncode == 2, (extra, r.stderr)
