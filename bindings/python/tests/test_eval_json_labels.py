"""`dflash eval --json --labels target`: "tau" is the target-labels tau (it was the sampled-anchor
tau, which only knows data labels); the sampled one stays as "sampled_tau"."""
import json
import os
import subprocess

import numpy as np
import pytest

import libdflash
from test_train_cli import V, make_world, train_cmd

CLI = os.environ.get("DFLASH_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="DFLASH_CLI not set (run through meson test)")


def evaluate(root, ckpt, hidden, *extra):
    r = subprocess.run([CLI, "eval", "--checkpoint", str(ckpt), "--target", str(root / "target"),
                        "--data", str(root / "test"), "--hidden", str(hidden), "--anchors", "8",
                        "--json", *extra], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_json_tau_uses_the_labels_asked_for(tmp_path):
    make_world(tmp_path, n_train=16, n_test=4)
    subprocess.run(train_cmd(tmp_path, tmp_path / "run", "--epochs", "2", "--quiet"), check=True)
    # The test split again, with target ids that are not the data's next tokens.
    rng = np.random.default_rng(3)
    store = libdflash.HiddenStore(tmp_path / "test-hidden")
    with libdflash.HiddenWriter(tmp_path / "t-hidden", num_layers=1,
                                hidden_size=store.read(store.ids()[0]).shape[1]) as w:
        for sid in store.ids():
            x = store.read(sid)
            w.append(sid, x, rng.integers(0, V, len(x)).astype(np.int32))
    data = evaluate(tmp_path, tmp_path / "run", tmp_path / "t-hidden")
    target = evaluate(tmp_path, tmp_path / "run", tmp_path / "t-hidden", "--labels", "target")
    assert data["labels"] == "data" and data["tau"] == data["sampled_tau"], data
    assert target["labels"] == "target" and target["sampled_labels"] == "data", target
    assert target["tau"] == target["position_tau"], target
    assert target["sampled_tau"] == data["sampled_tau"], (target, data)
    assert target["tau"] != target["sampled_tau"], target
