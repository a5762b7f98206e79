"""The hidden-state spool on S3 (moto behind the fault proxy; tests/storage/s3env.py runs this
file): producer (bindings/python/tests/spool_producer.py) and `dflash train --hidden
spool:s3://...` as separate processes, with 500/503/reset answers on a fraction of requests and
SIGKILL of either side, end at the offline run's checkpoint byte for byte, every sample once
per epoch, and the bucket never holds more shard bytes than the budget plus one shard."""
import os
import random
import signal
import sys
import threading
import time
import urllib.request
import json
import shutil

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CLI = os.environ.get("DFLASH_CLI")
BUCKET = os.environ.get("DFLASH_TEST_S3_BUCKET")
if not CLI or not BUCKET:
    pytest.skip("needs DFLASH_CLI and the s3env.py environment", allow_module_level=True)
if os.environ.get("DFLASH_WIRE_CLI_ONLY") == "1":
    pytest.skip("the producer needs the Python bindings (not loadable in sanitizer builds)",
                allow_module_level=True)
boto3 = pytest.importorskip("boto3")
pytest.importorskip("numpy")
sys.path.insert(0, os.path.join(ROOT, "bindings", "python", "tests"))
import test_spool as ts  # noqa: E402
import test_train_cli as ttc  # noqa: E402


