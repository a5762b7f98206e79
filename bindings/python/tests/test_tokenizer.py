"""libdflash.Tokenizer: the ctypes binding and the CLI over the tokenizer API."""
import os
import subprocess
import tempfile

import numpy as np
import pytest

import libdflash
from libdflash import tokenizer as lt

FIXTURES = os.environ.get("DFLASH_FIXTURES") or os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "..", "shared", "fixtures")
CL100K = os.path.join(FIXTURES, "tokenizers", "openai", "cl100k_base.tiktoken.gz")
QWEN2 = os.path.join(FIXTURES, "tokenizers", "qwen2")

TEXTS = ["Hello, world!", "", "I'm here; you'RE there.\r\n\r\n  x", "日本語のテキスト、こんにちは。",
         "emoji 👍🏽 👨‍👩‍👧 ok", "<|endoftext|> special", "    indented\n\tcode()", "1234567890"]


@pytest.fixture(scope="module")
def cl100k():
    if not os.path.exists(CL100K):
        pytest.skip(f"fixture {CL100K} is absent")
    with libdflash.Tokenizer(CL100K) as tok:
        yield tok


@pytest.fixture(scope="module")
def tiktoken_cl100k():
    tiktoken = pytest.importorskip("tiktoken")
    import base64
    import gzip
    with gzip.open(CL100K) as f:
        ranks = {base64.b64decode(t): int(r) for t, r in (l.split() for l in f.read().splitlines() if l)}
    pat = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"""
           r"""[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
    return tiktoken.Encoding("cl100k", pat_str=pat, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 100257, "<|fim_prefix|>": 100258,
                                             "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260,
                                             "<|endofprompt|>": 100276})


def test_encode_matches_tiktoken_and_round_trips(cl100k, tiktoken_cl100k):
    for text in TEXTS:
        ids = cl100k.encode(text)
        assert ids.dtype == np.int32
        assert list(ids) == tiktoken_cl100k.encode(text, allowed_special="all")
        assert list(cl100k.encode(text, special="none")) == tiktoken_cl100k.encode_ordinary(text)
        assert cl100k.decode(ids) == text and cl100k.decode_bytes(ids) == text.encode()
        assert list(cl100k.encode(text.encode())) == list(ids)


def test_invalid_utf8_and_lone_surrogates_read_like_tiktoken(cl100k, tiktoken_cl100k):
    raw = b"ok \xff\xfe caf\xc3 \xed\xa0\x80 end"
    assert list(cl100k.encode(raw)) == tiktoken_cl100k.encode(raw.decode("utf-8", "replace"))
    assert list(cl100k.encode("a\ud800b")) == tiktoken_cl100k.encode("a\ud800b")


def test_batch_equals_one_by_one(cl100k):
    batch = cl100k.encode_batch(TEXTS * 5, n_threads=2)
    assert len(batch) == len(TEXTS) * 5
    for text, ids in zip(TEXTS * 5, batch):
        assert list(ids) == list(cl100k.encode(text))
    assert cl100k.encode_batch([]) == []


