import os
import subprocess

import numpy as np
import pytest

import libdflash
from libdflash.hidden import write_dataset


def test_writer_reader_round_trip_bf16(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 2 * 16)).astype(np.float32)
    with libdflash.HiddenWriter(tmp_path / "h", num_layers=2, hidden_size=16) as w:
        w.append("a", x)
        w.append(7, x[:4])
    store = libdflash.HiddenStore(tmp_path / "h")
    assert sorted(store.ids()) == ["7", "a"]
    assert store.length("a") == 9
    y = store.read("a")
    # bf16 keeps 8 bits of mantissa: round-to-nearest-even of float32
    import torch
    ref = torch.tensor(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(y, ref)


def test_fp8_codes_match_torch(tmp_path):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 3 * 32)) * rng.uniform(0.01, 100, size=(6, 1))).astype(np.float32)
    with libdflash.HiddenWriter(tmp_path, num_layers=3, hidden_size=32, dtype="fp8") as w:
        w.append("s", x)
    st = libdflash.SafeTensors(tmp_path)
    codes, scales = st["h/s"], st["s/s"]
    assert scales.shape == (6, 3)
    rows = x.reshape(6 * 3, 32)
    ref_scale = np.abs(rows).max(axis=1) / np.float32(448.0)
    np.testing.assert_array_equal(scales.reshape(-1), ref_scale.astype(np.float32))
    scaled = torch.tensor(rows) / torch.tensor(ref_scale)[:, None]
    ref_codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(codes.reshape(18, 32), ref_codes)
    decoded = libdflash.HiddenStore(tmp_path).read("s")
    err = np.sqrt(((decoded - x) ** 2).mean() / (x ** 2).mean())
    assert err < 0.05


def test_writer_accepts_torch_bf16_bit_exact(tmp_path):
    torch = pytest.importorskip("torch")
    t = torch.randn(5, 8).to(torch.bfloat16)
    with libdflash.HiddenWriter(tmp_path, num_layers=1, hidden_size=8) as w:
        w.append("x", t)
    np.testing.assert_array_equal(libdflash.HiddenStore(tmp_path).read("x"), t.float().numpy())


def test_writer_errors(tmp_path):
    with libdflash.HiddenWriter(tmp_path, num_layers=1, hidden_size=4) as w:
        w.append("a", np.zeros((3, 4), np.float32))
        with pytest.raises(libdflash.Error) as e:
            w.append("a", np.zeros((3, 4), np.float32))
        assert e.value.status == "DFLASH_E_DUPLICATE"
        bad = np.zeros((3, 4), np.float32)
        bad[2, 1] = np.nan
        with pytest.raises(libdflash.Error, match="sample b: hidden state at token 2, column 1 is NaN"):
            w.append("b", bad)
        with pytest.raises(ValueError):
            w.append("c", np.zeros((3, 5), np.float32))


def test_stream_joins_dataset(tmp_path):
    rng = np.random.default_rng(2)
    samples = [(f"id{i}", rng.integers(0, 100, n), (rng.random(n) > 0.3)) for i, n in
               enumerate([5, 8, 3])]
    write_dataset(tmp_path / "data", samples)
    hidden = {s[0]: rng.standard_normal((len(s[1]), 8)).astype(np.float32) for s in samples}
    with libdflash.HiddenWriter(tmp_path / "h", num_layers=2, hidden_size=4) as w:
        for k, v in hidden.items():
            w.append(k, v)
    stream = libdflash.SampleStream(tmp_path / "data", tmp_path / "h", prefetch=2)
    stream.check()
    got = list(stream.iterate([2, 0, 1]))
    assert [g[1] for g in got] == ["id2", "id0", "id1"]
    for index, sid, ids, mask, hid in got:
        s = samples[index]
        np.testing.assert_array_equal(ids, s[1])
        np.testing.assert_array_equal(mask, s[2].astype(np.uint8))
        np.testing.assert_allclose(hid, hidden[sid], rtol=1e-2, atol=1e-2)


def test_stream_default_prefetch_and_explicit_agree(tmp_path):
    rng = np.random.default_rng(1)
    samples = [(f"s{i}", rng.integers(0, 50, 6 + i), np.ones(6 + i, np.uint8)) for i in range(5)]
    write_dataset(tmp_path / "ds", samples)
    with libdflash.HiddenWriter(tmp_path / "hid", num_layers=1, hidden_size=8) as w:
        for sid, ids, _ in samples:
            w.append(sid, rng.standard_normal((len(ids), 8)))
    order = [4, 0, 3, 1, 2, 0]
    runs = []
    for prefetch in (None, 1, 8):  # None: the library's default
        with libdflash.SampleStream(tmp_path / "ds", tmp_path / "hid", prefetch=prefetch) as s:
            runs.append([(i, sid, ids.tolist(), h.tobytes()) for i, sid, ids, _, h in
                         s.iterate(order)])
    assert [r[0] for r in runs[0]] == order
    assert [r[2] for r in runs[0]] == [samples[i][1].tolist() for i in order]
    assert runs[0] == runs[1] == runs[2]


