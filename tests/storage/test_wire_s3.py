"""Pipeline stages on s3:// paths, against moto behind the fault proxy
(tests/storage/s3env.py runs this file with the environment it documents).

- fetch: input object and output prefix on S3, 500/503/lost answers on a
  fraction of requests, two kill -9 mid-run, then a resume: every id in
  exactly one uploaded chunk, every completion what the fake server generated.
- tokenize: inputs and dataset on S3 = the same command on local files, byte
  for byte.
- train: target weights, dataset and hidden states read from S3, the
  checkpoint and training state written to S3; the result equals a local run
  byte for byte, and a resume from S3 continues it exactly.
- secrets: no credential in any error message.
"""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "fetch"))
import fake_server as fs  # noqa: E402

CLI = os.environ.get("DFLASH_CLI")
BUCKET = os.environ.get("DFLASH_TEST_S3_BUCKET")
if not CLI or not BUCKET:
    pytest.skip("needs DFLASH_CLI and the s3env.py environment", allow_module_level=True)
boto3 = pytest.importorskip("boto3")
# Sanitizer builds: Python cannot load an instrumented library, so the parts
# that build inputs through the bindings are skipped there (the CLI runs).
CLI_ONLY = os.environ.get("DFLASH_WIRE_CLI_ONLY") == "1"


def s3():
    return boto3.client("s3", endpoint_url=os.environ["DFLASH_TEST_S3_DIRECT"],
                        region_name=os.environ["AWS_REGION"],
                        aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"])


def url(key):
    return f"s3://{BUCKET}/{key}"


def keys(prefix):
    out, token = [], None
    while True:
        kw = {"Bucket": BUCKET, "Prefix": prefix}
        if token:
            kw["ContinuationToken"] = token
        r = s3().list_objects_v2(**kw)
        out += [o["Key"] for o in r.get("Contents", [])]
        if not r.get("IsTruncated"):
            return sorted(out)
        token = r["NextContinuationToken"]


def get(key):
    return s3().get_object(Bucket=BUCKET, Key=key)["Body"].read()


def upload_tree(local, prefix):
    for dirpath, _, files in os.walk(local):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, local)
            s3().upload_file(path, BUCKET, f"{prefix}/{rel}")


def faults(**plan):
    req = urllib.request.Request(os.environ["DFLASH_TEST_S3_FAULTS"],
                                 data=json.dumps(plan).encode(), method="PUT")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(autouse=True)
def no_faults(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    faults()
    yield
    faults()


# ---- fetch --------------------------------------------------------------------------


class Farm:
    def __init__(self, *args):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "fetch", "fake_server.py"),
             "--servers", "2", "--stall", "3", "--lifetime", "300", *args],
            stdout=subprocess.PIPE, text=True)
        info = json.loads(self.proc.stdout.readline())
        self.urls = [f"http://127.0.0.1:{p}/v1" for p in info["ports"]]

    def close(self):
        self.proc.kill()
        self.proc.wait()


def fetch_cmd(farm, inp, out, *extra):
    servers = [a for u in farm.urls for a in ("--server", u)]
    return [CLI, "fetch", *servers, "--model", "fake", "--family", "kimi", "--backoff", "0.02",
            "--idle-timeout", "1", "--connect-timeout", "2", "--concurrency", "8", *extra,
            inp, "-o", out]


def chunk_records(prefix):
    """Every record of every chunk under the prefix, with the chunk it is in."""
    recs = []
    for k in keys(prefix):
        for line in get(k).decode().splitlines():
            recs.append((k, json.loads(line)))
    return recs


