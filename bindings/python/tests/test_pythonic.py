"""Python that feels like Python: failures raise libdflash.Error subclasses
that are also the built-in kinds (FileNotFoundError, KeyError, IndexError, ValueError, ...)
with .status and .message; Dataset has a repr, slices and lookup by id; len(tokenizer);
Tokenizer.decode gives str (decode_bytes the bytes); ChatTemplate.render takes Hugging
Face's enable_thinking= for the Qwen templates."""
import builtins
import ctypes
import errno
import os
import pathlib
import pickle
import re

import numpy as np
import pytest

import libdflash
from libdflash import _lib
from libdflash.hidden import write_dataset

ROOT = pathlib.Path(__file__).resolve().parents[3]
FIXTURES = os.environ.get("DFLASH_FIXTURES") or os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "..", "shared", "fixtures")
CL100K = os.path.join(FIXTURES, "tokenizers", "openai", "cl100k_base.tiktoken.gz")

# dflash_status -> (class name, the built-in kinds it must also be).
TABLE = {
    "DFLASH_E_INVALID_ARG": ("InvalidArgumentError", (ValueError,)),
    "DFLASH_E_NOMEM": ("OutOfMemoryError", (MemoryError,)),
    "DFLASH_E_IO": ("InputOutputError", (OSError,)),
    "DFLASH_E_FORMAT": ("FormatError", (ValueError,)),
    "DFLASH_E_TRUNCATED": ("TruncatedError", (ValueError,)),
    "DFLASH_E_RANGE": ("RangeError", (ValueError,)),
    "DFLASH_E_OVERFLOW": ("SizeOverflowError", (OverflowError,)),
    "DFLASH_E_DTYPE": ("DtypeError", (ValueError, TypeError)),
    "DFLASH_E_UTF8": ("Utf8Error", (UnicodeError, ValueError)),
    "DFLASH_E_DUPLICATE": ("DuplicateError", (ValueError,)),
    "DFLASH_E_NOT_FOUND": ("NotFoundError", (LookupError,)),
    "DFLASH_E_JSON": ("JSONError", (ValueError,)),
    "DFLASH_E_BUFFER": ("BufferTooSmallError", (ValueError,)),
    "DFLASH_E_UNSUPPORTED": ("UnsupportedError", (NotImplementedError,)),
    "DFLASH_E_STATE": ("StateError", (RuntimeError,)),
    "DFLASH_E_CONFIG": ("ConfigError", (ValueError,)),
    "DFLASH_E_MISMATCH": ("MismatchError", (ValueError,)),
    "DFLASH_E_REGEX": ("RegexError", (ValueError,)),
    "DFLASH_E_TEMPLATE": ("TemplateError", (ValueError,)),
    "DFLASH_E_HTTP": ("HTTPError", (OSError,)),
    "DFLASH_E_NETWORK": ("NetworkError", (ConnectionError,)),
    "DFLASH_E_TIMEOUT": ("DeadlineError", (TimeoutError,)),
    "DFLASH_E_CANCELLED": ("CancelledError", ()),
    "DFLASH_E_CUDA": ("CudaError", (RuntimeError,)),
    "DFLASH_E_NO_DEVICE": ("NoDeviceError", (RuntimeError,)),
    "DFLASH_E_INTERNAL": ("InternalError", (RuntimeError,)),
    "DFLASH_E_AUTH": ("AuthError", (PermissionError,)),
    "DFLASH_E_EXISTS": ("ExistsError", (FileExistsError,)),
}


def header_statuses():
    header = pathlib.Path(os.environ.get("DFLASH_INCLUDE_DIR", ROOT / "include")) / "dflash" \
        / "dflash.h"
    if not header.exists():
        pytest.skip(f"no {header}")
    return re.findall(r"\b(DFLASH_E_\w+)\s*=\s*\d+", header.read_text())


# ---- the exception classes --------------------------------------------------------------

