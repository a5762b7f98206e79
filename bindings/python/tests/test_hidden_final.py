"""HiddenWriter(..., final_state=True): the target's post-norm final state per sample, read
back by HiddenStore.read_final_state (bit for bit in bf16), refused when missing or unasked
for; stores without it say so; `dflash inspect` shows which."""
import os
import subprocess

import numpy as np
import pytest

import libdflash


def _bf16(x):
    """float32 -> bf16 -> float32, round to nearest even (what a bf16 store keeps)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return (b.astype(np.uint32) << 16).view(np.float32)


def test_final_state_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    K, H = 2, 16
    x = {s: rng.standard_normal((n, K * H)).astype(np.float32) for s, n in (("a", 7), ("b", 3))}
    f = {s: rng.standard_normal((len(v), H)).astype(np.float32) * 4 for s, v in x.items()}
    with libdflash.HiddenWriter(tmp_path / "h", num_layers=K, hidden_size=H,
                                final_state=True) as w:
        for s in x:
            w.append(s, x[s], final_state=f[s])
    store = libdflash.HiddenStore(tmp_path / "h")
    assert store.final_state
    for s in x:
        np.testing.assert_array_equal(store.read(s), _bf16(x[s]))
        np.testing.assert_array_equal(store.read_final_state(s), _bf16(f[s]))
    st = libdflash.SafeTensors(tmp_path / "h")
    assert st.metadata["final_state"] == "post_norm"
    assert st["f/a"].shape == (7, H)


def test_final_state_torch_bf16_bit_exact_and_fp8(tmp_path):
    torch = pytest.importorskip("torch")
    x, f = torch.randn(5, 8).to(torch.bfloat16), torch.randn(5, 8).to(torch.bfloat16)
    with libdflash.HiddenWriter(tmp_path / "b", num_layers=1, hidden_size=8,
                                final_state=True) as w:
        w.append("x", x, final_state=f)
    np.testing.assert_array_equal(libdflash.HiddenStore(tmp_path / "b").read_final_state("x"),
                                  f.float().numpy())
    # fp8: e4m3 codes with a scale per token (amax / 448), as the layers
    with libdflash.HiddenWriter(tmp_path / "f", num_layers=1, hidden_size=8, dtype="fp8",
                                final_state=True) as w:
        w.append("x", x.float(), final_state=f.float())
    st = libdflash.SafeTensors(tmp_path / "f")
    scale = f.float().abs().amax(-1) / 448.0
    np.testing.assert_array_equal(st["fs/x"].reshape(-1), scale.numpy())
    want = (f.float() / scale[:, None]).to(torch.float8_e4m3fn).float() * scale[:, None]
    np.testing.assert_array_equal(libdflash.HiddenStore(tmp_path / "f").read_final_state("x"),
                                  want.numpy())


def test_final_state_refusals(tmp_path):
    x, f = np.ones((3, 8), np.float32), np.ones((3, 4), np.float32)
    with libdflash.HiddenWriter(tmp_path / "h", num_layers=2, hidden_size=4,
                                final_state=True) as w:
        with pytest.raises(ValueError, match="final_state is required"):
            w.append("a", x)
        with pytest.raises(ValueError, match=r"final_state has shape \(3, 8\)"):
            w.append("a", x, final_state=x)
        f[1, 2] = np.inf
        with pytest.raises(libdflash.Error, match="sample a: final state at token 1, column 2"):
            w.append("a", x, final_state=f)
        f[1, 2] = 0
        w.append("a", x, final_state=f)
    with pytest.raises(libdflash.Error) as e:  # appending without it to a store with it
        libdflash.HiddenWriter(tmp_path / "h", num_layers=2, hidden_size=4)
    assert e.value.status == "DFLASH_E_MISMATCH"
    with libdflash.HiddenWriter(tmp_path / "s", num_layers=2, hidden_size=4, shard_bytes=1 << 16,
                                spool_budget=1 << 22, final_state=True) as w:  # a spool too
        with pytest.raises(ValueError, match="final_state is required"):
            w.append("a", x)
        w.append("a", x, final_state=f)
    with libdflash.HiddenWriter(tmp_path / "p", num_layers=2, hidden_size=4) as w:
        with pytest.raises(ValueError, match="created without final_state"):
            w.append("a", x, final_state=f)
        w.append("a", x)
    plain = libdflash.HiddenStore(tmp_path / "p")
    assert not plain.final_state
    with pytest.raises(KeyError, match="holds no target final state"):
        plain.read_final_state("a")


def test_inspect_shows_final_state(tmp_path):
    cli = os.environ.get("DFLASH_CLI")
    if not cli:
        pytest.skip("DFLASH_CLI is not set")
    x, f = np.ones((3, 8), np.float32), np.ones((3, 4), np.float32)
    with libdflash.HiddenWriter(tmp_path / "h", num_layers=2, hidden_size=4,
                                final_state=True) as w:
        w.append("a", x, final_state=f)
    with libdflash.HiddenWriter(tmp_path / "p", num_layers=2, hidden_size=4) as w:
        w.append("a", x)
    out = subprocess.run([cli, "inspect", str(tmp_path / "h")], capture_output=True, text=True,
                         check=True).stdout
    assert "target final state (DSpark's L1 and confidence): stored" in out, out
    out = subprocess.run([cli, "inspect", str(tmp_path / "p")], capture_output=True, text=True,
                         check=True).stdout
    assert "target final state (DSpark's L1 and confidence): none" in out, out