def s3():
    return boto3.client("s3", endpoint_url=os.environ["DFLASH_TEST_S3_DIRECT"],
                        region_name=os.environ["AWS_REGION"],
                        aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"])


def faults(**plan):
    req = urllib.request.Request(os.environ["DFLASH_TEST_S3_FAULTS"],
                                 data=json.dumps(plan).encode(), method="PUT")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def listing(prefix):
    client, out, token = s3(), [], None
    while True:
        kw = {"Bucket": BUCKET, "Prefix": prefix}
        if token:
            kw["ContinuationToken"] = token
        r = client.list_objects_v2(**kw)
        out += [(o["Key"], o["Size"]) for o in r.get("Contents", [])]
        if not r.get("IsTruncated"):
            return out
        token = r["NextContinuationToken"]


@pytest.fixture(autouse=True)
def no_faults(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    faults()
    yield
    faults()


def test_spool_s3_kill9_with_faults(tmp_path):
    ttc.make_world(tmp_path, n_train=24, n_test=4)
    steps, order = ts.offline(tmp_path)
    prefix = "spool-run/"
    url = f"s3://{BUCKET}/{prefix}".rstrip("/")
    shard_bytes = lambda: sum(size for key, size in listing(prefix)  # noqa: E731
                              if key.endswith(".safetensors"))
    watch = ts.Watch(None, shard_bytes)
    faults(rate=0.05, kinds=["500", "503", "reset"], seed=4, retry_after="0")
    out, trace = tmp_path / "run", tmp_path / "run.trace"
    rng = random.Random(5)
    prod = ts.producer(tmp_path, url, order, 0.01)
    trainer = ts.train(tmp_path, f"spool:{url}", out, env=ts.trace_env(trace), wait=False)
    kills = {"producer": 0, "trainer": 0}
    deadline = time.time() + 240
    while trainer.poll() is None or trainer.returncode != 0:
        assert time.time() < deadline, "spool run did not finish"
        if trainer.poll() is not None:
            assert trainer.returncode == -signal.SIGKILL, trainer.stderr.read()
            trainer = ts.train(tmp_path, f"spool:{url}", out, "--resume",
                               env=ts.trace_env(trace), wait=False)
        if prod.poll() not in (None, 0):
            assert prod.returncode == -signal.SIGKILL, prod.stderr.read()
            prod = ts.producer(tmp_path, url, order, 0.01)
        time.sleep(rng.uniform(0.1, 0.6))
        target = rng.choice(["producer", "trainer"])
        p = prod if target == "producer" else trainer
        if kills[target] < 3 and p.poll() is None and ts.lines(out / "metrics.jsonl") > 0:
            p.send_signal(signal.SIGKILL)
            p.wait()
            kills[target] += 1
    assert prod.wait(timeout=120) == 0, prod.stderr.read()
    counters = faults()
    high = watch.close()
    print("kills:", kills, "faults:", counters.get("injected"), "high water:", high)
    assert kills["trainer"] >= 1 and kills["producer"] >= 1, kills
    assert sum(counters.get("injected", {}).values()) > 0
    ts.check_same_run(tmp_path, out, steps, trace)
    assert 0 < high <= ts.BUDGET + ts.max_shard(tmp_path), high
    assert not [k for k, _ in listing(prefix) if k.endswith(".safetensors")]


def shard_data_bytes(root, epochs):
    """The bf16 hidden-state bytes of every sample of the store, x epochs."""
    import libdflash
    h = libdflash.HiddenStore(str(root / "train-hidden"))
    width = h.num_layers * h.hidden_size * 2
    return epochs * sum(h.length(i) * width for i in h.ids())


def test_spool_s3_two_ranks_with_faults(tmp_path):
    """Two training processes on one S3 spool, 500/503/resets on 5 % of requests: the offline
    two-rank run's checkpoint, byte for byte; the bucket holds at most budget + shard. Each rank
    GETs every shard's header but only its own samples' bytes: the GETs' bodies total about one
    copy of the data (two ranks reading whole shards would be two)."""
    ttc.make_world(tmp_path, n_train=22, n_test=4)
    _, order = ts.offline(tmp_path)
    ts.train_world(tmp_path, str(tmp_path / "train-hidden"), tmp_path / "offline2", 2)
    prefix = "spool-ranks/"
    url = f"s3://{BUCKET}/{prefix}".rstrip("/")
    watch = ts.Watch(None, lambda: sum(size for key, size in listing(prefix)
                                       if key.endswith(".safetensors")))
    faults(rate=0.05, kinds=["500", "503", "reset"], seed=6, retry_after="0")
    prod = ts.producer(tmp_path, url, order, 0.005, ts.WORLD_BUDGET)
    ts.train_world(tmp_path, f"spool:{url}", tmp_path / "run2", 2)
    assert prod.wait(timeout=120) == 0, prod.stderr.read()
    counters = faults(rate=0.05, kinds=["500", "503", "reset"], seed=7, retry_after="0")
    high = watch.close()
    assert sum(counters.get("injected", {}).values()) > 0
    data = shard_data_bytes(tmp_path, 3)
    print("GET bytes:", counters["get_bytes"], "data bytes:", data)
    assert 0.9 * data < counters["get_bytes"] < 1.5 * data, (counters["get_bytes"], data)
    assert (tmp_path / "run2" / "model.safetensors").read_bytes() == \
        (tmp_path / "offline2" / "model.safetensors").read_bytes()
    assert ts.stable_metrics((tmp_path / "run2" / "metrics.jsonl").read_text()) == \
        ts.stable_metrics((tmp_path / "offline2" / "metrics.jsonl").read_text())
    # The same again with each rank killed once (and both resumed): the resumed ranks seek
    # into a shard and read their share from there.
    url_k = f"s3://{BUCKET}/spool-ranks-kill"
    prod_k = ts.producer(tmp_path, url_k, order, 0.01, ts.WORLD_BUDGET)
    assert ts.world_with_kills(tmp_path, f"spool:{url_k}", tmp_path / "run2k") == 2
    assert prod_k.wait(timeout=120) == 0, prod_k.stderr.read()
    assert (tmp_path / "run2k" / "model.safetensors").read_bytes() == \
        (tmp_path / "offline2" / "model.safetensors").read_bytes()
    assert 0 < high <= ts.WORLD_BUDGET + ts.max_shard(tmp_path), high
    assert not [k for k, _ in listing(prefix) if k.endswith(".safetensors")]


def dspark_world(root):
    """make_world's training store rewritten with the target's final state (a fixed function
    of each sample's rows, bf16 as stored), and a DSpark drafter config in drafter.json."""
    import numpy as np
    import libdflash
    with libdflash.HiddenStore(root / "train-hidden") as src:
        rows = {sid: src.read(sid) for sid in src.ids()}
    shutil.rmtree(root / "train-hidden")
    with libdflash.HiddenWriter(root / "train-hidden", num_layers=1, hidden_size=ttc.H,
                                final_state=True) as w:
        for sid, x in rows.items():
            w.append(sid, x, final_state=np.ascontiguousarray(np.tanh(3 * x[:, ::-1])))
    cfg = json.loads((root / "drafter.json").read_text())
    cfg.update(architectures=["Qwen3DSparkModel"], tie_word_embeddings=False, markov_rank=4,
               enable_confidence_head=True, sample_from_anchor=True)
    (root / "drafter.json").write_text(json.dumps(cfg))


def world_errs(root, hidden, out, world):
    """ts.train_world, returning every rank's standard error."""
    errs = []
    for rank, p in enumerate(ts.start_world(root, hidden, out, world)):
        _, err = p.communicate(timeout=200)
        assert p.returncode == 0, f"rank {rank}: {err}"
        errs.append(err)
    return errs


def test_spool_s3_two_ranks_dspark_final_state(tmp_path):
    """A DSpark drafter trained by two ranks from an S3 spool that carries the target's final
    state (HiddenWriter(spool_budget=..., final_state=True)): each rank's sparse reads
    (df_spool_share: a shard's header, then its own samples' byte spans) must bring the final
    state with the rows, and the run ends at the offline two-rank run's checkpoint (from the
    store with the final state) byte for byte; neither run trains on CE alone (no warning)."""
    ttc.make_world(tmp_path, n_train=12, n_test=4)
    dspark_world(tmp_path)
    _, order = ts.offline(tmp_path)
    for err in world_errs(tmp_path, str(tmp_path / "train-hidden"), tmp_path / "offline2", 2):
        assert "0.1 CE alone" not in err, err
    url = f"s3://{BUCKET}/spool-dspark"
    prod = ts.producer(tmp_path, url, order, 0.0, ts.WORLD_BUDGET)
    for err in world_errs(tmp_path, f"spool:{url}", tmp_path / "run2", 2):
        assert "0.1 CE alone" not in err, err
    assert prod.wait(timeout=120) == 0, prod.stderr.read()
    assert (tmp_path / "run2" / "model.safetensors").read_bytes() == \
        (tmp_path / "offline2" / "model.safetensors").read_bytes()
    assert ts.stable_metrics((tmp_path / "run2" / "metrics.jsonl").read_text()) == \
        ts.stable_metrics((tmp_path / "offline2" / "metrics.jsonl").read_text())