def test_stats_and_zero_layer_refused(tmp_path):
    """HiddenStore.stats() equals numpy's per-layer RMS and zero-row counts over the decoded
    store; a sample whose layer is all zeros (a producer that captured nothing) is refused by
    the stream the trainer reads, naming the sample and the layer."""
    rng = np.random.default_rng(5)
    K, H = 3, 8
    samples = [(f"s{i}", rng.integers(0, 50, n), np.ones(n, bool)) for i, n in
               enumerate([7, 4, 9])]
    write_dataset(tmp_path / "data", samples)
    hidden = {s[0]: rng.standard_normal((len(s[1]), K * H)).astype(np.float32) for s in samples}
    hidden["s1"][:, 2 * H:] = 0          # layer 2 of s1 never captured
    hidden["s2"][3, :H] = 0              # one zero row in layer 0: counted, not refused
    seen = []
    libdflash.set_log_callback(lambda level, msg: seen.append(msg), max_level="warn")
    try:
        with libdflash.HiddenWriter(tmp_path / "h", num_layers=K, hidden_size=H) as w:
            for k, v in hidden.items():
                w.append(k, v)
    finally:
        libdflash.set_log_callback(None)
    # The writer reports it as it happens and at the end (it stores what it is given).
    assert any("sample s1: layer 2 of 3 is all zeros" in m for m in seen), seen
    assert any("1 sample(s) have an all-zero layer" in m for m in seen), seen
    store = libdflash.HiddenStore(tmp_path / "h")
    st = store.stats()
    dec = np.concatenate([store.read(i) for i in store.ids()]).astype(np.float64)
    layers = dec.reshape(len(dec), K, H)
    np.testing.assert_allclose(st["rms"], np.sqrt((layers ** 2).mean(axis=(0, 2))), rtol=1e-12)
    assert st["rows"] == 20 and st["zero_rows"] == [1, 0, 4]
    stream = libdflash.SampleStream(tmp_path / "data", tmp_path / "h")
    with pytest.raises(libdflash.Error) as e:
        list(stream.iterate([0, 1, 2]))
    assert "sample s1: layer 2 of 3" in e.value.message and "all zeros" in e.value.message
    cli = os.environ.get("DFLASH_CLI")
    if cli:  # dflash inspect reports the same numbers
        out = subprocess.run([cli, "inspect", str(tmp_path / "h")], capture_output=True,
                             text=True, check=True).stdout
        assert "3 samples, 20 tokens, 3 layers x 8 (bf16)" in out, out
        for k in range(K):
            assert f"layer {k}: rms {st['rms'][k]:.6g}, all-zero rows {st['zero_rows'][k]}" in out
        assert "never captured" not in out  # no layer is zero in every sample


def test_layout_and_file_names(tmp_path):
    """The library's one test of vLLM's hs_<digits>.safetensors names, and of a folder."""
    assert libdflash.is_vllm_hidden_file("hs_12.safetensors")
    assert not libdflash.is_vllm_hidden_file("hs_1x.safetensors")
    assert not libdflash.is_vllm_hidden_file("hs_.safetensors")
    assert libdflash.hidden_layout(tmp_path) is None
    (tmp_path / "hs_3.safetensors").write_bytes(b"x")
    assert libdflash.hidden_layout(tmp_path) == "vllm"
    store = tmp_path / "store"
    w = libdflash.HiddenWriter(store, num_layers=1, hidden_size=4)
    w.append("s0", np.ones((2, 4), dtype=np.float32))
    w.close()
    assert libdflash.hidden_layout(store) == "store"


def _store_ids(path):
    store = libdflash.HiddenStore(path)
    try:
        return store.ids()
    finally:
        store.close()


def test_unclosed_writer_commits_at_interpreter_exit(tmp_path):
    """A script that forgets close() and `with`: its buffered samples reach the store when the
    interpreter exits, and a warning names the directory and the count (issue 42, item 1)."""
    script = (
        "import numpy as np, libdflash\n"
        f"w = libdflash.HiddenWriter({str(tmp_path / 'h')!r}, num_layers=2, hidden_size=4)\n"
        "for i in range(3):\n"
        "    w.append(f's{i}', np.full((5, 8), i, dtype=np.float32))\n")
    import sys
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "was not closed: at interpreter exit, its 3 samples" in run.stderr, run.stderr
    assert _store_ids(tmp_path / "h") == ["s0", "s1", "s2"]


def test_unclosed_writer_commits_when_collected(tmp_path):
    w = libdflash.HiddenWriter(tmp_path / "h", num_layers=1, hidden_size=4)
    w.append("a", np.ones((2, 4), dtype=np.float32))
    w.flush()
    w.append("b", np.ones((3, 4), dtype=np.float32))
    with pytest.warns(RuntimeWarning, match=r"garbage-collected, its 1 samples"):
        del w
        import gc
        gc.collect()
    assert _store_ids(tmp_path / "h") == ["a", "b"]
    # A writer left by an exception inside `with` still discards its buffer on purpose.
    with pytest.raises(RuntimeError):
        with libdflash.HiddenWriter(tmp_path / "h", num_layers=1, hidden_size=4) as w:
            w.append("c", np.ones((2, 4), dtype=np.float32))
            raise RuntimeError("the dump failed")
    assert _store_ids(tmp_path / "h") == ["a", "b"]
