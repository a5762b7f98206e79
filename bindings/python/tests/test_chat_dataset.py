"""libdflash.ChatTemplate and libdflash.Dataset against independent references:
jinja2 over the official templates (tests/chat/hf_jinja.py), the tokenizers
library over the Qwen fixture, and safetensors' own reader for the shards."""
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import libdflash

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
        assert libdflash.ChatTemplate("qwen3").render(CONV, add_generation_prompt=gen) == want


def test_unknown_template_and_bad_conversation():
    with pytest.raises(libdflash.Error) as e:
        libdflash.ChatTemplate("nope")
    assert e.value.status == "DFLASH_E_NOT_FOUND"
    with pytest.raises(libdflash.Error) as e:
        libdflash.ChatTemplate("qwen3").render([{"role": "robot", "content": "x"}])
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
                    "--template", "qwen3", "--max-reject-ratio", "1",
                    "--allow-split-control-tokens", "-o", str(out), str(src)],
                   check=True, capture_output=True)
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejected] == [2, 3]
    assert "no assistant turn" in rejected[1]["reason"]
    with libdflash.Dataset(out) as ds:
        assert len(ds) == 1
        sid, ids, mask = ds[0]
        # No "id" in the record: fetch's derived id (SHA-256 of the key-sorted compact messages).
        text = json.dumps(CONV, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert sid == "h" + hashlib.sha256(text.encode()).hexdigest()[:32]
        shard = st.load_file(str(out / "shard-00000.safetensors"))
        assert np.array_equal(shard["input_ids"], ids)
        assert np.array_equal(shard["loss_mask"], mask)
        assert list(shard["offsets"]) == [0, len(ids)]
        tok = libdflash.Tokenizer(str(FIX / "tokenizers" / "qwen2"))
        text = libdflash.ChatTemplate("qwen3").render(CONV, reasoning="keep_after_last_user")
        # Supervised tokens spell exactly what the target wrote after its prompt.
        sup = tok.decode([int(t) for t, m in zip(ids, mask) if m])
        assert sup.endswith("4<|im_end|>") and sup.startswith("<think>\nAdd them.")
        assert tok.decode([int(t) for t in ids]) == text
        assert ds.length_histogram(bin_width=1000, n_bins=2).tolist() == [1, 0]


def test_render_nfc():
    import unicodedata
    msgs = [{"role": "user", "content": "cafe\u0301 \u1100\u1161"},
            {"role": "assistant", "content": "A\u030a", "reasoning_content": "\u212b"}]
    tmpl = libdflash.ChatTemplate("qwen3")
    raw = tmpl.render(msgs)
    assert "e\u0301" in raw  # untouched by default
    got = tmpl.render(msgs, nfc=True)
    want = tmpl.render([{k: unicodedata.normalize("NFC", v) for k, v in m.items()} for m in msgs])
    assert got == want == unicodedata.normalize("NFC", raw)


def test_tokenizer_hash(tmp_path):
    """The hash is the tokenizer's identity, not its files' bytes; a manifest's older hash of
    the files' bytes still matches them (tokenizer_matches)."""
    from libdflash.dataset import tokenizer_hash, tokenizer_matches
    src = FIX / "tokenizers" / "qwen2"
    if not (src / "vocab.json").exists():
        pytest.skip("qwen2 tokenizer fixture missing")
    names = ["tokenizer_config.json", "vocab.json", "merges.txt", "added_tokens.json",
             "special_tokens_map.json"]
    for name in names:
        (tmp_path / name).write_bytes((src / name).read_bytes())
    h = tokenizer_hash(str(tmp_path))
    assert h == libdflash.Tokenizer(tmp_path).hash() and h.startswith("sha256:")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["model_max_length"] = 7
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_hash(str(tmp_path)) == h
    old = hashlib.sha256()  # what manifests recorded before: the files' bytes, framed
    for name in names:
        data = (tmp_path / name).read_bytes()
        old.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    assert tokenizer_matches(str(tmp_path), "sha256:" + old.hexdigest())
    assert tokenizer_matches(str(tmp_path), h)
    with pytest.raises(libdflash.Error, match="other tokens"):
        tokenizer_matches(str(tmp_path), "sha256:" + "0" * 64)
    with pytest.raises(libdflash.Error) as e:
        tokenizer_hash(str(tmp_path / "missing"))
    assert "missing" in e.value.message


def test_template_names_and_conversations():
    from libdflash.chat import template_names
    for name in template_names():
        with libdflash.ChatTemplate(name) as t:
            assert t.name == name
    with libdflash.Conversation(CONV) as c:
        assert len(c) == 3
    # A fetch record: its completion counts as one more (assistant) message.
    record = {"messages": CONV[:2], "completion": {"role": "assistant", "content": "4"}}
    with libdflash.Conversation(json.dumps(record)) as c:
        assert len(c) == 3
        assert libdflash.ChatTemplate("qwen3").render(c) == \
            libdflash.ChatTemplate("qwen3").render(CONV[:2] + [{"role": "assistant", "content": "4"}])
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    assert len(libdflash.Conversation(sharegpt)) == 2
    with pytest.raises(libdflash.Error) as e:
        libdflash.Conversation("{not json")
    assert e.value.status == "DFLASH_E_JSON"


def test_conversation_nfc_in_place():
    import unicodedata
    msgs = [{"role": "user", "content": "cafe\u0301"}, {"role": "assistant", "content": "A\u030a"}]
    tmpl = libdflash.ChatTemplate("qwen3")
    with libdflash.Conversation(msgs) as c:
        assert "e\u0301" in tmpl.render(c)
        c.normalize_nfc()
        assert tmpl.render(c) == unicodedata.normalize("NFC", tmpl.render(msgs))


def qwen2_tokenizer():
    path = FIX / "tokenizers" / "qwen2"
    if not (path / "vocab.json").exists():
        pytest.skip("qwen2 tokenizer fixture absent")
    return libdflash.Tokenizer(str(path))


def test_tokenizer_nfc_probe():
    from libdflash.chat import tokenizer_nfc
    with qwen2_tokenizer() as qwen:
        assert tokenizer_nfc(qwen)  # Qwen2's tokenizer.json normalises with NFC
        assert qwen.decode(qwen.encode("e\u0301")) == "\u00e9"
    cl100k = FIX / "tokenizers" / "openai" / "cl100k_base.tiktoken.gz"
    if cl100k.exists():
        with libdflash.Tokenizer(str(cl100k)) as tok:
            assert not tokenizer_nfc(tok)


def test_check_tokenizer_names_split_control_tokens():
    """qwen2's tokenizer has the ChatML markers as specials but not Qwen3's <think> and tool
    tags (Qwen3's own tokenizer adds them): chatml passes, qwen3 and kimi are refused."""
    with qwen2_tokenizer() as qwen:
        assert all(len(qwen.encode(t)) == 1 for t in ("<|im_start|>", "<|im_end|>"))
        libdflash.ChatTemplate("chatml").check_tokenizer(qwen)
        with pytest.raises(libdflash.Error) as e:
            libdflash.ChatTemplate("qwen3").check_tokenizer(qwen)
        n = len(qwen.encode("<think>"))
        assert e.value.status == "DFLASH_E_MISMATCH"
        assert f"<think> ({n} ids)" in e.value.message and "<|im_start|>" not in e.value.message
        with pytest.raises(libdflash.Error) as e:
            libdflash.ChatTemplate("kimi-k2.6").check_tokenizer(qwen)
        for tag in ("<|im_user|>", "<|im_middle|>", "<|tool_call_begin|>", "</think>"):
            assert tag in e.value.message, tag


def test_chat_encode_equals_encode_plus_mask():
    tmpl = libdflash.ChatTemplate("qwen3")
    conv = CONV + [{"role": "user", "content": "And 3+3?"},
                   {"role": "assistant", "reasoning_content": "Add.", "content": "6"}]
    with qwen2_tokenizer() as tok:
        for last_only in (False, True):
            r = tmpl.render_full(conv, reasoning="keep_all")
            ids, mask, n_sup = r.encode(tok, last_turn_only=last_only)
            want = tok.encode(r.data)
            np.testing.assert_array_equal(ids, want)
            ends = np.cumsum([len(tok.id_to_token(t)) for t in want])
            begins = np.concatenate([[0], ends[:-1]])
            np.testing.assert_array_equal(mask, r.loss_mask(begins, ends, last_only))
            assert n_sup == int(mask.sum()) > 0
            sup = tok.decode(ids[mask == 1])
            assert sup.endswith("6<|im_end|>")
            assert ("4<|im_end|>" in sup) != last_only
        # Non-NFC text: the NFC tokenizer's tokens no longer spell the bytes.
        r = tmpl.render_full([{"role": "user", "content": "cafe\u0301"},
                              {"role": "assistant", "content": "ok"}])
        with pytest.raises(libdflash.Error) as e:
            r.encode(tok)
        assert e.value.status == "DFLASH_E_MISMATCH"
        r = tmpl.render_full([{"role": "user", "content": "cafe\u0301"},
                              {"role": "assistant", "content": "ok"}], nfc=True)
        ids, mask, n_sup = r.encode(tok)
        assert tok.decode_bytes(ids) == r.data and n_sup == int(mask.sum()) > 0


def test_dataset_writer_options_and_shards(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    samples = [(f"id{i}", rng.integers(0, 1000, 10 + i).astype(np.int32),
                (rng.random(10 + i) < 0.5).astype(np.uint8)) for i in range(7)]
    with libdflash.DatasetWriter(tmp_path / "ds", shard_tokens=25, tokenizer_hash="sha256:" + "0" * 64,
                              template="qwen3", options={"reasoning": "keep_all"}) as w:
        for s in samples:
            w.add(*s)
    manifest = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    assert manifest["tokenizer_hash"] == "sha256:" + "0" * 64 and manifest["template"] == "qwen3"
    assert manifest["options"] == {"reasoning": "keep_all"}
    assert manifest["samples"] == 7 and manifest["tokens"] == sum(10 + i for i in range(7))
    # Each shard is closed by the sample that brings it to 25 tokens or more.
    assert [s["samples"] for s in manifest["shards"]] == [3, 2, 2]
    shard = st.load_file(str(tmp_path / "ds" / manifest["shards"][1]["file"]))
    np.testing.assert_array_equal(shard["input_ids"], np.concatenate([samples[3][1], samples[4][1]]))
    with libdflash.Dataset(tmp_path / "ds") as ds:
        for (sid, ids, mask), (wsid, wids, wmask) in zip(ds, samples):
            assert sid == wsid
            np.testing.assert_array_equal(ids, wids)
            np.testing.assert_array_equal(mask, wmask)
    # An exception inside the block leaves no manifest: the directory reads as unfinished.
    with pytest.raises(RuntimeError):
        with libdflash.DatasetWriter(tmp_path / "bad") as w:
            w.add("a", [1, 2], [1, 1])
            raise RuntimeError
    assert not (tmp_path / "bad" / "dataset.json").exists()
    with pytest.raises(libdflash.Error) as e:
        libdflash.DatasetWriter(tmp_path / "ds")
    assert e.value.status == "DFLASH_E_EXISTS"
    with pytest.raises(ValueError):
        libdflash.DatasetWriter(tmp_path / "c").add("x", [1, 2, 3], [1])
