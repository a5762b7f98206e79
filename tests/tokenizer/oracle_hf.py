"""Parity with Hugging Face `tokenizers` on the Qwen2 vocabulary (fixture vocab.json +
merges.txt): the directory itself, tokenizer.json files built here at test time (Qwen2,
Qwen3.5 pattern, a GPT-2 style ByteLevel + Digits pipeline with lstrip/rstrip added tokens,
ignore_merges, a vocabulary missing single-byte tokens), special tokens on and off.

Usage: oracle_hf.py FIXTURES  (DFLASH_CORPUS_MB sets the document corpus size)."""
import json
import os
import sys
import tempfile
import time

from oracle_common import Tally, corpus_mb, fixtures_dir, skip
import corpus

try:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
except ImportError:
    skip("tokenizers is not installed")
import libdflash

QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
         r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN35 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
          r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build(vocab_dir, pattern=None, gpt2_style=False, ignore_merges=False):
    tok = Tokenizer(BPE.from_file(os.path.join(vocab_dir, "vocab.json"),
                                  os.path.join(vocab_dir, "merges.txt"),
                                  ignore_merges=ignore_merges))
    if gpt2_style:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)])
        tok.add_special_tokens(QWEN_SPECIALS)
        # lstrip / rstrip on specials, and a non-special added token
        tok.add_special_tokens([AddedToken("<tool_call>", lstrip=True, rstrip=True)])
        tok.add_tokens([AddedToken("[[note]]", normalized=False)])
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.add_special_tokens(QWEN_SPECIALS)
    tok.decoder = decoders.ByteLevel()
    return tok