def test_every_status_has_a_class_that_is_also_a_builtin_kind():
    statuses = header_statuses()
    assert statuses and set(statuses) == set(TABLE), "TABLE must list dflash.h's statuses"
    for status in statuses:
        name, kinds = TABLE[status]
        cls = getattr(libdflash, name)
        assert issubclass(cls, libdflash.Error), cls
        assert all(issubclass(cls, k) for k in kinds), (status, cls.__mro__)
        code = _lib.status_code(status)
        e = _lib.error(code, "detail")
        assert type(e) is cls and e.status == status and e.code == code
        assert e.message == "detail" and str(e) == f"{status}: detail"
        assert name in libdflash.__doc__ and status in libdflash.__doc__  # the table is documented
    # the per-call refinements
    for cls, kinds in ((libdflash.MissingFileError, (libdflash.NotFoundError, FileNotFoundError)),
                       (libdflash.MissingKeyError, (libdflash.NotFoundError, KeyError)),
                       (libdflash.IndexRangeError, (libdflash.RangeError, IndexError))):
        assert all(issubclass(cls, k) for k in kinds), cls
    assert _lib.error(999, "from a newer library").__class__ is libdflash.Error


def test_errors_pickle_as_the_same_class_status_and_message():
    for e in (_lib.error(_lib.status_code("DFLASH_E_NOT_FOUND"), "x.safetensors", _lib.files(0),
                         ("/nonexistent",)),
              _lib.error(_lib.status_code("DFLASH_E_JSON"), "line 3"), libdflash.Error(4, "bad")):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and (back.status, back.code, back.message) == \
            (e.status, e.code, e.message) and str(back) == str(e)


def test_missing_files_are_file_not_found(tmp_path):
    missing = str(tmp_path / "nope")
    calls = [lambda: libdflash.SafeTensors(missing + ".safetensors"),
             lambda: libdflash.Tokenizer(missing + "/tokenizer.json"),  # the loader says DFLASH_E_IO
             lambda: libdflash.Dataset(missing),
             lambda: libdflash.HiddenStore(missing),
             lambda: libdflash.SampleStream(missing, missing),
             lambda: libdflash.train.load_config(missing + ".json"),
             lambda: libdflash.train.load_target_head(missing, 4, 4),
             lambda: libdflash.dataset.tokenizer_hash(missing),
             lambda: libdflash.Storage().read(missing),
             lambda: libdflash.Storage().stat(missing)]
    for call in calls:
        with pytest.raises(FileNotFoundError) as info:
            call()
        e = info.value
        assert isinstance(e, libdflash.Error) and isinstance(e, libdflash.NotFoundError)
        assert e.status in ("DFLASH_E_NOT_FOUND", "DFLASH_E_IO") and missing in e.message
        assert e.errno == errno.ENOENT and str(e) == f"{e.status}: {e.message}"


def test_a_name_missing_from_an_existing_file_is_not_file_not_found(tmp_path):
    path = str(tmp_path / "t.safetensors")
    libdflash.write_safetensors(path, {"x": np.zeros((2, 2), np.float32)})
    with pytest.raises(libdflash.NotFoundError) as info:
        libdflash.train.load_target_head(path, 4, 4)  # no embedding tensor in it
    assert not isinstance(info.value, (FileNotFoundError, KeyError))


def test_missing_names_and_ids_are_key_errors(tmp_path):
    path = str(tmp_path / "t.safetensors")
    libdflash.write_safetensors(path, {"x": np.zeros(3, np.float32)}, metadata={"k": "v"})
    with pytest.raises(KeyError) as info, libdflash.SafeTensors(path) as st:
        st["y"]
    assert info.value.status == "DFLASH_E_NOT_FOUND" and '"y"' in info.value.message
    assert str(info.value) == f"DFLASH_E_NOT_FOUND: {info.value.message}"  # not KeyError's quotes
    with pytest.raises(KeyError):
        libdflash.ChatTemplate("no-such-template")
    with libdflash.HiddenWriter(tmp_path / "h", num_layers=1, hidden_size=4) as w:
        w.append("a", np.zeros((2, 4), np.float32))
    with libdflash.HiddenStore(tmp_path / "h") as hs:
        assert hs.length("a") == 2
        with pytest.raises(KeyError) as info:
            hs.read("b")
        assert isinstance(info.value, libdflash.MissingKeyError) and "b" in info.value.message


