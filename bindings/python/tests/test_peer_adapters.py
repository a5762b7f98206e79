"""bench/peer_adapters.py: our dataset + hidden store turned into SpecForge's offline
feature files and speculators' vLLM-layout hidden-state files, read back by other readers
than the writer's own: torch.load, the safetensors package, and libdflash's vLLM store
reader (src/hidden/vllm.c, joined with the dataset by token ids). No peer is needed."""
import os
import sys

import numpy as np
import pytest

import libdflash
from libdflash.hidden import write_dataset

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench"))
import peer_adapters  # noqa: E402

K, H = 2, 8


def bf16(x):
    return torch.tensor(x).to(torch.bfloat16).float().numpy()


def world(tmp_path):
    rng = np.random.default_rng(11)
    samples = [(f"s{i}", rng.integers(0, 90, n).astype(np.int32),
                (rng.random(n) < 0.6).astype(bool)) for i, n in enumerate([6, 9, 4])]
    write_dataset(tmp_path / "data", samples)
    rows = {sid: bf16(rng.standard_normal((len(ids), K * H)).astype(np.float32))
            for sid, ids, _ in samples}
    with libdflash.HiddenWriter(tmp_path / "store", num_layers=K, hidden_size=H) as w:
        for sid, _, _ in reversed(samples):  # another order than the dataset's
            w.append(sid, rows[sid])
    return samples, rows


def test_specforge_features_hold_the_samples_in_dataset_order(tmp_path):
    samples, rows = world(tmp_path)
    n = peer_adapters.specforge_features(tmp_path / "data", tmp_path / "store", tmp_path / "sf")
    assert n == 3
    files = sorted(os.listdir(tmp_path / "sf"))
    assert files == ["data_000000.ckpt", "data_000001.ckpt", "data_000002.ckpt"]
    for (sid, ids, mask), f in zip(samples, files):
        d = torch.load(tmp_path / "sf" / f, weights_only=True)
        assert d["input_ids"].dtype == torch.int64 and d["input_ids"].tolist() == ids.tolist()
        assert d["loss_mask"].tolist() == mask.astype(int).tolist()
        assert d["hidden_states"].dtype == torch.float32
        np.testing.assert_array_equal(d["hidden_states"].numpy(), rows[sid])


def test_speculators_files_read_back_by_safetensors_and_libdflash(tmp_path):
    samples, rows = world(tmp_path)
    rng = np.random.default_rng(3)
    finals = {sid: rng.standard_normal((len(ids), H)).astype(np.float32) for sid, ids, _ in samples}
    n = peer_adapters.speculators_dataset(tmp_path / "data", tmp_path / "store", tmp_path / "sp",
                                          lambda sid, ids: finals[sid])
    assert n == 3
    hs = tmp_path / "sp" / "hidden_states"
    for i, (sid, ids, _) in enumerate(samples):
        t = st_torch.load_file(str(hs / f"hs_{i}.safetensors"))
        assert t["token_ids"].dtype == torch.int64 and t["token_ids"].tolist() == ids.tolist()
        assert t["hidden_states"].dtype == torch.bfloat16
        assert tuple(t["hidden_states"].shape) == (len(ids), K + 1, H)
        got = t["hidden_states"].float().numpy()
        np.testing.assert_array_equal(got[:, :K, :].reshape(len(ids), K * H), rows[sid])
        np.testing.assert_array_equal(got[:, K, :], bf16(finals[sid]))
    # libdflash's own reader of vLLM's layout (the files of `dflash train --labels target`)
    store = libdflash.HiddenStore(str(hs))
    assert (store.num_layers, store.hidden_size, store.count) == (K, H, 3)
    assert store.has_target_ids() == "vllm"
    for i, (sid, _, _) in enumerate(samples):
        np.testing.assert_array_equal(store.read(f"hs_{i}"), rows[sid])
        np.testing.assert_array_equal(store.final_layer(f"hs_{i}"), bf16(finals[sid]))


def test_bf16_rounding_is_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.005859375, -2.5, 3.0e38], np.float32)
    got = np.frombuffer(peer_adapters.bf16_bytes(x), np.uint16)
    want = torch.tensor(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, want)


def test_a_sample_without_hidden_states_is_named(tmp_path):
    write_dataset(tmp_path / "data", [("a", np.arange(4, dtype=np.int32), np.ones(4, bool)),
                                      ("b", np.arange(5, dtype=np.int32), np.ones(5, bool))])
    with libdflash.HiddenWriter(tmp_path / "store", num_layers=K, hidden_size=H) as w:
        w.append("a", np.zeros((4, K * H), np.float32))
    with pytest.raises(KeyError, match="'b'"):
        peer_adapters.specforge_features(tmp_path / "data", tmp_path / "store", tmp_path / "sf")
