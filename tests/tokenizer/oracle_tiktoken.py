"""Parity with tiktoken: cl100k, o200k (fixture rank files) and the Kimi K2 pattern and
special-token layout over o200k's ranks (a synthetic Kimi model directory).

Usage: oracle_tiktoken.py FIXTURES  (DFLASH_CORPUS_MB sets the document corpus size)."""
import base64
import gzip
import json
import os
import sys
import tempfile
import time

from oracle_common import Tally, corpus_mb, fixtures_dir, skip
import corpus

try:
    import tiktoken
except ImportError:
    skip("tiktoken is not installed")
import libdflash

CL100K = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"""
          r"""[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
O200K = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""",
    r"""\s+"""])
# Moonshot's tokenization_kimi.py pat_str, verbatim.
KIMI = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""",
    r"""\s+"""])
# Kimi K2.5's named specials, as offsets from the first special slot.
KIMI_NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
              6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
              11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
              13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
              15: "<|tool_call_end|>", 17: "<|im_middle|>", 18: "<|media_begin|>",
              19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 22: "<think>",
              23: "</think>", 254: "[UNK]", 255: "[PAD]"}


def load_ranks(path):
    with gzip.open(path) as f:
        lines = f.read().splitlines()
    return {base64.b64decode(t): int(r) for t, r in (l.split() for l in lines if l)}


def kimi_dir(tmp, ranks_path, ranks):
    """A Kimi-layout model directory: tiktoken.model (plain rank file) + tokenizer_config.json."""
    d = os.path.join(tmp, "kimi")
    os.makedirs(d)
    with gzip.open(ranks_path) as src, open(os.path.join(d, "tiktoken.model"), "wb") as dst:
        dst.write(src.read())
    base = len(ranks)
    decoder = {str(base + k): {"content": v, "lstrip": False, "normalized": False,
                               "rstrip": False, "single_word": False, "special": True}
               for k, v in KIMI_NAMED.items()}
    cfg = {"tokenizer_class": "TikTokenTokenizer",
           "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
           "added_tokens_decoder": decoder}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    specials = {KIMI_NAMED.get(i - base, f"<|reserved_token_{i}|>"): i
                for i in range(base, base + 256)}
    return d, specials


def regex_path(path):
    """The same tokenizer with the hand-written scanners off (PCRE2 only)."""
    os.environ["DFLASH_TOKENIZER_NO_SCANNER"] = "1"
    try:
        return libdflash.Tokenizer(path)
    finally:
        del os.environ["DFLASH_TOKENIZER_NO_SCANNER"]


def compare_regex_path(tally, name, path, ref, strings, docs):
    with regex_path(path) as ours:
        tally.check(f"{name} regex path strings", ours.encode_batch(strings),
                    [ref.encode(s, allowed_special="all") for s in strings], strings)
        tally.check(f"{name} regex path documents", ours.encode_batch(docs),
                    ref.encode_batch(docs, allowed_special="all", num_threads=2), docs)


def compare(tally, name, ours, ref, strings, docs, bad):
    t0 = time.time()
    tally.check(f"{name} strings special=all", ours.encode_batch(strings),
                [ref.encode(s, allowed_special="all") for s in strings], strings)
    tally.check(f"{name} strings special=none", ours.encode_batch(strings, special="none"),
                [ref.encode_ordinary(s) for s in strings], strings)
    tally.check(f"{name} strings one by one", [ours.encode(s) for s in strings[:2000]],
                [ref.encode(s, allowed_special="all") for s in strings[:2000]], strings[:2000])
    ref_docs = ref.encode_batch(docs, allowed_special="all", num_threads=2)
    tally.check(f"{name} documents ({sum(len(d.encode()) for d in docs) / 1e6:.1f} MB)",
                ours.encode_batch(docs), ref_docs, docs)
    tally.check(f"{name} invalid UTF-8 bytes", [ours.encode(b) for b in bad],
                [ref.encode(b.decode("utf-8", "replace"), allowed_special="all") for b in bad], bad)
    rt = [ours.decode_bytes(ids) for ids in ref_docs]
    tally.check(f"{name} decode(documents) == text", [[x] for x in rt],
                [[d.encode()] for d in docs], docs)
    longs = ["a" * 12000, "".join(chr(97 + (i * 7919) % 26) for i in range(12000)),
             " " * 20000 + "x", "1" * 9000, "日本語" * 3000, "😀" * 3000]
    tally.check(f"{name} long pieces", [ours.encode(s) for s in longs],
                [ref.encode_ordinary(s) for s in longs], longs)
    rl = corpus.repeated_long()
    tally.check(f"{name} repeated long pieces, one by one", [ours.encode(s) for s in rl],
                [ref.encode_ordinary(s) for s in rl], rl)
    print(f"  ({time.time() - t0:.1f}s)")