def test_fetch_kill9_resume_exactly_once(tmp_path):
    n = 400
    lines = [json.dumps({"id": f"k{i}", "messages": [{"role": "user", "content": f"s3 {i}"}]})
             for i in range(n)]
    lines.insert(50, "{broken line")
    s3().put_object(Bucket=BUCKET, Key="fetch/in.jsonl", Body="\n".join(lines) + "\n")
    farm = Farm("--token-delay", "0.005", "--chaos", "0.05")
    out = url("fetch/out")
    try:
        faults(rate=0.1, kinds=["500", "503", "lost"], seed=3)
        for stop_at in (4, 10):  # chunks uploaded before the kill
            proc = subprocess.Popen(fetch_cmd(farm, url("fetch/in.jsonl"), out,
                                              "--chunk-records", "15", "--chunk-seconds", "0.3"),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.time() + 60
            while len(keys("fetch/out/completions/")) < stop_at and proc.poll() is None:
                assert time.time() < deadline, "no chunks uploaded"
                time.sleep(0.05)
            assert proc.poll() is None, "fetch finished before the kill"
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        done_before = {r["id"] for _, r in chunk_records("fetch/out/completions/")}
        assert 0 < len(done_before) < n
        r = subprocess.run(fetch_cmd(farm, url("fetch/in.jsonl"), out, "--worker", "final"),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 4, r.stderr  # done, line 51 ("{broken") in errors
        summary = json.loads(r.stdout)
        assert summary["skipped"] >= len(done_before)
        stats = faults()
        assert sum(stats["injected"].values()) > 0, stats
    finally:
        farm.close()
    comps = [rec for _, rec in chunk_records("fetch/out/completions/")]
    errs = [rec for _, rec in chunk_records("fetch/out/errors/")]
    ids = sorted([c["id"] for c in comps] + [e["id"] for e in errs if e["id"] is not None])
    assert ids == sorted(f"k{i}" for i in range(n)), "ids missing or duplicated"
    assert [e["line"] for e in errs if e["id"] is None] == [51]
    for c in comps:
        reasoning, content, finish, _ = fs.generate(c["messages"])
        assert c["completion"]["reasoning"] == "".join(reasoning), c["id"]
        assert c["completion"]["content"] == "".join(content), c["id"]
    # Every chunk name is WORKER-NNNNNNNN.jsonl; the last run's are "final-...".
    names = [k.rsplit("/", 1)[1] for k in keys("fetch/out/") if not k.endswith("/settings.json")]
    assert all(x.endswith(".jsonl") and x.rsplit("-", 1)[1][:8].isdigit() for x in names)
    assert any(x.startswith("final-") for x in names)
    # Nothing left: a further run sends no request and uploads nothing new.
    before = keys("fetch/out/")
    r = subprocess.run(fetch_cmd(farm, url("fetch/in.jsonl"), out, "--worker", "final"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 4, r.stderr
    assert json.loads(r.stdout)["skipped"] == n + 1
    assert keys("fetch/out/") == before


# ---- tokenize -----------------------------------------------------------------------

sys.path.insert(0, os.path.join(ROOT, "tests", "chat"))


def split_safetensors(data):
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def test_tokenize_s3_to_s3_equals_local(tmp_path):
    import gen_conversations
    import hf_jinja
    tok = hf_jinja.fixtures_dir() / "tokenizers" / "qwen2"
    if not (tok / "vocab.json").exists():
        pytest.skip("qwen2 tokenizer fixture missing")
    lines = [json.dumps({"messages": m, "tools": t} if t else {"messages": m}, ensure_ascii=False)
             for m, t in gen_conversations.corpus(300, seed=7)]
    lines[10] = "{not json"
    local_in = tmp_path / "in"
    local_in.mkdir()
    for i, name in enumerate(["a.jsonl", "b.jsonl"]):
        (local_in / name).write_text("\n".join(lines[i::2]) + "\n", encoding="utf-8")
        s3().upload_file(str(local_in / name), BUCKET, f"tok/in/{name}")

    def tokenize(out, *inputs):
        r = subprocess.run([CLI, "tokenize", "--tokenizer", str(tok), "--template", "qwen3",
                            "--threads", "2", "--max-reject-ratio", "0.5", "--allow-split-control-tokens",
                            "-o", out, *inputs], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr

    tokenize(str(tmp_path / "local"), str(local_in / "a.jsonl"), str(local_in / "b.jsonl"))
    tokenize(url("tok/out"), url("tok/in/"))            # a prefix: both objects, in name order
    tokenize(str(tmp_path / "s3in"), url("tok/in/"))
    # Same inputs (names included): the S3 dataset is the local one, byte for byte.
    remote = sorted(k[len("tok/out/"):] for k in keys("tok/out/"))
    assert remote == sorted(os.listdir(tmp_path / "s3in"))
    assert "dataset.json" in remote and "rejected.jsonl" in remote and "sources.jsonl" in remote
    for name in remote:
        assert get(f"tok/out/{name}") == (tmp_path / "s3in" / name).read_bytes(), name
    # Local files vs S3 objects as inputs: samples (named by record ids) are the same bytes;
    # rejected.jsonl and sources.jsonl differ only in the file names.
    assert sorted(os.listdir(tmp_path / "local")) == remote
    rename = {url("tok/in/a.jsonl"): str(local_in / "a.jsonl"),
              url("tok/in/b.jsonl"): str(local_in / "b.jsonl")}
    for name in remote:
        a, b = (tmp_path / "local" / name).read_bytes(), get(f"tok/out/{name}")
        if name.endswith(".safetensors"):
            assert a == b, name
        elif name in ("rejected.jsonl", "sources.jsonl"):
            rb = [json.loads(x) for x in b.decode().splitlines()]
            for r in rb:
                r["file"] = rename[r["file"]]
            assert [json.loads(x) for x in a.decode().splitlines()] == rb
        else:
            assert a == b, name
    # A second run into the same S3 dataset is refused, naming it.
    r = subprocess.run([CLI, "tokenize", "--tokenizer", str(tok), "--template", "qwen3",
                        "--allow-split-control-tokens", "-o", url("tok/out"), url("tok/in/")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and url("tok/out") in r.stderr


# ---- hidden states and training ------------------------------------------------------


def stable_metrics(text):
    rows = [json.loads(x) for x in text.splitlines()]
    for r in rows:
        del r["tokens_per_s"], r["elapsed_s"]
    return rows


def test_train_reads_and_writes_s3(tmp_path, monkeypatch):
    if CLI_ONLY:
        pytest.skip("needs the Python bindings (not loadable in sanitizer builds)")
    pytest.importorskip("numpy")
    import libdflash
    sys.path.insert(0, os.path.join(ROOT, "bindings", "python", "tests"))
    import test_train_cli as ttc

    real = libdflash.HiddenWriter

    class Tee:
        """Every hidden store goes to disk and, through the library, to S3 in small shards."""

        def __init__(self, directory, **kw):
            self.a = real(directory, **kw)
            self.b = real(url(f"train/{os.path.basename(str(directory))}"), shard_bytes=20000,
                          **kw)

        def append(self, sid, h):
            self.a.append(sid, h)
            self.b.append(sid, h)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.a.close()
            self.b.close()

    monkeypatch.setattr(ttc.libdflash, "HiddenWriter", Tee)
    ttc.make_world(tmp_path, n_train=24, n_test=6)
    shards = [k for k in keys("train/train-hidden/") if k.endswith(".safetensors")]
    assert len(shards) >= 3, shards
    assert "train/train-hidden/hidden.safetensors.index.json" in keys("train/train-hidden/")
    upload_tree(tmp_path / "train", "train/data")
    upload_tree(tmp_path / "test", "train/test")
    upload_tree(tmp_path / "target", "train/target")
    args = ["--epochs", "4", "--lr", "5e-3", "--save-every", "5", "--quiet"]

    def train(target, data, hidden, out, *extra):
        cmd = [CLI, "train", "--config", str(tmp_path / "drafter.json"), "--target", target,
               "--data", data, "--hidden", hidden, "-o", out, "--threads", "2", "--batch", "4",
               "--anchors", "16", "--seed", "5", *args, *extra]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr

    local = tmp_path / "run"
    train(str(tmp_path / "target"), str(tmp_path / "train"), str(tmp_path / "train-hidden"),
          str(local))
    remote = (url("train/target"), url("train/data"), url("train/train-hidden"))
    train(*remote, url("train/run"))
    for name in ("model.safetensors", "config.json"):
        assert get(f"train/run/{name}") == (local / name).read_bytes(), name
    # The state too, but for the elapsed time in its user blob (the last tensor).
    (ha, da), (hb, db) = (split_safetensors(get("train/run/train_state/state.safetensors")),
                          split_safetensors((local / "train_state/state.safetensors").read_bytes()))
    end = ha["user"]["data_offsets"][0]
    assert da[:end] == db[:end] and end > 0
    assert stable_metrics(get("train/run/metrics.jsonl").decode()) == \
        stable_metrics((local / "metrics.jsonl").read_text())
    # Stop early, resume from what is in the bucket: the same run, bit for bit.
    train(*remote, url("train/run2"), "--max-steps", "7", "--schedule-steps", "epochs")
    assert get("train/run2/model.safetensors") != (local / "model.safetensors").read_bytes()
    train(*remote, url("train/run2"), "--resume")
    assert get("train/run2/model.safetensors") == (local / "model.safetensors").read_bytes()
    # Evaluating the S3 checkpoint on S3 data gives the local number.
    def tau(ckpt, target, data, hidden):
        out = subprocess.run([CLI, "eval", "--checkpoint", ckpt, "--target", target, "--data",
                              data, "--hidden", hidden, "--anchors", "8"],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout
    hid = tmp_path / "test-hidden"
    assert tau(url("train/run"), url("train/target/model.safetensors"), url("train/test"),
               url("train/test-hidden")) == tau(str(local), str(tmp_path / "target"),
                                                str(tmp_path / "test"), str(hid))


# ---- errors: the URL named, the secret never -------------------------------------------


def test_stage_errors_name_url_not_secret(tmp_path):
    secret = "wire-secret-do-not-print-7f3a"
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY=secret, AWS_SESSION_TOKEN="tok-" + secret,
               DFLASH_S3_TRACE="1")
    s3().put_object(Bucket=BUCKET, Key="err/in.jsonl", Body=b'{"messages": []}\n')
    s3().put_object(Bucket=BUCKET, Key="err/not.safetensors", Body=b"plain text, no header")
    farm = Farm()
    try:
        runs = {
            "fetch": fetch_cmd(farm, url("err/in.jsonl"), url("err/out")),
            "tokenize": [CLI, "tokenize", "--tokenizer", str(tmp_path), "--template", "qwen3",
                         "-o", url("err/tok"), url("err/in.jsonl")],
            "train": [CLI, "train", "--config", str(tmp_path / "none.json"), "--target",
                      url("err/target"), "--data", url("err/data"), "--hidden",
                      url("err/hidden"), "-o", url("err/run")],
        }
        for name, cmd in runs.items():
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
            assert r.returncode != 0, name
            assert secret not in r.stdout + r.stderr, name
        r = subprocess.run(fetch_cmd(farm, url("err/in.jsonl"), url("err/out")),
                           capture_output=True, text=True, env=env, timeout=60)
        assert url("err/out/completions/") in r.stderr and "AUTH" in r.stderr, r.stderr
    finally:
        farm.close()
    # With good credentials: a target that is not safetensors, a bucket that does not exist.
    if CLI_ONLY:
        return
    (tmp_path / "c.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": 17, "num_target_layers": 8, "block_size": 4,
        "dflash_config": {"mask_token_id": 16, "target_layer_ids": [3]}}))
    np = pytest.importorskip("numpy")
    import libdflash
    from libdflash.hidden import write_dataset
    write_dataset(url("err/data"), [("s0", np.arange(40, dtype=np.int32) % 16,
                                     np.ones(40, np.uint8))])
    with libdflash.HiddenWriter(url("err/hidden"), num_layers=1, hidden_size=32) as w:
        w.append("s0", np.ones((40, 32), np.float32))
    for target, data, want in ((url("err/not.safetensors"), url("err/data"),
                                url("err/not.safetensors")),
                               ("s3://no-such-bucket-wire/t", "s3://no-such-bucket-wire/d",
                                "s3://no-such-bucket-wire/")):
        r = subprocess.run([CLI, "train", "--config", str(tmp_path / "c.json"), "--target",
                            target, "--data", data, "--hidden", url("err/hidden"),
                            "-o", str(tmp_path / "o")], capture_output=True, text=True)
        assert r.returncode != 0 and want in r.stderr, r.stderr


def test_final_state_store_on_s3(tmp_path):
    """A store with the target's final state written to s3:// and read in place (ranged
    GETs) gives what the same store gives locally, bit for bit, bf16 and fp8."""
    if CLI_ONLY:
        pytest.skip("builds its inputs through the bindings")
    np = pytest.importorskip("numpy")
    import libdflash
    rng = np.random.default_rng(7)
    x = {s: rng.standard_normal((n, 2 * 16)).astype(np.float32) for s, n in (("a", 9), ("b", 4))}
    f = {s: rng.standard_normal((len(v), 16)).astype(np.float32) for s, v in x.items()}
    for dtype in ("bf16", "fp8"):
        stores = (str(tmp_path / dtype), url(f"final/{dtype}"))
        for where in stores:
            with libdflash.HiddenWriter(where, num_layers=2, hidden_size=16, dtype=dtype,
                                        final_state=True) as w:
                for s in x:
                    w.append(s, x[s], final_state=f[s])
        local, remote = (libdflash.HiddenStore(p) for p in stores)
        assert local.final_state and remote.final_state
        for s in x:
            np.testing.assert_array_equal(remote.read_final_state(s), local.read_final_state(s))
            np.testing.assert_array_equal(remote.read(s), local.read(s))
