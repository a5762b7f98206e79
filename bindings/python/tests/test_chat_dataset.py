"""dflash.ChatTemplate and dflash.Dataset against independent references:
jinja2 over the official templates (tests/chat/hf_jinja.py), the tokenizers
library over the Qwen fixture, and safetensors' own reader for the shards."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import dflash

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "chat"))
FIX = pathlib.Path(os.environ.get("DFLASH_FIXTURES", ROOT / ".." / "shared" / "fixtures"))

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "reasoning_content": "Add them.", "content": "4"}]


def test_render_matches_jinja():
    pytest.importorskip("jinja2")
    import hf_jinja
    ref = hf_jinja.Reference()
    if "qwen3" not in ref.compiled:
        pytest.skip("template fixtures missing")
    for gen in (False, True):
        want = ref.render("qwen3", CONV, add_generation_prompt=gen, enable_thinking=True)
        assert dflash.ChatTemplate("qwen3").render(CONV, add_generation_prompt=gen) == want


def test_unknown_template_and_bad_conversation():
    with pytest.raises(dflash.Error) as e:
        dflash.ChatTemplate("nope")
    assert e.value.status == "DFLASH_E_NOT_FOUND"
    with pytest.raises(dflash.Error) as e:
        dflash.ChatTemplate("qwen3").render([{"role": "robot", "content": "x"}])
    assert "unknown role" in e.value.message


def test_tokenize_cli_round_trip(tmp_path):
    cli = os.environ.get("DFLASH_CLI")
    if not cli or not (FIX / "tokenizers" / "qwen2" / "vocab.json").exists():
        pytest.skip("needs DFLASH_CLI and the qwen2 tokenizer fixture")
    st = pytest.importorskip("safetensors.numpy")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": CONV}) + "\n" + "{not json\n" +
                   json.dumps({"messages": CONV[:2]}) + "\n")
    out = tmp_path / "ds"
    subprocess.run([cli, "tokenize", "--tokenizer", str(FIX / "tokenizers" / "qwen2"),
                    "--template", "qwen3", "-o", str(out), str(src)], check=True,
                   capture_output=True)
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejected] == [2, 3]
    assert "no assistant turn" in rejected[1]["reason"]
    with dflash.Dataset(out) as ds:
        assert len(ds) == 1
        sid, ids, mask = ds[0]
        assert sid.endswith(":1")
        shard = st.load_file(str(out / "shard-00000.safetensors"))
        assert np.array_equal(shard["input_ids"], ids)
        assert np.array_equal(shard["loss_mask"], mask)
        assert list(shard["offsets"]) == [0, len(ids)]
        tok = dflash.Tokenizer(str(FIX / "tokenizers" / "qwen2"))
        text = dflash.ChatTemplate("qwen3").render(CONV, reasoning="keep_after_last_user")
        # Supervised tokens spell exactly what the target wrote after its prompt.
        sup = tok.decode([int(t) for t, m in zip(ids, mask) if m]).decode()
        assert sup.endswith("4<|im_end|>") and sup.startswith("<think>\nAdd them.")
        assert tok.decode([int(t) for t in ids]).decode() == text
        assert ds.length_histogram(bin_width=1000, n_bins=2).tolist() == [1, 0]


def test_render_nfc():
    import unicodedata
    msgs = [{"role": "user", "content": "cafe\u0301 \u1100\u1161"},
            {"role": "assistant", "content": "A\u030a", "reasoning_content": "\u212b"}]
    tmpl = dflash.ChatTemplate("qwen3")
    raw = tmpl.render(msgs)
    assert "e\u0301" in raw  # untouched by default
    got = tmpl.render(msgs, nfc=True)
    want = tmpl.render([{k: unicodedata.normalize("NFC", v) for k, v in m.items()} for m in msgs])
    assert got == want == unicodedata.normalize("NFC", raw)


def test_tokenizer_hash(tmp_path):
    import hashlib
    from dflash.dataset import tokenizer_hash
    f = tmp_path / "ranks.tiktoken"
    f.write_bytes(b"some ranks")
    assert tokenizer_hash(str(f)) == "sha256:" + hashlib.sha256(b"some ranks").hexdigest()
    (tmp_path / "merges.txt").write_bytes(b"#v\n")
    (tmp_path / "vocab.json").write_bytes(b"{}")
    h = hashlib.sha256()
    for name in ("vocab.json", "merges.txt"):
        data = (tmp_path / name).read_bytes()
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    assert tokenizer_hash(str(tmp_path)) == "sha256:" + h.hexdigest()
    with pytest.raises(dflash.Error) as e:
        tokenizer_hash(str(tmp_path / "missing"))
    assert "missing" in e.value.message