def discriminates(k_ref, ranks, specials, strings):
    """The corpus must tell Kimi's pattern from its near misses: o200k's pattern, and Han as
    Script_Extensions (PCRE2's reading of a bare \\p{Han}, which takes U+3001..U+3003)."""
    scx = tiktoken.Encoding("kimi-scx", pat_str=KIMI.replace(r"\p{Han}", r"\p{scx=Han}"),
                            mergeable_ranks=ranks, special_tokens=specials)
    o2 = tiktoken.Encoding("o200k-sp", pat_str=O200K, mergeable_ranks=ranks, special_tokens=specials)
    for name, other in (("Script_Extensions Han", scx), ("o200k pattern", o2)):
        differ = sum(k_ref.encode(s, allowed_special="all") != other.encode(s, allowed_special="all")
                     for s in strings)
        print(f"  corpus strings where Kimi differs from {name}: {differ}")
        if differ == 0:
            raise SystemExit(f"corpus does not exercise the Kimi pattern against {name}")


def main():
    fx = fixtures_dir()
    paths = {n: os.path.join(fx, "tokenizers", "openai", f"{n}_base.tiktoken.gz")
             for n in ("cl100k", "o200k")}
    for p in paths.values():
        if not os.path.exists(p):
            skip(f"{p} is absent")
    strings = corpus.strings()
    docs = corpus.documents(corpus_mb("20"))
    bad = corpus.invalid_bytes()
    print(f"corpus: {len(strings)} strings, {len(docs)} documents "
          f"({sum(len(d.encode()) for d in docs) / 1e6:.1f} MB per encoding), {len(bad)} invalid")
    tally = Tally()
    cl_ranks = load_ranks(paths["cl100k"])
    cl_ref = tiktoken.Encoding("cl100k_base", pat_str=CL100K, mergeable_ranks=cl_ranks,
                               special_tokens={"<|endoftext|>": 100257, "<|fim_prefix|>": 100258,
                                               "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260,
                                               "<|endofprompt|>": 100276})
    with libdflash.Tokenizer(paths["cl100k"]) as ours:
        assert ours.vocab_size == cl_ref.n_vocab, (ours.vocab_size, cl_ref.n_vocab)
        compare(tally, "cl100k", ours, cl_ref, strings, docs, bad)
    compare_regex_path(tally, "cl100k", paths["cl100k"], cl_ref, strings, docs[:len(docs) // 4])
    o_ranks = load_ranks(paths["o200k"])
    o_ref = tiktoken.Encoding("o200k_base", pat_str=O200K, mergeable_ranks=o_ranks,
                              special_tokens={"<|endoftext|>": 199999, "<|endofprompt|>": 200018})
    with libdflash.Tokenizer(paths["o200k"]) as ours:
        assert ours.vocab_size == o_ref.n_vocab
        compare(tally, "o200k", ours, o_ref, strings, docs, bad)
    compare_regex_path(tally, "o200k", paths["o200k"], o_ref, strings, docs[:len(docs) // 4])
    with tempfile.TemporaryDirectory() as tmp:
        d, specials = kimi_dir(tmp, paths["o200k"], o_ranks)
        k_ref = tiktoken.Encoding("kimi", pat_str=KIMI, mergeable_ranks=o_ranks,
                                  special_tokens=specials)
        with libdflash.Tokenizer(d) as ours:
            assert ours.vocab_size == len(o_ranks) + 256
            assert ours.id_to_token(len(o_ranks) + 2) == b"<|im_end|>"
            assert ours.id_to_token(len(o_ranks) + 5) == f"<|reserved_token_{len(o_ranks) + 5}|>".encode()
            compare(tally, "kimi-k2 (o200k ranks)", ours, k_ref, strings, docs, bad)
        compare_regex_path(tally, "kimi-k2", d, k_ref, strings, docs[:len(docs) // 4])
        discriminates(k_ref, o_ranks, specials, strings)
    return tally.finish()


if __name__ == "__main__":
    sys.exit(main())