def test_ranges_and_bad_input(tmp_path):
    with pytest.raises(ValueError) as info:  # DFLASH_E_INVALID_ARG
        _lib.bind("dflash_cuda_device_count", [ctypes.c_void_p])(None)
    assert isinstance(info.value, libdflash.InvalidArgumentError)
    with pytest.raises(ValueError) as info:
        libdflash.Conversation('{"messages": [')
    assert isinstance(info.value, libdflash.Error) and info.value.status in ("DFLASH_E_JSON",
                                                                          "DFLASH_E_FORMAT")
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b'{"id": "a", "messages": []}\n')
    with pytest.raises(ValueError) as info:
        libdflash.SafeTensors(str(bad))
    assert isinstance(info.value, (libdflash.FormatError, libdflash.TruncatedError))
    with libdflash.SafeTensors(_small(tmp_path)) as st:
        from libdflash.safetensors import _get, _Tensor
        t = _Tensor(struct_size=ctypes.sizeof(_Tensor))
        with pytest.raises(IndexError) as info:
            _get(st._handle(), 5, ctypes.byref(t))
        assert info.value.status == "DFLASH_E_RANGE"


def _small(tmp_path):
    path = str(tmp_path / "small.safetensors")
    libdflash.write_safetensors(path, {"x": np.zeros(3, np.float32)})
    return path


def test_except_dflash_error_still_catches_every_kind(tmp_path):
    for call in (lambda: libdflash.SafeTensors(str(tmp_path / "nope")),
                 lambda: libdflash.ChatTemplate("nope"),
                 lambda: libdflash.Conversation("[")):
        with pytest.raises(libdflash.Error) as info:
            call()
        assert info.value.status.startswith("DFLASH_E_") and info.value.message


# ---- Dataset ------------------------------------------------------------------------------

@pytest.fixture
def dataset(tmp_path):
    samples = [(f"s{i}", np.arange(i + 1, dtype=np.int32) + 10 * i,
                (np.arange(i + 1) % 2).astype(np.uint8)) for i in range(6)]
    write_dataset(tmp_path / "d", samples)
    with libdflash.Dataset(tmp_path / "d") as ds:
        yield ds, samples, str(tmp_path / "d")


def test_dataset_repr(dataset):
    ds, samples, path = dataset
    text = repr(ds)
    assert text == f"<libdflash.Dataset {path!r}: 6 samples, 21 tokens>"
    ds.close()
    assert repr(ds) == f"<libdflash.Dataset {path!r} (closed)>"


def test_dataset_slices_are_lists_of_samples(dataset):
    ds, samples, _ = dataset
    for key in (slice(2, 5), slice(None), slice(None, None, -2), slice(-3, None), slice(4, 1),
                slice(0, 100)):
        got = ds[key]
        want = samples[key]
        assert isinstance(got, list) and [g[0] for g in got] == [w[0] for w in want], key
        for (_, ids, mask), (_, wids, wmask) in zip(got, want):
            np.testing.assert_array_equal(ids, wids)
            np.testing.assert_array_equal(mask, wmask)


def test_dataset_indices(dataset):
    ds, samples, _ = dataset
    assert ds[-1][0] == "s5" and ds[np.int64(2)][0] == "s2" and ds[-6][0] == "s0"
    for i in (6, -7, 10**6):
        with pytest.raises(IndexError) as info:
            ds[i]
        assert isinstance(info.value, libdflash.Error) and info.value.status == "DFLASH_E_RANGE"
    with pytest.raises(TypeError):
        ds[1.5]
    assert [s[0] for s in ds] == [s[0] for s in samples]


def test_dataset_lookup_by_id(dataset):
    ds, samples, _ = dataset
    sid, ids, mask = ds["s3"]
    assert sid == "s3"
    np.testing.assert_array_equal(ids, samples[3][1])
    np.testing.assert_array_equal(mask, samples[3][2])
    assert ds.by_id("s4")[0] == "s4" and ds.index_of("s1") == 1
    assert "s0" in ds and "s9" not in ds and 3 not in ds
    for lookup in (lambda: ds["s9"], lambda: ds.by_id("s9"), lambda: ds.index_of("s9")):
        with pytest.raises(KeyError) as info:
            lookup()
        assert isinstance(info.value, libdflash.MissingKeyError) and "'s9'" in info.value.message