def build_split(vocab_dir, pattern, behavior, invert):
    tok = Tokenizer(BPE.from_file(os.path.join(vocab_dir, "vocab.json"),
                                  os.path.join(vocab_dir, "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern, behavior=behavior, invert=invert),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


# Single bytes removed from the vocabulary: some real vocabularies lack bytes that never
# occur in UTF-8 (SmolLM2 lacks 21); here also common ones, so the corpus drops them.
GAP_BYTES = [0x04, 0xc1, 0xf5, 0x20, 0x2c, 0x65, 0xa9, 0xe6]
GAP_STRINGS = ["e", " ", ",", "e e", "ee,e ", "ab e cd", "café", "日本", " , e", "the one"]


def byte_chars():
    """GPT-2's byte-level alphabet: byte -> the character standing for it."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def without_bytes(src, dst, gap_bytes):
    """Copy tokenizer.json src to dst without the single-byte tokens of gap_bytes and
    the merges that use them (HF refuses a merge of a token not in the vocabulary).
    The ids stay dense (HF renumbers added tokens past a vocabulary with holes): each
    removed token is renamed to a string outside the byte-level alphabet, which no
    piece can be."""
    with open(src, encoding="utf-8") as f:
        doc = json.load(f)
    chars = byte_chars()
    gone = {chars[b]: f"\u2400{b:02x}" for b in gap_bytes}
    model = doc["model"]
    model["vocab"] = {gone.get(k, k): v for k, v in model["vocab"].items()}
    pairs = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    kept = [m for m, (a, b) in zip(model["merges"], pairs) if a not in gone and b not in gone]
    assert len(kept) < len(model["merges"])
    model["merges"] = kept
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)


def hf_encode(tok, texts, special):
    tok.encode_special_tokens = special == "none"
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def compare(tally, name, ours, ref, strings, docs, bad):
    t0 = time.time()
    extra = ["<tool_call>", " x <tool_call>  y", "a\t<tool_call>\n b", "[[note]]x", " [[note]] "]
    strings = strings + extra
    for special in ("all", "none"):
        tally.check(f"{name} strings special={special}", ours.encode_batch(strings, special=special),
                    hf_encode(ref, strings, special), strings)
    tally.check(f"{name} strings one by one", [ours.encode(s) for s in strings[:1500]],
                hf_encode(ref, strings[:1500], "all"), strings[:1500])
    tally.check(f"{name} documents ({sum(len(d.encode()) for d in docs) / 1e6:.1f} MB)",
                ours.encode_batch(docs), hf_encode(ref, docs, "all"), docs)
    fixed = [b.decode("utf-8", "replace") for b in bad]
    tally.check(f"{name} invalid UTF-8 bytes", [ours.encode(b) for b in bad],
                hf_encode(ref, fixed, "all"), bad)
    longs = ["a" * 6000, "".join(chr(97 + (i * 7919) % 26) for i in range(6000)),
             " " * 20000 + "x", "1" * 3000, "日本語" * 2000]
    tally.check(f"{name} long pieces", [ours.encode(s) for s in longs],
                hf_encode(ref, longs, "all"), longs)
    rl = corpus.repeated_long()
    tally.check(f"{name} repeated long pieces, one by one", [ours.encode(s) for s in rl],
                hf_encode(ref, rl, "all"), rl)
    print(f"  ({time.time() - t0:.1f}s)")


def main():
    vocab_dir = os.path.join(fixtures_dir(), "tokenizers", "qwen2")
    if not os.path.exists(os.path.join(vocab_dir, "merges.txt")):
        skip(f"{vocab_dir} is absent")
    strings = corpus.strings(4000)
    docs = corpus.documents(corpus_mb("20") / 4, seed=5)  # HF tokenizers is ~10x slower
    bad = corpus.invalid_bytes(300)
    print(f"corpus: {len(strings)} strings, {len(docs)} documents "
          f"({sum(len(d.encode()) for d in docs) / 1e6:.1f} MB per tokenizer), {len(bad)} invalid")
    tally = Tally()
    qwen2 = build(vocab_dir, QWEN2)
    with libdflash.Tokenizer(vocab_dir) as ours:  # vocab.json + merges.txt + config, as shipped
        assert ours.vocab_size == qwen2.get_vocab_size(), (ours.vocab_size, qwen2.get_vocab_size())
        assert ours.token_to_id("<|im_end|>") == 151645 and ours.is_special(151645)
        compare(tally, "qwen2 directory", ours, qwen2, strings, docs, bad)
    with tempfile.TemporaryDirectory() as tmp:
        variants = [("qwen2 tokenizer.json", qwen2, None),
                    ("qwen3.5 pattern tokenizer.json", build(vocab_dir, QWEN35), None),
                    ("qwen2 ignore_merges", build(vocab_dir, QWEN2, ignore_merges=True), None),
                    ("gpt2-style ByteLevel+Digits", build(vocab_dir, gpt2_style=True), None)]
        for i, (name, ref, pattern) in enumerate(variants):
            path = os.path.join(tmp, f"tokenizer{i}.json")
            ref.save(path)
            small_docs = docs if i == 0 else docs[: max(1, len(docs) // 4)]
            with libdflash.Tokenizer(path, pattern=pattern) as ours:
                compare(tally, name, ours, ref, strings, small_docs, bad)
        # a vocabulary missing single bytes: HF drops them from each piece before merging
        # (after the whole-piece lookup of ignore_merges)
        for j, (name, src) in enumerate((("qwen2 missing bytes", 0),
                                         ("qwen2 missing bytes ignore_merges", 2))):
            path = os.path.join(tmp, f"gaps{j}.json")
            without_bytes(os.path.join(tmp, f"tokenizer{src}.json"), path, GAP_BYTES)
            with libdflash.Tokenizer(path) as ours:
                compare(tally, name, ours, Tokenizer.from_file(path), strings + GAP_STRINGS,
                        docs[: max(1, len(docs) // 4)], bad)
        # the PCRE2 path (scanners off) on the same strings
        os.environ["DFLASH_TOKENIZER_NO_SCANNER"] = "1"
        for i in (0, 1):
            with libdflash.Tokenizer(os.path.join(tmp, f"tokenizer{i}.json")) as ours:
                name, ref = variants[i][0], variants[i][1]
                tally.check(f"{name} regex path strings", ours.encode_batch(strings),
                            hf_encode(ref, strings, "all"), strings)
        del os.environ["DFLASH_TOKENIZER_NO_SCANNER"]
        # every Split behaviour, inverted or not, with a regex and with a literal pattern
        for k, (pattern, behavior, invert) in enumerate(
                [(Regex(r"[\s,.]+"), b, inv) for b in ("removed", "merged_with_previous",
                                                       "merged_with_next", "contiguous")
                 for inv in (False, True)] + [(" ", "merged_with_next", False),
                                              (Regex(r"\p{N}"), "contiguous", False)]):
            ref = build_split(vocab_dir, pattern, behavior, invert)
            path = os.path.join(tmp, f"split{k}.json")
            ref.save(path)
            with libdflash.Tokenizer(path) as ours:
                name = f"Split {behavior} invert={invert} {'regex' if k < 8 or k == 9 else 'literal'}"
                tally.check(name, ours.encode_batch(strings), hf_encode(ref, strings, "all"), strings)
        # the named pattern on the vocab directory equals the regex spelled in tokenizer.json
        with libdflash.Tokenizer(vocab_dir, pattern="qwen3.5") as ours:
            ref = variants[1][1]
            tally.check("qwen3.5 named pattern on the directory", ours.encode_batch(strings),
                        hf_encode(ref, strings, "all"), strings)
    return tally.finish()


if __name__ == "__main__":
    sys.exit(main())
