"""What a hidden-state store records about its rows (HiddenWriter target_layer_ids and
tokenizer_hash): `dflash inspect` shows it with whether the store has target ids, and
`dflash train` refuses a drafter config that reads other target layers."""
import os
import subprocess

import numpy as np
import pytest

import libdflash
from test_train_cli import H, make_world, train_cmd

CLI = os.environ.get("DFLASH_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="DFLASH_CLI not set (run through meson test)")


def inspect(path):
    r = subprocess.run([CLI, "inspect", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def copy_store(src, dst, **record):
    """src's samples into a new store dst, with `record` (target ids of every sample)."""
    store = libdflash.HiddenStore(src)
    with libdflash.HiddenWriter(dst, num_layers=1, hidden_size=H, **record) as w:
        for sid in store.ids():
            x = store.read(sid)
            w.append(sid, x, np.zeros(len(x), np.int32))


def test_inspect_shows_the_record_and_train_checks_the_layers(tmp_path):
    make_world(tmp_path, n_train=8, n_test=1)  # its drafter reads target layer 3
    old = inspect(tmp_path / "train-hidden")  # written without a record
    assert "target layer ids: not recorded" in old and "tokenizer hash: not recorded" in old, old
    assert "target ids (--labels target): none" in old, old
    copy_store(tmp_path / "train-hidden", tmp_path / "h5", target_layer_ids=[5],
               tokenizer_hash="sha256:feed")
    out = inspect(tmp_path / "h5")
    assert "target layer ids: 5" in out and "tokenizer hash: sha256:feed" in out, out
    assert "target ids (--labels target): stored" in out, out
    cmd = train_cmd(tmp_path, tmp_path / "run", "--epochs", "1", "--quiet")
    cmd[cmd.index("--hidden") + 1] = str(tmp_path / "h5")
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    assert "holds the target layers [5]" in r.stderr and "target_layer_ids are [3]" in r.stderr
    copy_store(tmp_path / "train-hidden", tmp_path / "h3", target_layer_ids=[3])
    cmd[cmd.index("--hidden") + 1] = str(tmp_path / "h3")
    subprocess.run(cmd, capture_output=True, check=True)
    with pytest.raises(ValueError):
        libdflash.HiddenWriter(tmp_path / "bad", num_layers=2, hidden_size=H, target_layer_ids=[1])
