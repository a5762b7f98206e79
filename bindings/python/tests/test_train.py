import json

import numpy as np
import pytest

import libdflash
from libdflash import train

CFG = {
    "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 29,
    "num_target_layers": 12, "block_size": 4,
    "dflash_config": {"mask_token_id": 28, "target_layer_ids": [2, 6]},
}


def make(**kw):
    rng = np.random.default_rng(0)
    e = rng.standard_normal((29, 16)).astype(np.float32)
    return libdflash.Trainer(CFG, e, e, seed=3, **kw), rng


def test_parameters_and_names():
    tr, _ = make()
    names = tr.names()
    assert names[0] == "fc.weight" and names[-1] == "norm.weight"
    assert "layers.1.self_attn.k_norm.weight" in names
    p = tr.parameters()
    assert p["fc.weight"].shape == (16, 32)
    assert p["layers.0.self_attn.k_proj.weight"].shape == (8, 16)
    p["norm.weight"][:] = 2.0
    tr.set_parameters({"norm.weight": p["norm.weight"]})
    assert (tr.parameters()["norm.weight"] == 2.0).all()
    with pytest.raises(libdflash.Error, match="no parameter"):
        tr.set_parameters({"nope": np.zeros(3)})


def test_forward_backward_and_predict():
    tr, rng = make()
    ids = rng.integers(0, 28, 20).astype(np.int32)
    mask = np.ones(20, np.uint8)
    hid = rng.standard_normal((20, 32)).astype(np.float32)
    loss = tr.forward_backward(ids, mask, hid, [0, 5, 16])
    assert 0 < loss < 20
    g = tr.gradients()
    assert np.abs(g["fc.weight"]).sum() > 0
    # Gradients are of the last call, not accumulated.
    tr.forward_backward(ids, mask, hid, [0, 5, 16])
    np.testing.assert_array_equal(tr.gradients()["fc.weight"], g["fc.weight"])
    pred = tr.predict(ids, hid, [0, 5])
    assert pred.shape == (2, 3) and pred.dtype == np.int32
    # K*H = 2*16 features per token: a narrower array is refused before the
    # library could read past its end.
    for bad in (hid[:, :16], hid[:5]):
        with pytest.raises(ValueError, match=r"expected \[20, 32\]"):
            tr.predict(ids, bad, [0, 5])
        with pytest.raises(ValueError, match=r"expected \[20, 32\]"):
            tr.forward_backward(ids, mask, bad, [0])


def test_accumulate_stored_rows_equal_float_rows():
    """Stored bf16 codes (decoded on the host for the CPU backend) and float32 rows: the same
    sums and gradients; collect returns the sums once, and forward_backward leaves them be."""
    tr, rng = make()
    ids = rng.integers(0, 28, 20).astype(np.int32)
    mask = np.ones(20, np.uint8)
    hid = rng.standard_normal((20, 32)).astype(np.float32)
    bits = (hid.view(np.uint32) >> 16).astype(np.uint16)  # truncated: exact bf16 values
    exact = (bits.astype(np.uint32) << 16).view(np.float32)
    tr.zero_grad()
    tr.accumulate(ids, mask, [0, 5, 16], 0.5, hidden=exact)
    want = tr.collect()
    assert want[0] > 0 and want[1] == tr.weight_sum(mask, [0, 5, 16])
    g = tr.gradients()["fc.weight"].copy()
    tr.zero_grad()
    tr.accumulate(ids, mask, [0, 5, 16], 0.5, codes=bits, sample_id="s1")
    assert tr.collect() == want and tr.collect() == (0.0, 0.0)
    np.testing.assert_array_equal(tr.gradients()["fc.weight"], g)
    tr.zero_grad()
    tr.accumulate(ids, mask, [0, 5, 16], 0.5, hidden=exact)
    tr.forward_backward(ids, mask, exact, [2])
    assert tr.collect() == want
    with pytest.raises(ValueError, match="codes"):
        tr.accumulate(ids, mask, [0], 0.5, codes=hid)
    with pytest.raises(libdflash.Error, match="anchor 0 = 20 is outside"):
        tr.accumulate(ids, mask, [20], 0.5, hidden=exact)


def test_config_round_trip_and_paths(tmp_path):
    cfg = train.parse_config(CFG)
    d = train.config_to_dict(cfg)
    assert d["dflash_config"]["block_size"] == 4 and d["block_size"] == 4
    assert d["architectures"] == ["DFlashDraftModel"]
    (tmp_path / "c.json").write_text(json.dumps(d))
    assert train.config_to_dict(train.parse_config(str(tmp_path / "c.json"))) == d
    bad = dict(CFG, num_key_value_heads=3)
    with pytest.raises(libdflash.Error, match="multiple of num_key_value_heads"):
        train.parse_config(bad)


def test_default_layers_and_anchors():
    assert train.default_target_layers(36, 5) == [1, 9, 17, 25, 33]
    mask = np.ones(40, np.uint8)
    a = train.sample_anchors(mask, 8, 6, seed=1, stream=0)
    assert len(a) == 6 and (np.diff(a) > 0).all() and a.max() <= 32


def test_step_async_equals_step():
    """step_async + step_result: the same norm, lr, step count and parameters as step."""
    out = []
    for use_async in (False, True):
        tr, rng = make(total_steps=4)
        ids = rng.integers(0, 28, 20).astype(np.int32)
        hid = rng.standard_normal((20, 32)).astype(np.float32)
        norms = []
        for _ in range(2):
            tr.forward_backward(ids, np.ones(20, np.uint8), hid, [2, 9])
            if use_async:
                lr = tr.step_async()
                norms.append((tr.step_result(), lr))
            else:
                norms.append(tr.step())
        out.append((norms, tr.step_count, tr.parameters()["fc.weight"]))
    assert out[0][0] == out[1][0] and out[0][1] == out[1][1] == 2
    np.testing.assert_array_equal(out[0][2], out[1][2])
    with pytest.raises(libdflash.Error):
        tr.step_result()  # nothing outstanding


def test_checkpoint_and_state(tmp_path):
    tr, rng = make(total_steps=4)
    ids = rng.integers(0, 28, 20).astype(np.int32)
    hid = rng.standard_normal((20, 32)).astype(np.float32)
    tr.forward_backward(ids, np.ones(20, np.uint8), hid, [2, 9])
    tr.step()
    tr.save(tmp_path / "ckpt")
    st = libdflash.SafeTensors(tmp_path / "ckpt" / "model.safetensors")
    np.testing.assert_array_equal(st["fc.weight"], tr.parameters()["fc.weight"])
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [2, 6]
    tr.save_state(tmp_path / "state.safetensors", b"pos=1")
    tr2, _ = make(total_steps=4)
    assert tr2.load_state(tmp_path / "state.safetensors") == b"pos=1"
    assert tr2.step_count == 1
    np.testing.assert_array_equal(tr2.parameters()["fc.weight"], tr.parameters()["fc.weight"])


def test_cuda_backend_fails_cleanly_without_a_device():
    try:
        if libdflash.cuda_device_count() > 0:
            pytest.skip("a CUDA device is present: tests/gpu covers the backend")
    except libdflash.Error:
        pass
    with pytest.raises(libdflash.Error) as err:
        make(backend="cuda")
    assert err.value.status in ("DFLASH_E_NO_DEVICE", "DFLASH_E_UNSUPPORTED")
    assert "cuda" in str(err.value).lower()
