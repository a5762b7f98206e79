"""Interoperability with Python's `safetensors` (the reference implementation),
for every dtype, empty tensors, shard sets and files over 4 GiB."""
import json
import os
import struct
import subprocess

import numpy as np
import pytest
from safetensors import deserialize, safe_open, serialize
from safetensors.numpy import save_file

import libdflash

# safetensors dtype name -> (serialize() spelling, bytes per element)
ALL_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "I64": ("int64", 8),
    "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8),
}
SHAPES = [(), (0,), (3,), (2, 0, 5), (4, 3), (2, 3, 2, 1)]


def _raw(rng, dtype, shape):
    n = int(np.prod(shape, dtype=np.int64)) * ALL_DTYPES[dtype][1]
    if dtype == "BOOL":
        return rng.integers(0, 2, n, dtype=np.uint8).tobytes()
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def _python_tensors(seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for dtype in ALL_DTYPES:
        for i, shape in enumerate(SHAPES):
            out[f"{dtype.lower()}.{i}"] = (dtype, shape, _raw(rng, dtype, shape))
    return out


def test_reads_what_python_writes_every_dtype(tmp_path):
    tensors = _python_tensors()
    blob = serialize({k: {"dtype": ALL_DTYPES[d][0], "shape": list(s), "data": b}
                      for k, (d, s, b) in tensors.items()}, metadata={"who": "python", "n": "90"})
    path = tmp_path / "py.safetensors"
    path.write_bytes(blob)
    with libdflash.SafeTensors(path) as st:
        assert sorted(st.keys()) == sorted(tensors) and len(st) == len(tensors)
        assert st.metadata == {"who": "python", "n": "90"}
        for name, (dtype, shape, raw) in tensors.items():
            got_dtype, got_shape, nbytes, _ = st.info(name)
            assert (got_dtype, got_shape, nbytes) == (dtype, shape, len(raw))
            view = st[name]
            assert view.shape == shape and view.tobytes() == raw
            assert not view.flags.writeable


def test_python_reads_what_dflash_writes_every_dtype(tmp_path):
    tensors = _python_tensors(1)
    arrays, dtypes = {}, {}
    for name, (dtype, shape, raw) in tensors.items():
        arrays[name] = np.frombuffer(raw, dtype=libdflash.DTYPES[dtype]).reshape(shape)
        dtypes[name] = dtype
    path = tmp_path / "df.safetensors"
    libdflash.write_safetensors(path, arrays, metadata={"format": "pt"}, dtypes=dtypes)
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert (8 + header_len) % 8 == 0, "data section must start 8-byte aligned"
    got = dict(deserialize(path.read_bytes()))
    assert sorted(got) == sorted(tensors)
    for name, (dtype, shape, raw) in tensors.items():
        assert got[name]["dtype"] == dtype
        assert tuple(got[name]["shape"]) == shape
        assert bytes(got[name]["data"]) == raw
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        for name, (dtype, shape, raw) in tensors.items():
            if dtype in ("F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL", "U16", "U32", "U64"):
                assert f.get_tensor(name).tobytes() == raw  # bytes: random bits include NaNs


def test_numpy_views_match_python_loader(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {"w": rng.standard_normal((64, 33)).astype(np.float32),
              "ids": rng.integers(0, 1 << 31, 1000).astype(np.int32),
              "mask": rng.integers(0, 2, 1000).astype(np.uint8)}
    path = tmp_path / "np.safetensors"
    save_file(arrays, str(path))
    with libdflash.SafeTensors(path) as st:
        views = {k: st[k] for k in arrays}
    for k, a in arrays.items():  # views outlive the closed handle
        assert np.array_equal(views[k], a)
        assert views[k].ctypes.data != a.ctypes.data


def _make_shards(tmp_path):
    rng = np.random.default_rng(5)
    shards = {}
    for i in range(3):
        arrays = {f"layer.{i}.{j}": rng.standard_normal((8, 4)).astype(np.float32) for j in range(4)}
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(arrays, str(tmp_path / name), metadata={"format": "pt"})
        shards[name] = arrays
    return shards


def test_shard_set_through_index_directory_and_writer(tmp_path):
    shards = _make_shards(tmp_path)
    libdflash.write_index(tmp_path / "model.safetensors.index.json", sorted(shards), {"format": "pt"})
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    total = sum(a.nbytes for arrays in shards.values() for a in arrays.values())
    assert index["metadata"] == {"format": "pt", "total_size": total}
    assert index["weight_map"] == {k: f for f, arrays in shards.items() for k in arrays}
    for path in (tmp_path / "model.safetensors.index.json", tmp_path):
        with libdflash.SafeTensors(path) as st:
            assert st.file_count == 3 and len(st) == 12
            assert st.metadata["total_size"] == str(total)
            for f, arrays in shards.items():
                for k, a in arrays.items():
                    assert np.array_equal(st[k], a)
                    assert st.info(k)[3].endswith(f)


def test_index_errors_name_the_shard(tmp_path):
    shards = _make_shards(tmp_path)
    weight_map = {k: f for f, arrays in shards.items() for k in arrays}
    weight_map["extra"] = "model-00009-of-00009.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(libdflash.Error) as e:
        libdflash.SafeTensors(tmp_path)
    assert e.value.status == "DFLASH_E_NOT_FOUND"
    assert "model-00009-of-00009.safetensors" in e.value.message
    del weight_map["extra"]
    weight_map["layer.0.0"] = "model-00002-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(libdflash.Error) as e:
        libdflash.SafeTensors(tmp_path)
    assert e.value.status == "DFLASH_E_MISMATCH" and "layer.0.0" in e.value.message


def _sparse_file(path, tensors, total_size):
    """A safetensors file whose data section is a hole, with marker bytes written."""
    header = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = int(np.prod(shape)) * ALL_DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    assert offset == total_size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + total_size)
        data_start = 8 + len(text)
        f.seek(data_start + total_size - 4)  # marker in the last 4 bytes, past 4 GiB
        f.write(b"\x01\x02\x03\x04")
    return data_start


def test_shard_set_over_4_gib(tmp_path):
    big = 5 * (1 << 30)  # 5 GiB in one tensor, sparse on disk
    _sparse_file(tmp_path / "model-00001-of-00002.safetensors", {"huge": ("U8", (big,))}, big)
    save_file({"small": np.arange(10, dtype=np.int64)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    libdflash.write_index(tmp_path / "model.safetensors.index.json",
                       ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    with libdflash.SafeTensors(tmp_path) as st:
        huge = st["huge"]
        assert huge.shape == (big,) and st.info("huge")[2] == big
        assert huge[-4:].tobytes() == b"\x01\x02\x03\x04" and huge[(1 << 32) + 7] == 0
        assert np.array_equal(st["small"], np.arange(10))
    with safe_open(str(tmp_path / "model-00001-of-00002.safetensors"), framework="numpy") as f:
        assert f.get_slice("huge")[big - 4:big].tobytes() == b"\x01\x02\x03\x04"


def test_writer_streams_over_4_gib(tmp_path):
    """A >4 GiB file written by libdflash's streaming writer loads in Python."""
    cli = os.environ.get("DFLASH_CLI")
    path = tmp_path / "big.safetensors"
    big = (1 << 32) + 4096
    chunk = np.zeros(1 << 26, dtype=np.uint8)
    import ctypes
    from libdflash import safetensors as m
    w = ctypes.c_void_p()
    m._w_create(str(path).encode(), ctypes.byref(w))
    try:
        code = ctypes.c_int()
        m._dtype_from(b"U8", ctypes.byref(code))
        m._w_declare(w, b"big", code.value, 1, (ctypes.c_int64 * 1)(big))
        left = big
        while left:
            n = min(left, chunk.nbytes)
            if left == n:
                chunk[n - 1] = 7
            m._w_write(w, chunk.ctypes.data, n)
            left -= n
        m._w_finish(w)
    finally:
        m._w_free(w)
    with safe_open(str(path), framework="numpy") as f:
        tail = f.get_slice("big")[big - 2:big]
        assert tail.tolist() == [0, 7]
    if cli:
        out = subprocess.run([cli, "inspect", str(path)], capture_output=True, text=True, check=True).stdout
        assert f"big" in out and str(big) in out


@pytest.mark.parametrize("mutate,status,needle", [
    (lambda b: b[:5], "DFLASH_E_TRUNCATED", "8-byte header"),
    (lambda b: struct.pack("<Q", 10 ** 9) + b[8:], "DFLASH_E_TRUNCATED", "header length"),
    (lambda b: b.replace(b'"F32"', b'"F33"'), "DFLASH_E_DTYPE", '"w"'),
    (lambda b: b.replace(b"[0,24]", b"[0,28]"), "DFLASH_E_FORMAT", '"w"'),
    (lambda b: b.replace(b'"w"', b'"\xff"'), "DFLASH_E_UTF8", "UTF-8"),
    (lambda b: b[:-4], "DFLASH_E_TRUNCATED", "truncated"),
    (lambda b: b'{"id": 1, "messages": []}\n' * 4, "DFLASH_E_FORMAT", "not a safetensors file"),
])
def test_malformed_files_get_specific_errors(tmp_path, mutate, status, needle):
    path = tmp_path / "bad.safetensors"
    save_file({"w": np.zeros((2, 3), np.float32)}, str(path))
    blob = path.read_bytes()
    assert b"[0,24]" in blob
    path.write_bytes(mutate(blob))
    with pytest.raises(libdflash.Error) as e:
        libdflash.SafeTensors(path)
    assert e.value.status == status, e.value.message
    assert needle in e.value.message and str(path) in e.value.message


def test_inspect_cli_lists_tensors(tmp_path):
    cli = os.environ.get("DFLASH_CLI")
    if not cli:
        pytest.skip("DFLASH_CLI not set (run through meson test)")
    shards = _make_shards(tmp_path)
    out = subprocess.run([cli, "inspect", str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "layer.2.3" in out and "F32" in out and "[8, 4]" in out and "12 tensors, 1536 bytes, 3 file(s)" in out
    bad = subprocess.run([cli, "inspect", str(tmp_path / "none")], capture_output=True, text=True)
    assert bad.returncode == 1 and "DFLASH_E_NOT_FOUND" in bad.stderr


def test_metadata_lookup_matches_python_reader(tmp_path):
    path = tmp_path / "m.safetensors"
    meta = {"format": "pt", "note": "héllo ✓", "empty": ""}
    libdflash.write_safetensors(path, {"x": np.arange(3, dtype=np.float32)}, metadata=meta)
    with safe_open(str(path), "np") as f:
        assert f.metadata() == meta  # the reference reader sees what the writer wrote
    with libdflash.SafeTensors(path) as st:
        for k, v in meta.items():
            assert st.get_metadata(k) == v
        assert st.get_metadata("missing") is None
        assert st.get_metadata("missing", "dflt") == "dflt"
    # A shard set answers from its index's "metadata".
    libdflash.write_index(tmp_path / "model.safetensors.index.json", ["m.safetensors"],
                       metadata={"origin": "test"})
    with libdflash.SafeTensors(tmp_path / "model.safetensors.index.json") as st:
        assert st.get_metadata("origin") == "test"
        assert st.get_metadata("total_size") == "12"
    with pytest.raises(ValueError):
        st.get_metadata("origin")  # closed


def test_dtype_sizes_match_numpy():
    from libdflash.safetensors import dtype_code, dtype_size
    for name, np_dtype in libdflash.DTYPES.items():
        assert dtype_size(name) == np.dtype(np_dtype).itemsize, name
        assert dtype_size(dtype_code(name)) == dtype_size(name)
    assert dtype_size(10_000) == 0  # unknown value
    with pytest.raises(libdflash.Error) as e:
        dtype_size("F128")
    assert e.value.status == "DFLASH_E_DTYPE"