def test_short_and_long_paths_and_threads_agree_with_tiktoken(cl100k, tiktoken_cl100k):
    """encode keeps the GIL and a per-thread buffer for short texts and releases it for long
    ones; encode_batch reuses the tokenizer's pool across calls and thread counts. Every
    path, from several Python threads at once, gives tiktoken's ids; the returned arrays
    are copies, not views of the reused buffer."""
    import threading
    texts = [t * k for t in TEXTS for k in (1, 7, 300)]  # up to ~10 KB: both paths
    want = [tiktoken_cl100k.encode(t, allowed_special="all") for t in texts]
    first = cl100k.encode(texts[0])
    cl100k.encode(texts[3])
    assert list(first) == want[0]
    errors = []

    def worker(seed):
        try:
            for r in range(20):
                i = (seed * 7 + r) % len(texts)
                if list(cl100k.encode(texts[i])) != want[i]:
                    errors.append(("encode", seed, i))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for n_threads in (1, 2, 1, 0, 2):
        got = cl100k.encode_batch(texts, n_threads=n_threads)
        assert [list(g) for g in got] == want
    # two batches at once: one holds the tokenizer's pool, the other makes its own
    results = [None, None]

    def batch(k):
        results[k] = [list(g) for g in cl100k.encode_batch(texts * 3, n_threads=2)]

    threads = [threading.Thread(target=batch, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [want * 3, want * 3]


def test_lookups(cl100k):
    assert cl100k.vocab_size == 100277
    assert cl100k.token_to_id("<|endoftext|>") == 100257
    assert cl100k.is_special(100257) and not cl100k.is_special(9906)
    assert cl100k.id_to_token(9906) == b"Hello"
    assert cl100k.token_to_id(b"Hello") == 9906
    assert cl100k.token_to_id(b"no such token \x00") is None
    with pytest.raises(libdflash.Error) as info:
        cl100k.id_to_token(100262)  # a hole between the specials
    assert info.value.status == "DFLASH_E_NOT_FOUND"


def test_errors_name_what_is_wrong(cl100k):
    with pytest.raises(libdflash.Error) as info:
        cl100k.decode([9906, 10**6])
    assert info.value.status == "DFLASH_E_RANGE" and "position 1" in info.value.message
    with pytest.raises(libdflash.Error) as info:
        libdflash.Tokenizer("/nonexistent/tokenizer.json")
    assert info.value.status == "DFLASH_E_IO"
    with tempfile.TemporaryDirectory() as tmp:
        bad = os.path.join(tmp, "bad.tiktoken")
        with open(bad, "w") as f:
            f.write("IQ== 0\n@@@@ 1\n")
        with pytest.raises(libdflash.Error) as info:
            libdflash.Tokenizer(bad, pattern="cl100k")
        assert info.value.status == "DFLASH_E_FORMAT" and "bad.tiktoken:2" in info.value.message
    with pytest.raises(ValueError):
        cl100k.encode("x", special="some")


def test_close_and_context_manager():
    if not os.path.exists(CL100K):
        pytest.skip("fixture absent")
    tok = libdflash.Tokenizer(CL100K)
    with tok:
        assert len(tok.encode("hi")) == 1
    with pytest.raises(ValueError):
        tok.encode("hi")
    tok.close()  # twice is fine


def qwen2_hf():
    """Hugging Face `tokenizers` built as Qwen2's tokenizer.json describes it (skips when the
    fixture or the package is absent)."""
    tokenizers = pytest.importorskip("tokenizers")
    if not os.path.isdir(QWEN2):
        pytest.skip("qwen2 fixture absent")
    from tokenizers import Regex, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    ref = tokenizers.Tokenizer(BPE.from_file(os.path.join(QWEN2, "vocab.json"),
                                             os.path.join(QWEN2, "merges.txt")))
    ref.normalizer = normalizers.NFC()
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                                   r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
                             behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    ref.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return ref


def test_qwen2_directory_matches_hf():
    ref = qwen2_hf()
    with libdflash.Tokenizer(QWEN2) as tok:
        assert tok.vocab_size == 151646
        for text in TEXTS + ["<|im_start|>user\ncafe\u0301<|im_end|>"]:
            assert list(tok.encode(text)) == ref.encode(text, add_special_tokens=False).ids


def test_arrays_hold_exactly_their_ids(cl100k):
    """Texts with more ids than half their bytes (CJK, 4-byte letters; the first buffer was
    once sized at half, so they were encoded twice) and, through NFC, more ids than bytes
    (U+1D160 becomes three 4-byte code points, 6 ids for 4 bytes: the buffer is regrown).
    Every path returns arrays that own exactly their ids."""
    ref = qwen2_hf()
    rare = "".join(chr(c) for c in range(0x1D400, 0x1D400 + 512))
    with libdflash.Tokenizer(QWEN2) as qwen2:
        han_a = "".join(chr(0x3400 + i) for i in range(2000))  # CJK extension A: 2-3 ids each
        cases = [(cl100k, han_a), (cl100k, rare * 3),
                 (qwen2, "\U0001D160" * 500), (qwen2, "\U0001D160" * 3000 + " x")]
        for tok, text in cases:
            want = ref.encode(text, add_special_tokens=False).ids if tok is qwen2 else None
            n = len(text.encode())
            paths = [tok._encode_ctypes] + ([tok._encode_fast] if lt._fast is not None else [])
            for enc in paths:
                ids = enc(text)
                assert ids.flags.owndata and ids.base is None, enc.__name__
                assert len(ids) > n // 2 and (want is None or list(ids) == want)
                assert list(ids) == list(paths[0](text))
            batches = [tok._encode_batch_ctypes] + (
                [tok._encode_batch_fast] if lt._fast is not None else [])
            for batch in batches:
                got = batch([text, "ok"], n_threads=2)
                assert list(got[0]) == list(ids) and list(got[1]) == list(tok.encode("ok"))
                assert got[0].base.size == len(ids) + len(got[1])


def test_cli_encode_decode(cl100k):
    cli = os.environ.get("DFLASH_CLI")
    if not cli:
        pytest.skip("DFLASH_CLI not set (run through meson test)")
    text = "Hello <|endoftext|> wörld\n"
    out = subprocess.run([cli, "encode", "--tokenizer", CL100K], input=text.encode(),
                         capture_output=True, check=True).stdout
    ids = [int(x) for x in out.split()]
    assert ids == list(cl100k.encode(text))
    none = subprocess.run([cli, "encode", "--tokenizer", CL100K, "--special", "none"],
                          input=text.encode(), capture_output=True, check=True).stdout
    assert [int(x) for x in none.split()] == list(cl100k.encode(text, special="none"))
    back = subprocess.run([cli, "decode", "--tokenizer", CL100K], input=out, capture_output=True,
                          check=True).stdout
    assert back == text.encode()
    bad = subprocess.run([cli, "decode", "--tokenizer", CL100K], input=b"5 99999999",
                         capture_output=True)
    assert bad.returncode == 1 and b"DFLASH_E_RANGE" in bad.stderr
    usage = subprocess.run([cli, "encode"], capture_output=True)
    assert usage.returncode == 2


def test_thread_stats_count_this_threads_pieces_and_misses(cl100k):
    """A word seen once misses the piece cache, seen again it hits: the counters say so."""
    before = lt.thread_stats()
    cl100k.encode(" zebrafinchquux")
    mid = lt.thread_stats()
    cl100k.encode(" zebrafinchquux")
    after = lt.thread_stats()
    assert mid["pieces"] > before["pieces"]
    assert mid["cache_misses"] > before["cache_misses"]
    assert after["pieces"] - mid["pieces"] == mid["pieces"] - before["pieces"]
    assert after["cache_misses"] == mid["cache_misses"]
    assert after["cache_bytes"] > 0
