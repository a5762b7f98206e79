"""The hidden-state spool with producer and trainer as separate processes
(include/dflash/hidden.h, `dflash train --hidden spool:PATH`): the run equals an
offline run fed the same samples in the same order, byte for byte, also when
either side is killed with SIGKILL and restarted; the spool never holds more
than its budget plus one shard. The S3 variant is tests/storage/test_spool_s3.py."""
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import libdflash

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_train_cli as ttc  # noqa: E402

CLI = os.environ.get("DFLASH_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="DFLASH_CLI not set (run through meson test)")
PRODUCER = os.path.join(HERE, "spool_producer.py")
ARGS = ["--threads", "1", "--batch", "4", "--anchors", "16", "--seed", "5", "--epochs", "3",
        "--lr", "5e-3", "--quiet", "--spool-wait", "60"]
SHARD, BUDGET = 6000, 15000  # ~2 samples a shard (40 x 32 bf16 = 2.5 KB each)
# Several ranks give room back only between steps: the budget must hold a global batch's shards
# (4 samples: up to 3 shards) plus one (docs/formats.md); BUDGET is about two shards.
WORLD_BUDGET = 2 * BUDGET


def train(root, hidden, out, *extra, env=None, wait=True):
    cmd = [CLI, "train", "--config", str(root / "drafter.json"), "--target", str(root / "target"),
           "--data", str(root / "train"), "--hidden", hidden, "-o", str(out), *ARGS, *extra]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    if not wait:
        return p
    _, err = p.communicate(timeout=150)
    assert p.returncode == 0, err
    return p


def stable_metrics(text):
    rows = [json.loads(x) for x in text.splitlines()]
    for r in rows:
        del r["tokens_per_s"], r["elapsed_s"]
        r.pop("spool_wait_s", None)  # a spool run's own wait counter (a timing too)
    return rows


def trace_env(path):
    return {**os.environ, "DFLASH_TRAIN_TRACE": str(path), "OMP_NUM_THREADS": "1"}


def read_trace(path):
    """{(epoch, step): [ids]}; a step retrained after a resume replaces the killed run's."""
    steps, last = {}, None
    for line in open(path):
        if line.startswith("#"):  # a (re)started run
            last = None
            continue
        e, step, sid = line.split()
        key = (int(e), int(step))
        if key != last:
            steps[key] = []  # a new run of this step (first, or again after a kill)
            last = key
        steps[key].append(sid)
    return steps


def offline(root):
    trace = root / "offline.trace"
    train(root, str(root / "train-hidden"), root / "offline", env=trace_env(trace))
    steps = read_trace(trace)
    order = root / "order.txt"
    order.write_text("".join(f"{e} {sid}\n" for (e, _), ids in sorted(steps.items())
                             for sid in ids))
    return steps, order


def producer(root, spool, order, delay, budget=BUDGET):
    return subprocess.Popen([sys.executable, PRODUCER, spool, str(root / "train-hidden"),
                             str(order), str(SHARD), str(budget), str(delay), "3",
                             str(root / "producer.log")], stderr=subprocess.PIPE, text=True)


class Watch:
    """The most shard bytes ever seen in a local spool (temporaries included)."""

    def __init__(self, folder, sizes=None):
        self.folder, self.high, self.stop = folder, 0, False
        self.sizes = sizes or self.local_sizes
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def local_sizes(self):
        total = 0
        for name in os.listdir(self.folder) if os.path.isdir(self.folder or "") else []:
            if ".safetensors" in name:
                try:
                    total += os.path.getsize(os.path.join(self.folder, name))
                except OSError:
                    pass
        return total

    def run(self):
        while not self.stop:
            self.high = max(self.high, self.sizes())
            time.sleep(0.003)

    def close(self):
        self.stop = True
        self.t.join()
        return self.high


def check_same_run(root, out, steps, trace):
    assert (out / "model.safetensors").read_bytes() == \
        (root / "offline" / "model.safetensors").read_bytes()
    assert stable_metrics((out / "metrics.jsonl").read_text()) == \
        stable_metrics((root / "offline" / "metrics.jsonl").read_text())
    # Exactly once per epoch: the same samples in the same steps as offline.
    assert read_trace(trace) == steps


def max_shard(root):
    """Largest shard the producer can publish: shard_bytes plus one sample plus the header."""
    return SHARD + 40 * 32 * 2 + 4096


def test_spool_run_equals_offline_run(tmp_path):
    ttc.make_world(tmp_path, n_train=24, n_test=4)
    steps, order = offline(tmp_path)
    spool = tmp_path / "spool"
    watch = Watch(str(spool))
    prod = producer(tmp_path, str(spool), order, 0.002)
    train(tmp_path, f"spool:{spool}", tmp_path / "run", env=trace_env(tmp_path / "run.trace"))
    assert prod.wait(timeout=120) == 0, prod.stderr.read()
    high = watch.close()
    check_same_run(tmp_path, tmp_path / "run", steps, tmp_path / "run.trace")
    assert 0 < high <= BUDGET + max_shard(tmp_path), high
    # Consumed shards are gone; the producer's records and markers stay.
    left = sorted(os.listdir(spool))
    assert not [n for n in left if n.endswith(".safetensors")], left
    assert {"e00000.end", "e00001.end", "e00002.end", "spool.json", "consumed"} <= set(left)
    status = [json.loads(x) for x in open(tmp_path / "producer.log")]
    assert max(s["high_water"] for s in status) <= BUDGET + max_shard(tmp_path)


def start_world(root, hidden, out, world, *extra):
    """`dflash train` as ranks 0..world-1 on loopback (torchrun's variables), started."""
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    args = [a if ARGS[i - 1] != "--batch" else "2" for i, a in enumerate(ARGS)]  # global 2 x world
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        cmd = [CLI, "train", "--config", str(root / "drafter.json"), "--target",
               str(root / "target"), "--data", str(root / "train"), "--hidden", hidden, "-o",
               str(out), *args, *extra]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def train_world(root, hidden, out, world, *extra):
    """start_world, to the end; every rank must succeed."""
    for rank, p in enumerate(start_world(root, hidden, out, world, *extra)):
        _, err = p.communicate(timeout=200)
        assert p.returncode == 0, f"rank {rank}: {err}"


def test_spool_two_ranks_equal_offline_two_ranks(tmp_path):
    """Two training processes on one spool: every rank reads the producer's order, keeps its
    share of each global batch and passes over the rest; rank 0 alone releases shards. The run
    equals the offline two-rank run, byte for byte, also in the short last batch of each epoch
    (22 samples, global batch 4: its share is known only at the end marker, and re-read)."""
    ttc.make_world(tmp_path, n_train=22, n_test=4)
    _, order = offline(tmp_path)  # the epoch order does not depend on the world size
    train_world(tmp_path, str(tmp_path / "train-hidden"), tmp_path / "offline2", 2)
    spool = tmp_path / "spool"
    watch = Watch(str(spool))
    prod = producer(tmp_path, str(spool), order, 0.002, WORLD_BUDGET)
    train_world(tmp_path, f"spool:{spool}", tmp_path / "run2", 2)
    assert prod.wait(timeout=120) == 0, prod.stderr.read()
    high = watch.close()
    assert (tmp_path / "run2" / "model.safetensors").read_bytes() == \
        (tmp_path / "offline2" / "model.safetensors").read_bytes()
    assert stable_metrics((tmp_path / "run2" / "metrics.jsonl").read_text()) == \
        stable_metrics((tmp_path / "offline2" / "metrics.jsonl").read_text())
    assert 0 < high <= WORLD_BUDGET + max_shard(tmp_path), high
    assert not [n for n in os.listdir(spool) if n.endswith(".safetensors")]


def world_with_kills(root, hidden, out, kills_wanted=2):
    """Two ranks to the end; SIGKILL rank 1, then rank 0, mid-run (the other rank then stops),
    restarting both with --resume after each. The number of kills made."""
    procs, kills, killed = start_world(root, hidden, out, 2), 0, False
    deadline = time.time() + 240
    while True:
        assert time.time() < deadline, "two-rank spool run did not finish"
        if all(p.poll() == 0 for p in procs):
            return kills
        if any(p.poll() not in (None, 0) for p in procs):  # one killed: the other stops too
            for p in procs:
                p.wait(timeout=120)
            # Only a kill of ours may stop a run (not, say, a rank that timed out waiting).
            assert killed, [p.stderr.read() for p in procs]
            procs, killed = start_world(root, hidden, out, 2, "--resume"), False
            continue
        done = lines(out / "metrics.jsonl")
        if kills < kills_wanted and done >= 4 + 5 * kills and all(p.poll() is None for p in procs):
            procs[1 - kills % 2].send_signal(signal.SIGKILL)  # rank 1, then rank 0
            kills, killed = kills + 1, True
        time.sleep(0.02)


def test_spool_two_ranks_kill9_and_resume(tmp_path):
    """Two ranks on one spool, one of them SIGKILLed twice mid-run (the other then stops,
    naming it), both restarted with --resume: the offline two-rank run, byte for byte."""
    ttc.make_world(tmp_path, n_train=22, n_test=4)
    _, order = offline(tmp_path)
    train_world(tmp_path, str(tmp_path / "train-hidden"), tmp_path / "offline2", 2)
    spool, out = tmp_path / "spool", tmp_path / "run2"
    prod = producer(tmp_path, str(spool), order, 0.01, WORLD_BUDGET)
    assert world_with_kills(tmp_path, f"spool:{spool}", out) == 2
    assert prod.wait(timeout=120) == 0, prod.stderr.read()
    assert (out / "model.safetensors").read_bytes() == \
        (tmp_path / "offline2" / "model.safetensors").read_bytes()
    assert stable_metrics((out / "metrics.jsonl").read_text()) == \
        stable_metrics((tmp_path / "offline2" / "metrics.jsonl").read_text())


def lines(path):
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def test_spool_kill9_either_side(tmp_path):
    """SIGKILL the producer and the trainer at several points; both restart (the trainer with
    --resume) and the result is the offline run, exactly."""
    ttc.make_world(tmp_path, n_train=24, n_test=4)
    steps, order = offline(tmp_path)
    spool, out, trace = tmp_path / "spool", tmp_path / "run", tmp_path / "run.trace"
    watch = Watch(str(spool))
    rng = random.Random(int(os.environ.get("DFLASH_SPOOL_TEST_SEED", "3")))
    prod = producer(tmp_path, str(spool), order, 0.01)
    trainer = train(tmp_path, f"spool:{spool}", out, env=trace_env(trace), wait=False)
    kills = {"producer": 0, "trainer": 0}
    deadline = time.time() + 240
    while trainer.poll() is None or trainer.returncode != 0:
        assert time.time() < deadline, "spool run did not finish"
        if trainer.poll() is not None:  # killed, or died: it must have been killed by us
            assert trainer.returncode == -signal.SIGKILL, trainer.stderr.read()
            trainer = train(tmp_path, f"spool:{spool}", out, "--resume", env=trace_env(trace),
                            wait=False)
        if prod.poll() not in (None, 0):
            assert prod.returncode == -signal.SIGKILL, prod.stderr.read()
            prod = producer(tmp_path, str(spool), order, 0.01)
        time.sleep(rng.uniform(0.05, 0.4))
        target = rng.choice(["producer", "trainer"])
        p = prod if target == "producer" else trainer
        if kills[target] < 4 and p.poll() is None and lines(out / "metrics.jsonl") > 0:
            p.send_signal(signal.SIGKILL)
            p.wait()
            kills[target] += 1
    if prod.poll() == -signal.SIGKILL:  # killed after its last shard, as the trainer finished:
        prod = producer(tmp_path, str(spool), order, 0.01)  # a restart finds its work done
    assert prod.wait(timeout=120) == 0, prod.stderr.read()
    high = watch.close()
    print("kills:", kills)
    assert kills["trainer"] >= 1 and kills["producer"] >= 1, kills
    check_same_run(tmp_path, out, steps, trace)
    assert high <= BUDGET + max_shard(tmp_path), high


def test_spool_producer_full_and_recovery(tmp_path):
    """Non-blocking producer: DFLASH_E_TIMEOUT names the spool and the sample is not taken;
    a restarted producer knows the published ids and drops a shard that died unpublished."""
    spool = str(tmp_path / "spool")
    h = np.ones((10, 8), np.float32)
    w = libdflash.HiddenWriter(spool, num_layers=1, hidden_size=8, shard_bytes=300,
                               spool_budget=600, spool_wait=0)
    with pytest.raises(ValueError):  # budget under two shards
        libdflash.HiddenWriter(str(tmp_path / "x"), num_layers=1, hidden_size=8,
                               shard_bytes=300, spool_budget=500)
    taken = []
    with pytest.raises(libdflash.DeadlineError, match=f"spool {spool} is full"):
        for i in range(100):
            w.append(f"s{i}", h)
            taken.append(f"s{i}")
    refused = f"s{len(taken)}"
    assert refused not in w and all(t in w for t in taken)
    with pytest.raises(libdflash.DuplicateError):
        w.append(taken[0], h)
    w.close  # killed: the buffered full shard is never published
    del w
    published = [line.strip() for name in sorted(os.listdir(spool)) if name.endswith(".ids")
                 for line in open(os.path.join(spool, name))]
    # A crash between the .ids and the shard: the shard is missing and was never consumed.
    names = sorted(n for n in os.listdir(spool) if n.endswith(".safetensors"))
    os.unlink(os.path.join(spool, names[-1]))
    lost = open(os.path.join(spool, names[-1].replace(".safetensors", ".ids"))).read().split()
    w2 = libdflash.HiddenWriter(spool, num_layers=1, hidden_size=8, shard_bytes=300,
                                spool_budget=600, spool_wait=0)
    for sid in published:
        assert (sid in w2) == (sid not in lost), sid
    assert w2.spool_status()["samples"] == len(published) - len(lost)
    with pytest.raises(libdflash.MismatchError):
        libdflash.HiddenWriter(spool, num_layers=1, hidden_size=16, shard_bytes=300,
                               spool_budget=600)
    # The consumer gets every published sample once, in order, then times out naming the spool.
    sp = libdflash.Spool(spool, wait=0)
    got = [sid for sid, _, _ in iter(lambda: _next_or_none(sp), None)]
    assert got == [s for s in published if s not in lost]
    with pytest.raises(libdflash.DeadlineError, match=f"spool {spool}: no shard"):
        sp.next()


def _next_or_none(sp):
    try:
        return sp.next()
    except libdflash.DeadlineError:
        return None


def test_spool_reuse_and_errors(tmp_path):
    """--spool-reuse: one published epoch trains every epoch (kept shards); a wrong width and a
    missing spool are reported naming it."""
    ttc.make_world(tmp_path, n_train=8, n_test=4)
    spool = tmp_path / "spool"
    src = libdflash.HiddenStore(tmp_path / "train-hidden")
    w = libdflash.HiddenWriter(spool, num_layers=1, hidden_size=32, shard_bytes=SHARD,
                               spool_budget=10 * BUDGET)
    for sid in src.ids():
        w.append(sid, src.read(sid))
    w.end_epoch()
    w.close()
    train(tmp_path, f"spool:{spool}", tmp_path / "run", "--spool-reuse")
    assert [n for n in os.listdir(spool) if n.endswith(".safetensors")]  # kept
    epochs = {json.loads(x)["epoch"] for x in open(tmp_path / "run" / "metrics.jsonl")}
    assert epochs == {0, 1, 2}
    r = subprocess.run([CLI, "train", "--config", str(tmp_path / "drafter.json"), "--target",
                        str(tmp_path / "target"), "--data", str(tmp_path / "train"), "--hidden",
                        f"spool:{tmp_path}/none", "-o", str(tmp_path / "r2"), *ARGS,
                        "--spool-wait", "0"], capture_output=True, text=True)
    assert r.returncode == 1 and f"spool {tmp_path}/none: no spool.json" in r.stderr, r.stderr
    w = libdflash.HiddenWriter(tmp_path / "sp16", num_layers=1, hidden_size=16,
                               shard_bytes=SHARD, spool_budget=BUDGET)
    w.close()
    r = subprocess.run([CLI, "train", "--config", str(tmp_path / "drafter.json"), "--target",
                        str(tmp_path / "target"), "--data", str(tmp_path / "train"), "--hidden",
                        f"spool:{tmp_path}/sp16", "-o", str(tmp_path / "r3"), *ARGS],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "16 features per token" in r.stderr, r.stderr


def _bf16(x):
    """float32 -> bf16 -> float32, round to nearest even (what a bf16 spool keeps)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return (b.astype(np.uint32) << 16).view(np.float32)


def test_spool_carries_final_state(tmp_path):
    """HiddenWriter(spool_budget=..., final_state=True): the consumer's Spool says final_state
    and gives every sample its target final state (next/iterate(final_state=True)), bf16 as
    written (within bf16's half ulp, 2^-8 of the value); the plain items are unchanged. A spool
    without it says so and gives None; a producer of the other kind is refused on either."""
    rng = np.random.default_rng(3)
    xs = {f"s{i}": rng.standard_normal((5 + i, 16)).astype(np.float32) for i in range(5)}
    fs = {sid: (rng.standard_normal((len(x), 8)) * 10).astype(np.float32)
          for sid, x in xs.items()}
    spool, plain = tmp_path / "spool", tmp_path / "plain"
    with libdflash.HiddenWriter(spool, num_layers=2, hidden_size=8, shard_bytes=300,
                                spool_budget=1 << 20, final_state=True) as w:
        with pytest.raises(ValueError, match="final_state is required"):
            w.append("s0", xs["s0"])
        for sid, x in xs.items():
            w.append(sid, x, final_state=fs[sid])
        w.end_epoch()
    assert len([n for n in os.listdir(spool) if n.endswith(".safetensors")]) > 1
    sp = libdflash.Spool(spool, wait=0)
    assert sp.final_state
    got = list(sp.iterate(0, final_state=True))
    assert [g[0] for g in got] == list(xs)
    for sid, hidden, fin, _pos in got:
        np.testing.assert_array_equal(hidden, _bf16(xs[sid]))
        assert fin.shape == (len(xs[sid]), 8)
        assert np.all(np.abs(fin - fs[sid]) <= np.abs(fs[sid]) * 2.0 ** -8)
        np.testing.assert_array_equal(fin, _bf16(fs[sid]))
    assert [len(item) for item in sp.iterate(0)] == [3] * len(xs)  # the plain items
    with libdflash.HiddenWriter(plain, num_layers=2, hidden_size=8, shard_bytes=300,
                                spool_budget=1 << 20) as w:
        w.append("s0", xs["s0"])
        w.end_epoch()
    sp = libdflash.Spool(plain, wait=0)
    assert not sp.final_state
    sid, _hidden, fin, _pos = sp.next(final_state=True)
    assert sid == "s0" and fin is None
    for where, kind in ((spool, False), (plain, True)):
        with pytest.raises(libdflash.Error, match="spool.json") as e:
            libdflash.HiddenWriter(where, num_layers=2, hidden_size=8, shard_bytes=300,
                                   spool_budget=1 << 20, final_state=kind)
        assert e.value.status == "DFLASH_E_MISMATCH"


def test_train_run_spool_options(tmp_path):
    """train_run(spool_reuse=..., spool_wait_s=...): the spool's settings are run options, set
    from Python as from the command line (they were environment variables that only `dflash
    train` set). One published epoch trains three with spool_reuse; without it, epoch 1 waits
    spool_wait_s for shards that never come and ends in DeadlineError, long before the
    default 600 s."""
    ttc.make_world(tmp_path, n_train=8, n_test=4)
    spool = tmp_path / "spool"
    src = libdflash.HiddenStore(tmp_path / "train-hidden")
    w = libdflash.HiddenWriter(spool, num_layers=1, hidden_size=32, shard_bytes=SHARD,
                               spool_budget=10 * BUDGET)
    for sid in src.ids():
        w.append(sid, src.read(sid))
    w.end_epoch()
    w.close()
    args = (tmp_path / "drafter.json", tmp_path / "target", tmp_path / "train", f"spool:{spool}")
    kw = dict(epochs=3, batch_size=4, num_anchors=16, seed=5, lr=5e-3, n_threads=1)
    libdflash.train_run(*args, tmp_path / "run", spool_reuse=True, spool_wait_s=5, **kw)
    epochs = {json.loads(x)["epoch"] for x in open(tmp_path / "run" / "metrics.jsonl")}
    assert epochs == {0, 1, 2}
    t0 = time.monotonic()
    with pytest.raises(libdflash.DeadlineError):
        libdflash.train_run(*args, tmp_path / "run2", spool_wait_s=0.5, **kw)
    assert time.monotonic() - t0 < 60