# ---- Tokenizer ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cl100k():
    if not os.path.exists(CL100K):
        pytest.skip(f"fixture {CL100K} is absent")
    with libdflash.Tokenizer(CL100K) as tok:
        yield tok


def test_len_of_a_tokenizer_is_its_vocab_size(cl100k):
    assert len(cl100k) == cl100k.vocab_size == 100277


def test_decode_gives_str_and_decode_bytes_the_bytes(cl100k):
    text = "Hello, 日本語 👍🏽 <|endoftext|>"
    ids = cl100k.encode(text)
    assert cl100k.decode(ids) == text and isinstance(cl100k.decode(ids), str)
    assert cl100k.decode_bytes(ids) == text.encode()
    assert cl100k.decode([]) == "" and cl100k.decode_bytes([]) == b""
    first = cl100k.token_to_id(b"\xe6")  # the first byte of a 3-byte character
    assert cl100k.decode_bytes([first]) == b"\xe6"
    assert cl100k.decode([first]) == "\ufffd"  # as tiktoken's and HF's decode
    with pytest.raises(UnicodeDecodeError):
        cl100k.decode([first], errors="strict")
    with pytest.raises(IndexError) as info:
        cl100k.decode([9906, 10**6])
    assert info.value.status == "DFLASH_E_RANGE" and "position 1" in info.value.message


def test_tokenizer_lookups_raise_builtin_kinds(cl100k):
    with pytest.raises(KeyError) as info:
        cl100k.id_to_token(100262)  # a hole between the specials
    assert info.value.status == "DFLASH_E_NOT_FOUND"
    with pytest.raises(IndexError):
        cl100k.id_to_token(10**6)


# ---- ChatTemplate -------------------------------------------------------------------------

CONV = [{"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "reasoning_content": "Add them.", "content": "4"},
        {"role": "user", "content": "And 3+3?"}]


@pytest.mark.parametrize("name", ["qwen3", "qwen3.5", "qwen3.6"])
def test_render_takes_enable_thinking_for_qwen(name):
    t = libdflash.ChatTemplate(name)
    on = t.render(CONV, add_generation_prompt=True)
    off = t.render(CONV, add_generation_prompt=True, thinking=False)
    assert on != off
    assert t.render(CONV, add_generation_prompt=True, enable_thinking=False) == off
    assert t.render(CONV, add_generation_prompt=True, enable_thinking=True) == on
    assert t.render(CONV, add_generation_prompt=True, thinking=False,
                    enable_thinking=False) == off
    assert t.render_full(CONV, add_generation_prompt=True, enable_thinking=False).text == off
    with pytest.raises(ValueError, match="disagree"):
        t.render(CONV, add_generation_prompt=True, thinking=True, enable_thinking=False)


def test_render_enable_thinking_matches_hf():
    pytest.importorskip("jinja2")
    if not (ROOT / "tests" / "chat" / "hf_jinja.py").exists():
        pytest.skip("not run from a source tree")
    import sys
    sys.path.insert(0, str(ROOT / "tests" / "chat"))
    import hf_jinja
    ref = hf_jinja.Reference()
    if "qwen3" not in ref.compiled:
        pytest.skip("template fixtures missing")
    for flag in (False, True):
        want = ref.render("qwen3", CONV, add_generation_prompt=True, enable_thinking=flag)
        got = libdflash.ChatTemplate("qwen3").render(CONV, add_generation_prompt=True,
                                                  enable_thinking=flag)
        assert got == want


def test_enable_thinking_is_refused_outside_the_qwen_family():
    with pytest.raises(TypeError, match="thinking="):
        libdflash.ChatTemplate("kimi-k2.6").render(CONV, enable_thinking=False)


def test_builtins_are_not_shadowed():
    # the class names chosen never hide a built-in of the same name in `from libdflash import *`
    assert not [n for n in libdflash.__all__ if hasattr(builtins, n)]
