"""vLLM's hidden-state files (hs_{idx}.safetensors: hidden_states [T, K+1, H] in the model dtype
or F8_E4M3 with hidden_states_scales [T, 1, 1], token_ids I64 [T]; the last slot is the
target's final layer) as a hidden-state store, joined with the tokenized dataset by token ids.
The files are written here with torch + safetensors in that layout, as vLLM's connector does."""
import json
import os
import subprocess

import numpy as np
import pytest

import libdflash
from libdflash.hidden import write_dataset

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")


def write_vllm(folder, items, dtype=torch.bfloat16):
    """items: list of (token_ids, states [T, K+1, H] float32); file i is hs_{i}."""
    folder.mkdir(parents=True, exist_ok=True)
    decoded = []
    for i, (ids, states) in enumerate(items):
        x = torch.tensor(states)
        tensors = {"token_ids": torch.tensor(np.asarray(ids, np.int64))}
        if dtype == torch.float8_e4m3fn:
            scale = x.abs().amax(dim=(1, 2), keepdim=True).clamp(min=1e-12) / 448.0
            codes = (x / scale).to(torch.float8_e4m3fn)
            tensors["hidden_states"], tensors["hidden_states_scales"] = codes, scale.float()
            decoded.append((codes.float() * scale).numpy())
        else:
            tensors["hidden_states"] = x.to(dtype)
            decoded.append(x.to(dtype).float().numpy())
        st_torch.save_file(tensors, str(folder / f"hs_{i}.safetensors"))
    return decoded


def world(tmp_path, rng, K=2, H=8):
    samples = [(f"s{i}", rng.integers(0, 90, n).astype(np.int32), np.ones(n, bool))
               for i, n in enumerate([6, 9, 4])]
    samples.append(("odd", np.arange(5, dtype=np.int32), np.ones(5, bool)))  # no file has these
    write_dataset(tmp_path / "data", samples)
    # Files in another order than the dataset, plus one for a sample not in it.
    order = [2, 0, 1]
    items = [(samples[j][1], rng.standard_normal((len(samples[j][1]), K + 1, H)).astype(np.float32))
             for j in order]
    items.append((rng.integers(0, 90, 7), rng.standard_normal((7, K + 1, H)).astype(np.float32)))
    return samples, order, items


@pytest.mark.skipif(not os.environ.get("DFLASH_CLI"), reason="needs DFLASH_CLI")
def test_inspect_reads_the_vllm_layout_train_reads(tmp_path):
    """`dflash inspect` on a folder of hs_*.safetensors: the store summary (samples, rows,
    per-layer RMS as numpy computes it over the K drafter layers), as train and eval read it."""
    rng = np.random.default_rng(5)
    K, H = 2, 8
    _, _, items = world(tmp_path, rng, K, H)
    decoded = write_vllm(tmp_path / "vllm", items)
    r = subprocess.run([os.environ["DFLASH_CLI"], "inspect", str(tmp_path / "vllm")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = sum(len(d) for d in decoded)
    assert f"4 samples, {rows} tokens, {K} layers x {H} (bf16)" in r.stdout, r.stdout
    for k in range(K):
        x = np.concatenate([d[:, k, :] for d in decoded]).astype(np.float64)
        rms = float(np.sqrt(np.mean(x * x)))
        line = next(x for x in r.stdout.splitlines() if x.strip().startswith(f"layer {k}:"))
        got = float(line.split("rms ")[1].split(",")[0])
        assert abs(got - rms) <= 1e-5 * rms, (k, got, rms)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_vllm_files_join_by_token_ids(tmp_path, dtype):
    rng = np.random.default_rng(3)
    K, H = 2, 8
    samples, order, items = world(tmp_path, rng, K, H)
    td = torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn
    decoded = write_vllm(tmp_path / "vllm", items, td)
    store = libdflash.HiddenStore(tmp_path / "vllm")
    assert (store.num_layers, store.hidden_size, len(store)) == (K, H, 4)
    assert store.ids() == ["hs_0", "hs_1", "hs_2", "hs_3"]
    np.testing.assert_array_equal(store.read("hs_1"), decoded[1][:, :K, :].reshape(-1, K * H))
    stream = libdflash.SampleStream(tmp_path / "data", tmp_path / "vllm")
    got = {}
    for index, sid, ids, mask, hid in stream.iterate([0, 1, 2]):
        got[sid] = hid
    for f, j in enumerate(order):  # file f holds dataset sample j; its final-layer slot is dropped
        np.testing.assert_array_equal(got[samples[j][0]], decoded[f][:, :K, :].reshape(-1, K * H))
    with pytest.raises(libdflash.Error) as e:
        stream.check()
    assert "sample odd: no hs_*.safetensors file" in e.value.message


def test_training_on_vllm_files_equals_training_on_the_same_store(tmp_path):
    """The same bf16 hidden states as a libdflash store and as vLLM files: dflash train gives
    byte-identical checkpoints, so the vLLM reader feeds the trainer exactly what it holds."""
    cli = os.environ.get("DFLASH_CLI")
    if not cli:
        pytest.skip("DFLASH_CLI not set")
    rng = np.random.default_rng(4)
    V, H, K, B = 17, 16, 2, 4
    samples = [(f"s{i}", rng.integers(0, 16, 24).astype(np.int32), np.ones(24, bool))
               for i in range(6)]
    write_dataset(tmp_path / "data", samples)
    states = [rng.standard_normal((24, K + 1, H)).astype(np.float32) for _ in samples]
    decoded = write_vllm(tmp_path / "vllm", [(s[1], x) for s, x in zip(samples, states)][::-1])
    with libdflash.HiddenWriter(tmp_path / "store", num_layers=K, hidden_size=H) as w:
        for s, x in zip(samples, decoded[::-1]):
            w.append(s[0], x[:, :K, :].reshape(24, K * H))
    (tmp_path / "target").mkdir()
    libdflash.write_safetensors(tmp_path / "target" / "model.safetensors", {
        "model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
        "lm_head.weight": rng.standard_normal((V, H)).astype(np.float32)})
    cfg = {"architectures": ["DFlashDraftModel"], "hidden_size": H, "intermediate_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 8, "vocab_size": V, "num_target_layers": 8, "block_size": B,
           "dflash_config": {"mask_token_id": 16, "target_layer_ids": [2, 5]}}
    (tmp_path / "drafter.json").write_text(json.dumps(cfg))
    outs = {}
    for name in ("store", "vllm"):
        outs[name] = tmp_path / f"run-{name}"
        subprocess.run([cli, "train", "--config", tmp_path / "drafter.json", "--target",
                        tmp_path / "target", "--data", tmp_path / "data", "--hidden",
                        tmp_path / name, "-o", outs[name], "--epochs", "2", "--anchors", "4",
                        "--threads", "1", "--quiet"], check=True, capture_output=True)
    a = (outs["store"] / "model.safetensors").read_bytes()
    assert a == (outs["vllm"] / "model.safetensors").read_bytes()
    lines = (outs["vllm"] / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 12 and json.loads(lines[0])["loss"] > 0
