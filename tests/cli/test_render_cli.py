#!/usr/bin/env python3
"""`dflash render` against independent references:
- the text equals jinja2 (configured as Hugging Face does) for every template,
  with and without the generation prompt / thinking switches;
- `--mask` gives the ids HF `tokenizers` produces for that text (Qwen2 fixture)
  and the mask of the span rule over HF's token pieces;
- non-NFC input (decomposed accents, Hangul jamo, singleton decompositions) with
  an NFC tokenizer: the ids equal HF's encoding of jinja's rendering of the raw
  input (HF normalises when it encodes), and the text and mask are those of the
  input normalised by Python's unicodedata;
- bad input fails with a message and a non-zero exit.
Exit 77 when DFLASH_CLI, jinja2, tokenizers or the fixtures are missing."""
import json
import os
import subprocess
import sys
import unicodedata

# The chat tests' references (jinja2 as Hugging Face configures it, the corpus generator).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "chat"))
try:
    import gen_conversations
    import hf_jinja
    import test_masks
except SystemExit:  # test_masks exits 77 without tokenizers/tiktoken
    raise
except ImportError as e:
    print("SKIP:", e)
    sys.exit(77)

from libdflash.chat import ChatTemplate  # noqa: E402

CLI = os.environ.get("DFLASH_CLI")
TOK = hf_jinja.fixtures_dir() / "tokenizers" / "qwen2"
DIR_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # the fixture's added_tokens.json


def cli(args, stdin):
    return subprocess.run([CLI, "render", *args], input=stdin.encode(), capture_output=True)


def nfc_all(v):
    """Every string (and object key) of a JSON value in NFC, as unicodedata computes it."""
    if isinstance(v, str):
        return unicodedata.normalize("NFC", v)
    if isinstance(v, list):
        return [nfc_all(x) for x in v]
    if isinstance(v, dict):
        return {nfc_all(k): nfc_all(x) for k, x in v.items()}
    return v


def flags_for(name, i):
    flags, kw = [], {}
    if i % 2:
        flags.append("--generation-prompt")
        kw["add_generation_prompt"] = True
    if name not in ("kimi-k2", "kimi-k2-thinking", "smollm2", "chatml") and i % 3 == 0:
        flags.append("--no-thinking")
        kw["thinking" if name.startswith("kimi") else "enable_thinking"] = False
    if name == "kimi-k2.6" and i % 4 in (1, 2):  # with i % 3: both thinking settings
        flags.append("--preserve-thinking")
        kw["preserve_thinking"] = True
    return flags, kw


def check_text(ref, stats):
    for name in ref.compiled:
        for i, (msgs, tools) in enumerate(gen_conversations.corpus(40, seed=11)):
            flags, kw = flags_for(name, i)
            doc = json.dumps({"messages": msgs, "tools": tools} if tools else {"messages": msgs},
                             ensure_ascii=False)
            r = cli(["--template", name, *flags], doc)
            try:
                want = ref.render(name, hf_jinja.normalize(name, msgs), tools=tools, **kw)
            except Exception:
                want = None
            if r.returncode != 0:
                assert r.stderr.startswith(b"dflash render: "), r.stderr
                stats["refused"] += 1
                continue
            assert want is not None, (name, i, "jinja fails, dflash renders")
            assert r.stdout.decode() == want, (name, i, flags)
            stats["text equal"] += 1


def mask_output(doc, *extra):
    # The official template's text (--mask alone takes tokenize's keep_after_last_user).
    r = cli(["--template", "qwen3", "--tokenizer", str(TOK), "--mask", "--reasoning", "official",
             *extra], doc)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def check_mask(ref, tok, msgs, tools, stats, raw_msgs=None):
    """`msgs` is what the mask must describe; `raw_msgs` (when given) what is fed in."""
    fed = raw_msgs if raw_msgs is not None else msgs
    doc = json.dumps({"messages": fed, "tools": tools} if tools else {"messages": fed},
                     ensure_ascii=False)
    out = mask_output(doc)
    text = ref.render("qwen3", hf_jinja.normalize("qwen3", msgs), tools=tools)
    assert out["text"] == text
    raw_text = ref.render("qwen3", hf_jinja.normalize("qwen3", fed), tools=tools)
    want_ids = tok.tok.encode(raw_text, add_special_tokens=False).ids
    assert out["ids"] == want_ids, "ids differ from HF tokenizers"
    begin, end = test_masks.offsets(tok.pieces(text))
    want_mask = ChatTemplate("qwen3").render_full(msgs, tools=tools).loss_mask(begin, end)
    assert out["loss_mask"] == want_mask.tolist()
    stats["mask equal"] += 1
    return raw_text != text


