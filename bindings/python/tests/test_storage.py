"""Storage bindings against a real S3-compatible server (moto with signature
checks, behind the fault-injecting proxy of tests/storage/s3env.py), checked
against boto3 and Python's `safetensors` as references; and the `dflash cp`
and `dflash ls` commands."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import libdflash
from libdflash.storage import Storage

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "tests" / "storage"))
import s3env  # noqa: E402


@pytest.fixture(scope="module")
def s3():
    if not s3env.moto_available():
        pytest.skip("moto[server] not installed (pip install -r scripts/requirements.txt)")
    env = s3env.S3Env()
    yield env
    env.close()


def client(s3, **kw):
    e = s3.env
    opts = dict(endpoint_url=e["AWS_ENDPOINT_URL"], access_key_id=e["AWS_ACCESS_KEY_ID"],
                secret_access_key=e["AWS_SECRET_ACCESS_KEY"], region="us-east-1",
                backoff_base_s=0.005, backoff_max_s=0.05)
    opts.update(kw)
    return Storage(**opts)


def boto(s3):
    import boto3
    e = s3.env
    return boto3.client("s3", endpoint_url=e["DFLASH_TEST_S3_DIRECT"], region_name="us-east-1",
                        aws_access_key_id=e["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=e["AWS_SECRET_ACCESS_KEY"])


def test_objects_agree_with_boto3_both_ways(s3):
    st = client(s3)
    b = boto(s3)
    rng = np.random.default_rng(0)
    small = rng.bytes(5000)
    big = rng.bytes(11 * 2**20 + 7)  # multipart with 5 MiB parts: 3 parts
    st2 = client(s3, part_size=5 * 2**20, multipart_threshold=5 * 2**20)
    st.write(f"s3://{s3.bucket}/py/small.bin", small)
    st2.write(f"s3://{s3.bucket}/py/big ü+.bin", big)
    assert b.get_object(Bucket=s3.bucket, Key="py/small.bin")["Body"].read() == small
    got = b.get_object(Bucket=s3.bucket, Key="py/big ü+.bin")
    assert got["Body"].read() == big
    assert got["ETag"].endswith('-3"')  # S3's multipart ETag: 3 parts
    # boto3 writes (its own multipart), libdflash reads
    from boto3.s3.transfer import TransferConfig
    import io
    b.upload_fileobj(io.BytesIO(big), s3.bucket, "py/from-boto.bin",
                     Config=TransferConfig(multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20))
    assert st.read(f"s3://{s3.bucket}/py/from-boto.bin") == big
    assert st.read_range(f"s3://{s3.bucket}/py/from-boto.bin", 2**20, 100) == big[2**20:2**20 + 100]
    assert st.stat(f"s3://{s3.bucket}/py/from-boto.bin")[0] == len(big)
    listed = dict(st.list(f"s3://{s3.bucket}/py/"))
    keys = {f"s3://{s3.bucket}/{o['Key']}": o["Size"]
            for o in b.list_objects_v2(Bucket=s3.bucket, Prefix="py/")["Contents"]}
    assert listed == keys
    st.delete(f"s3://{s3.bucket}/py/small.bin")
    assert not st.exists(f"s3://{s3.bucket}/py/small.bin")


def test_chunk_writer_under_faults_has_every_record_once(s3):
    st = client(s3)
    prefix = f"s3://{s3.bucket}/pychunks/"
    s3.proxy.set_faults(rate=0.3, seed=3, kinds=["500", "503", "reset", "lost"])
    with st.chunk_writer(prefix, "worker-0", max_records=9) as w:
        for i in range(100):
            w.append({"id": f"p{i}", "text": "é" * (i % 5)})
    stats = s3.proxy.set_faults()
    assert sum(stats["injected"].values()) >= 3  # of 13 requests
    b = boto(s3)
    objs = b.list_objects_v2(Bucket=s3.bucket, Prefix="pychunks/")["Contents"]
    assert [o["Key"] for o in objs] == [f"pychunks/worker-0-{i:08d}.jsonl" for i in range(12)]
    import json
    ids = []
    for o in objs:
        body = b.get_object(Bucket=s3.bucket, Key=o["Key"])["Body"].read().decode()
        ids += [json.loads(line)["id"] for line in body.splitlines()]
    assert ids == [f"p{i}" for i in range(100)]
    w = st.chunk_writer(prefix, "worker-0")
    assert w.next_seq == 12 and w.last_chunk.endswith("worker-0-00000011.jsonl")
    w.close()


def test_safetensors_on_demand_matches_python_safetensors(s3, tmp_path):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(1)
    tensors = {f"layer.{i}.w": rng.standard_normal((17, 33)).astype(np.float32) for i in range(12)}
    tensors["ids"] = rng.integers(0, 1000, 77, dtype=np.int64)
    tensors["empty"] = np.zeros((0, 4), np.float16)
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "np"})
    st = client(s3)
    loc = f"s3://{s3.bucket}/pyst/m.safetensors"
    boto(s3).upload_file(str(path), s3.bucket, "pyst/m.safetensors")
    with st.open_safetensors(loc, readahead=4096) as f:
        assert sorted(f.keys()) == sorted(tensors)
        assert f.metadata("format") == "np"
        for name, want in tensors.items():
            got = f[name]
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes()
    st.write(f"s3://{s3.bucket}/pyst/notes.txt", b"not a safetensors file at all")
    with pytest.raises(libdflash.Error) as e:
        st.open_safetensors(f"s3://{s3.bucket}/pyst/notes.txt")
    assert e.value.status in ("DFLASH_E_FORMAT", "DFLASH_E_TRUNCATED")
    assert f"s3://{s3.bucket}/pyst/notes.txt" in e.value.message


def test_errors_are_clear_and_hide_the_secret(s3):
    secret = s3.env["AWS_SECRET_ACCESS_KEY"]
    st = client(s3, secret_access_key=secret + "x")
    with pytest.raises(libdflash.Error) as e:
        st.read(f"s3://{s3.bucket}/anything")
    assert e.value.status == "DFLASH_E_AUTH" and "SignatureDoesNotMatch" in e.value.message
    assert secret not in e.value.message
    with pytest.raises(libdflash.Error) as e:
        client(s3).read("s3://no-such-bucket-x/k")
    assert e.value.status == "DFLASH_E_NOT_FOUND" and "NoSuchBucket" in e.value.message
    with pytest.raises(libdflash.Error) as e:
        client(s3).read(f"s3://{s3.bucket}/missing/key")
    assert e.value.status == "DFLASH_E_NOT_FOUND" and f"s3://{s3.bucket}/missing/key" in e.value.message


def test_local_paths_take_the_same_calls(tmp_path):
    st = Storage()
    loc = str(tmp_path / "a" / "b.bin")
    st.write(loc, b"abc")
    assert st.read(loc) == b"abc"
    assert st.list(str(tmp_path) + "/") == [(loc, 3)]
    with st.open_writer(str(tmp_path / "w.bin")) as w:
        w.write(b"x" * 10)
    assert st.stat(str(tmp_path / "w.bin"))[0] == 10
    assert not libdflash.is_remote(loc) and libdflash.is_remote("s3://b/k")


def cli(s3, *args, **env):
    full = dict(os.environ)
    full.update(s3.env)
    full.update(env)
    return subprocess.run([os.environ.get("DFLASH_CLI", "dflash"), *args], env=full,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not os.environ.get("DFLASH_CLI"), reason="DFLASH_CLI not set")
def test_cli_cp_and_ls(s3, tmp_path):
    src = tmp_path / "data.bin"
    src.write_bytes(os.urandom(70000))
    dst = f"s3://{s3.bucket}/cli/"
    r = cli(s3, "cp", str(src), dst)
    assert r.returncode == 0, r.stderr
    r = cli(s3, "ls", dst)
    assert r.returncode == 0 and r.stdout.split() == ["70000", f"{dst}data.bin"]
    back = tmp_path / "back.bin"
    r = cli(s3, "cp", f"{dst}data.bin", str(back))
    assert r.returncode == 0 and back.read_bytes() == src.read_bytes()
    r = cli(s3, "cp", "-r", dst, str(tmp_path / "tree") + "/")
    assert r.returncode == 0 and (tmp_path / "tree" / "data.bin").read_bytes() == src.read_bytes()
    r = cli(s3, "cp", f"{dst}nope", str(back), DFLASH_S3_TRACE="1")
    assert r.returncode == 1 and "DFLASH_E_NOT_FOUND" in r.stderr and f"{dst}nope" in r.stderr
    assert "x-amz-date" in r.stderr  # the trace went to stderr...
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in r.stderr + r.stdout  # ...without the secret
    r = cli(s3, "ls", "s3://no-such-bucket-y/", AWS_SECRET_ACCESS_KEY="")
    assert r.returncode == 1 and "DFLASH_E_AUTH" in r.stderr and "AWS_SECRET_ACCESS_KEY" in r.stderr
