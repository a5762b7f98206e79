"""libdflash._fast, the compiled Tokenizer.encode / encode_batch, against the ctypes path and
tiktoken: the same ids, arrays, conversions and errors."""
import os
import subprocess
import sys

import numpy as np
import pytest

import libdflash
from libdflash import tokenizer as lt

from test_tokenizer import CL100K, TEXTS, cl100k, tiktoken_cl100k  # noqa: F401 - fixtures

needs_fast = pytest.mark.skipif(lt._fast is None, reason="libdflash._fast not built")
# Texts that take the branches of both paths: empty, short (the stack buffer), 2 KB of
# characters of 2-4 tokens each (more ids than half their bytes, which the first buffers once
# held), and long (without the GIL). More ids than bytes, which sends a short text from the
# stack buffer to an array while holding the GIL, takes NFC expansion: test_tokenizer.py's
# test_arrays_hold_exactly_their_ids.
RARE = "".join(chr(c) for c in range(0x1D400, 0x1D400 + 512))  # 4-byte letters, 2048 bytes
# ASCII runs of 0-36 characters, each a different slice of varied text (a run of one letter hides
# a block packed from the wrong half), between characters of each width (Latin-1, BMP, astral),
# then an ASCII tail: the extension's conversion takes ASCII 16 or 8 characters at a time and the
# rest one at a time, into the stack buffer (short) or a bytes object (over 2 KB).
ASCII = "The quick brown fox jumps over the lazy dog, 0123456789! " * 60  # no two blocks alike
BLOCKS = ["".join(ASCII[k:2 * k % 37 + k] + c for k in range(74)) + ASCII[:tail]
          for c in ("\u00e9", "\u2014", "\U0001F600") for tail in (0, 5, 3000)]
VARIED = ([t * k for t in TEXTS for k in (1, 7, 300)] + [RARE, "é" * 3000, "\u00ff" * 1024]
          + BLOCKS
          + ["a\ud800b", "\ud83d\ude00 pair", "x\udfff", "end \ud800", "\ud800" * 700 + "!" * 3000])


def test_extension_loaded_when_built():
    """The build folder names its extension (DFLASH_PYEXT) and an installed package carries
    it: it must load then, or encode silently takes the slow path."""
    import glob
    package = os.path.dirname(lt.__file__)
    if os.environ.get("DFLASH_PYEXT") or glob.glob(os.path.join(package, "_fast.*")):
        assert lt._fast is not None
        assert libdflash.Tokenizer.encode is libdflash.Tokenizer._encode_fast
        assert libdflash.Tokenizer.encode_batch is libdflash.Tokenizer._encode_batch_fast


def test_rare_text_has_more_ids_than_half_its_bytes(cl100k):
    data = RARE.encode()
    assert len(data) <= 2048 and len(cl100k.encode(RARE)) > 1024


@needs_fast
def test_both_paths_give_tiktokens_ids(cl100k, tiktoken_cl100k):
    for text in VARIED:
        want = tiktoken_cl100k.encode(text, allowed_special="all")
        plain = tiktoken_cl100k.encode_ordinary(text)
        raw = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode()
        for enc in (cl100k._encode_fast, cl100k._encode_ctypes):
            for arg in (text, raw, bytearray(raw), memoryview(raw)):
                ids = enc(arg)
                assert list(ids) == want, (enc.__name__, type(arg), text[:20])
                assert ids.dtype == np.int32 and ids.flags.c_contiguous and ids.flags.writeable
                assert ids.flags.owndata or ids.base is not None
            assert list(enc(text, special="none")) == plain
            assert list(enc(text, "all")) == want


@needs_fast
def test_invalid_utf8_reads_like_the_ctypes_path(cl100k):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests",
                                    "tokenizer"))
    try:
        import corpus
    except ImportError:
        pytest.skip("tests/tokenizer/corpus.py absent")
    for raw in corpus.invalid_bytes(200):
        assert list(cl100k._encode_fast(raw)) == list(cl100k._encode_ctypes(raw))


@needs_fast
def test_batch_paths_agree(cl100k, tiktoken_cl100k):
    want = [tiktoken_cl100k.encode(t, allowed_special="all") for t in VARIED]
    for batch in (cl100k._encode_batch_fast, cl100k._encode_batch_ctypes):
        for n_threads in (1, 2, 0):
            got = batch(VARIED, n_threads=n_threads)
            assert [list(g) for g in got] == want
            assert all(g.dtype == np.int32 for g in got)
        got = batch(iter(t.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
                         for t in VARIED[:10]), special="none", n_threads=2.0)
        assert [list(g) for g in got] == [tiktoken_cl100k.encode_ordinary(t.encode(
            "utf-8", "surrogatepass").decode("utf-8", "replace")) for t in VARIED[:10]]
        assert batch([]) == [] and batch(()) == []


@needs_fast
def test_errors_match(cl100k):
    """Wrong arguments raise the same exception with the same message on both paths; a
    failing library call raises the Error subclass of its status."""
    cases = [((1,), {}), ((None,), {}), (("x",), {"special": "some"}), (("x",), {"special": 0}),
             ((["x"],), {})]
    for args, kw in cases:
        raised = []
        for enc in (cl100k._encode_fast, cl100k._encode_ctypes):
            with pytest.raises(Exception) as info:
                enc(*args, **kw)
            raised.append((type(info.value), str(info.value)))
        assert raised[0] == raised[1], (args, kw, raised)
    for texts, kw in (([1], {}), (["x"], {"special": "some"}), (5, {})):
        with pytest.raises(Exception) as fast:
            cl100k._encode_batch_fast(texts, **kw)
        with pytest.raises(Exception) as slow:
            cl100k._encode_batch_ctypes(texts, **kw)
        assert type(fast.value) is type(slow.value)
    # a NULL tokenizer: the library's refusal, raised as the ctypes path raises it
    with pytest.raises(libdflash.InvalidArgumentError) as info:
        lt._fast.encode(0, "x", "all")
    assert info.value.status == "DFLASH_E_INVALID_ARG" and info.value.message
    with pytest.raises(libdflash.InvalidArgumentError) as info:
        lt._fast.encode_batch(0, ["x", "y"], "all", 1)
    assert info.value.status == "DFLASH_E_INVALID_ARG"


@needs_fast
def test_closed_tokenizer_raises_on_both_paths():
    if not os.path.exists(CL100K):
        pytest.skip("fixture absent")
    tok = libdflash.Tokenizer(CL100K)
    tok.close()
    for call in (tok._encode_fast, tok._encode_ctypes, tok._encode_batch_fast,
                 tok._encode_batch_ctypes):
        with pytest.raises(ValueError, match="closed"):
            call(["hi"] if "batch" in call.__name__ else "hi")


def _import_in_child(env):
    code = ("from libdflash import tokenizer as t; import libdflash; "
            "print(t._fast is None, libdflash.Tokenizer.encode.__name__)")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.split(), run.stderr


def test_without_the_extension_encode_is_the_ctypes_path_silently():
    for env in ({"DFLASH_NO_EXTENSION": "1"}, {"DFLASH_PYEXT": "/nonexistent/_fast.so"}):
        out, err = _import_in_child(env)
        if "DFLASH_PYEXT" in env and os.environ.get("DFLASH_EXPECT_PACKAGE_DIR"):
            continue  # an installed package finds its own extension first
        assert out == ["True", "_encode_ctypes"] and err == "", (env, out, err)