NON_NFC = ["e\u0301", "A\u030a", "\u1100\u1161\u11a8", "\u212b", "o\u0308\u0304", "a\u0323\u0302",
           "\u0915\u093c", "\u0338x"]


def decompose(v, k):
    """Replace some characters of every string by non-NFC spellings."""
    if isinstance(v, str):
        swaps = {"é": "e\u0301", "a": NON_NFC[k % len(NON_NFC)] if k % 3 == 0 else "a",
                 "Ω": "\u2126", "ç": "c\u0327"}
        return "".join(swaps.get(ch, ch) for ch in v)
    if isinstance(v, list):
        return [decompose(x, k) for x in v]
    if isinstance(v, dict):
        return {key: decompose(x, k) for key, x in v.items()}
    return v


def check_nfc(ref, tok, stats):
    changed = 0
    for k, (msgs, tools) in enumerate(gen_conversations.corpus(70, seed=23)):
        if any(m.get("tool_calls") or m.get("role") == "tool" for m in msgs) or tools:
            msgs = [m for m in msgs if m["role"] in ("system", "user", "assistant")
                    and not m.get("tool_calls")]
            tools = None
        if not any(m["role"] == "assistant" for m in msgs):
            continue
        raw = [dict(decompose({x: y for x, y in m.items() if x != "role"}, k), role=m["role"])
               for m in msgs]
        try:
            ref.render("qwen3", hf_jinja.normalize("qwen3", raw))
        except Exception:
            continue
        if not isinstance(raw[0].get("content"), str) and raw[0]["role"] == "system":
            continue
        changed += check_mask(ref, tok, nfc_all(raw), None, stats, raw_msgs=raw)
    stats["non-NFC conversations (text changed by NFC)"] += changed
    assert changed > 25, changed


def check_errors():
    r = cli(["--template", "qwen3", "--mask"], "[]")
    assert r.returncode == 2 and b"missing --tokenizer (for --mask)" in r.stderr, r.stderr
    r = cli(["--template", "qwen3"], "{oops")
    assert r.returncode == 1 and b"invalid JSON" in r.stderr, r.stderr
    r = cli(["--template", "nope"], "[]")
    assert r.returncode == 1 and b"unknown chat template" in r.stderr, r.stderr
    r = cli(["--template", "qwen3"], json.dumps([{"role": "robot", "content": "x"}]))
    assert r.returncode == 1 and b"unknown role" in r.stderr, r.stderr


def main():
    if not CLI or not (TOK / "vocab.json").exists():
        print("SKIP: needs DFLASH_CLI and the qwen2 tokenizer fixture")
        sys.exit(77)
    ref = hf_jinja.Reference()
    if ref.missing:
        print("SKIP: template fixtures missing:", ref.missing)
        sys.exit(77)
    tok = test_masks.QwenTok(TOK, DIR_SPECIALS)
    stats = {"text equal": 0, "refused": 0, "mask equal": 0,
             "non-NFC conversations (text changed by NFC)": 0}
    check_text(ref, stats)
    for msgs, tools in gen_conversations.corpus(24, seed=5):
        if any(m["role"] == "assistant" for m in msgs):
            try:
                ref.render("qwen3", hf_jinja.normalize("qwen3", msgs), tools=tools)
            except Exception:
                continue
            if msgs[0]["role"] == "system" and not isinstance(msgs[0]["content"], str):
                continue
            check_mask(ref, tok, msgs, tools, stats)
    check_nfc(ref, tok, stats)
    check_errors()
    for k, v in stats.items():
        print(f"{k:45s} {v}")
    print("render CLI: OK")


if __name__ == "__main__":
    main()
