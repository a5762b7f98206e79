#!/usr/bin/env python3
"""Client CPU per GB of reading from S3: libdflash against curl and boto3, same objects, same
server, one run.

    python3 bench/s3_read.py --cli BUILD/tools/dflash/dflash [--mib 512] [--reps 3]
        [--shard-mib 64]

The server is moto on loopback (tests/storage/s3env.py's, signatures checked), started in
this process; each client is a child process and its CPU (user + system, from
getrusage(RUSAGE_CHILDREN)) is what is reported, so the server's CPU (and this process's, which
writes the objects) is not counted. Loopback hides network time, so the figure to compare is
CPU-s per GB, not throughput.

Every client runs on a large input and on a small one (1 MiB; a one-shard spool); CPU-s/GB is
the difference of the two over the difference of their bytes: what a further GB costs, without
the fixed cost of starting the process (libdflash's OpenBLAS threads spin a few tens of ms at
load, boto3's import takes 0.7 s). "raw" is the large run's CPU over its bytes. The spool table
adds "steady": the difference against a spool of two shards of the same size, over the
difference in bytes, which leaves out the consumer's one-time cost of its two read buffers
(the kernel zeroing ~2 x 1.125 shard of fresh pages at their first touch): what a further GB
costs in a long run (the issue's 150 TB stream).

One object (--mib):
  libdflash       `dflash cp s3://B/K -` to /dev/null: dflash_storage_read (one GET into memory)
  libdflash-file  `dflash cp s3://B/K FILE`: dflash_storage_copy, ranged GETs into a reused
                  buffer, written to a durable file
  curl, curl-file the curl tool (the same libcurl) with --aws-sigv4, -o /dev/null or -o FILE
  boto3           get_object()["Body"].read(1 MiB) to the end, in a fresh Python

A spool of --mib in shards of --shard-mib (written by libdflash.HiddenWriter, bf16), read
whole, shard after shard, in one process per client:
  spool           dflash_spool_next with stored_rows (as `dflash train` on CUDA reads it):
                  per shard a HEAD and one GET into a reused buffer, the NaN/Inf check of the
                  codes, no local file
  spool-f32       dflash_spool_next decoding to float32 (as the CPU trainer reads it)
  spool-no-ahead  spool with DFLASH_SPOOL_READ_AHEAD=0: no next shard read on a thread meanwhile
  curl            one curl for all the shard URLs, -o /dev/null each
  boto3           get_object()["Body"].read(1 MiB) of each shard
"""
import argparse
import os
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "storage"))
import s3env  # noqa: E402  (moto with its signature checker fixed)

KEY_ID, SECRET, REGION, BUCKET = "bench", "bench-secret", "us-east-1", "bench"
SMALL = 1 << 20
K, H = 4, 1024  # spool samples: bf16 [S, K*H], 8 KiB per token


def child_cpu(cmd, env, stdout=subprocess.DEVNULL):
    """Run cmd to completion; its user+system CPU seconds and wall seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=stdout, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def start_moto():
    port = s3env.free_port()
    threading.Thread(target=s3env.serve_moto, args=(port,), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            import urllib.request
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            return url
        except Exception:
            time.sleep(0.05)
    sys.exit("moto did not start")


def s3_client(url):
    import boto3
    return boto3.client("s3", endpoint_url=url, aws_access_key_id=KEY_ID,
                        aws_secret_access_key=SECRET, region_name=REGION)


def write_spool(prefix, n_bytes, shard_bytes, seed):
    """A spool of about n_bytes at s3://BUCKET/prefix (this process, through the bindings);
    its shard keys and their total size."""
    import numpy as np
    import libdflash
    tokens = max(1, min(2048, n_bytes // (K * H * 2)))
    w = libdflash.HiddenWriter(f"s3://{BUCKET}/{prefix}", num_layers=K, hidden_size=H,
                               shard_bytes=shard_bytes, spool_budget=4 * n_bytes + 2 * shard_bytes)
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((tokens, K * H), dtype=np.float32)
    i, written = 0, 0
    while written < n_bytes:
        base[0, 0] = i  # each sample its own
        w.append(f"s{i:05d}", base)
        written += base.size * 2
        i += 1
    w.end_epoch()
    w.close()
    return i


def spool_shards(client, prefix):
    keys, total = [], 0
    for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", []):
        if o["Key"].endswith(".safetensors"):
            keys.append(o["Key"])
            total += o["Size"]
    return sorted(keys), total


BOTO_READ = """
import boto3, os, sys
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
n = 0
for key in sys.argv[1:]:
    body = s3.get_object(Bucket="bench", Key=key)["Body"]
    while True:
        b = body.read(1 << 20)
        if not b:
            break
        n += len(b)
print(n)
"""

# The spool consumer through ctypes (no copies into Python objects).
LIB_READ = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
mode, where = sys.argv[2], sys.argv[3]  # spool | spool-f32, s3://B/PREFIX
P = ctypes.c_void_p
class Opts(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("wait_s", ctypes.c_double),
                ("reuse", ctypes.c_int32), ("stored_rows", ctypes.c_int32)]
class Sample(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("index", ctypes.c_uint64),
                ("id", ctypes.c_char_p), ("len", ctypes.c_int64), ("input_ids", P),
                ("loss_mask", P), ("hidden", P), ("target_ids", P),
                ("hidden_dtype", ctypes.c_int32), ("hidden_codes", P), ("hidden_scales", P),
                ("epoch", ctypes.c_int32), ("shard", ctypes.c_uint64), ("offset", ctypes.c_uint64)]
def check(rc, what):
    if rc:
        lib.dflash_last_error.restype = ctypes.c_char_p
        sys.exit(f"{what}: status {rc}: {lib.dflash_last_error()}")
tokens = 0
o = Opts()
lib.dflash_spool_options_init(ctypes.byref(o), ctypes.c_size_t(ctypes.sizeof(o)))
o.wait_s, o.stored_rows = 10.0, int(mode == "spool")
sp = P()
check(lib.dflash_spool_open(where.encode(), ctypes.byref(o), ctypes.byref(sp)), "open")
smp, end = Sample(struct_size=ctypes.sizeof(Sample)), ctypes.c_int()
while True:
    check(lib.dflash_spool_next(sp, ctypes.byref(smp), ctypes.byref(end)), "next")
    if end.value:
        break
    tokens += smp.len
lib.dflash_spool_free(sp)
print(tokens)
"""


def measure(clients, reps, env):
    """clients: name -> (cmd_large, bytes_large, cmd_small, bytes_small[, cmd_mid, bytes_mid]).
    Median CPU of each; name -> (marginal CPU-s/GB, raw CPU-s/GB, wall s of the large run,
    steady CPU-s/GB: large against mid, or None)."""
    rows = {}
    for name, (big, nbig, small, nsmall, *mid) in clients.items():
        runs = [child_cpu(big, env) for _ in range(reps)]
        cpu_big = statistics.median(r[0] for r in runs)
        cpu_small = statistics.median(child_cpu(small, env)[0] for _ in range(reps))
        steady = None
        if mid:
            cpu_mid = statistics.median(child_cpu(mid[0], env)[0] for _ in range(reps))
            steady = (cpu_big - cpu_mid) / ((nbig - mid[1]) / 1e9)
        rows[name] = ((cpu_big - cpu_small) / ((nbig - nsmall) / 1e9), cpu_big / (nbig / 1e9),
                      statistics.median(r[1] for r in runs), steady)
    return rows


def table(title, rows, pairs):
    print(title)
    steady = any(r[3] is not None for r in rows.values())
    print(f"  {'client':15} {'CPU-s/GB':>9} {'raw':>7} {'wall s':>7}" +
          (f" {'steady':>7}" if steady else ""))
    for name, (cpu_gb, raw, wall, st) in rows.items():
        print(f"  {name:15} {cpu_gb:9.3f} {raw:7.3f} {wall:7.2f}" +
              (f" {st:7.3f}" if steady else ""))
    for mine, peer in pairs:
        if mine in rows and peer in rows:
            print(f"  {mine} / {peer}: {rows[mine][0] / rows[peer][0]:.2f}x CPU per GB" +
                  (f", steady {rows[mine][3] / rows[peer][3]:.2f}x" if steady else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cli", required=True, help="the dflash command (BUILD/tools/dflash/dflash)")
    ap.add_argument("--lib", help="libdflash.so (default: BUILD/libdflash.so beside --cli)")
    ap.add_argument("--mib", type=int, default=512, help="object and spool size in MiB (512)")
    ap.add_argument("--shard-mib", type=int, default=64, help="spool shard size in MiB (64)")
    ap.add_argument("--reps", type=int, default=3, help="runs per client; the median is used (3)")
    ap.add_argument("--only", choices=["object", "spool"], help="one of the two tables")
    args = ap.parse_args()
    try:
        import boto3  # noqa: F401
        import moto  # noqa: F401
    except ImportError as e:
        sys.exit(f"needs moto[server] and boto3 (scripts/requirements.txt): {e}")
    cli = str(pathlib.Path(args.cli).resolve())
    lib = args.lib or str(pathlib.Path(cli).parents[2] / "libdflash.so")
    nbytes = args.mib << 20
    url = start_moto()
    env = dict(os.environ, AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID=KEY_ID,
               AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION=REGION, DFLASH_S3_ADDRESSING="path")
    env.pop("AWS_SESSION_TOKEN", None)
    os.environ.update(env)  # the producer below runs in this process
    s3 = s3_client(url)
    s3.create_bucket(Bucket=BUCKET)
    tmp = tempfile.mkdtemp(prefix="s3-read-")
    curl = ["curl", "-sf", "--aws-sigv4", f"aws:amz:{REGION}:s3", "--user", f"{KEY_ID}:{SECRET}"]
    have_curl = shutil.which("curl") is not None
    print(f"moto on loopback, median of {args.reps}; CPU-s/GB: (CPU large - CPU small) / "
          f"(GB large - GB small)")

    if args.only != "spool":
        s3.put_object(Bucket=BUCKET, Key="object.bin", Body=os.urandom(nbytes))
        s3.put_object(Bucket=BUCKET, Key="small.bin", Body=os.urandom(SMALL))

        def per_key(f):
            return (f("object.bin"), nbytes, f("small.bin"), SMALL)
        clients = {
            "libdflash": per_key(lambda k: [cli, "cp", f"s3://{BUCKET}/{k}", "-"]),
            "libdflash-file": per_key(lambda k: [cli, "cp", f"s3://{BUCKET}/{k}",
                                                 f"{tmp}/dflash.bin"])}
        if have_curl:
            clients["curl"] = per_key(lambda k: curl + [f"{url}/{BUCKET}/{k}", "-o", "/dev/null"])
            clients["curl-file"] = per_key(lambda k: curl + [f"{url}/{BUCKET}/{k}", "-o",
                                                             f"{tmp}/curl.bin"])
        clients["boto3"] = per_key(lambda k: [sys.executable, "-c", BOTO_READ, k])
        rows = measure(clients, args.reps, env)
        table(f"one object of {args.mib} MiB (small: 1 MiB)", rows,
              (("libdflash", "curl"), ("libdflash", "boto3"), ("libdflash-file", "curl-file")))

    if args.only != "object":
        n_big = write_spool("spool", nbytes, args.shard_mib << 20, 1)
        write_spool("spool-small", SMALL, args.shard_mib << 20, 2)
        write_spool("spool-two", 2 * (args.shard_mib << 20), args.shard_mib << 20, 3)
        big_keys, big_bytes = spool_shards(s3, "spool")
        small_keys, small_bytes = spool_shards(s3, "spool-small")
        two_keys, two_bytes = spool_shards(s3, "spool-two")

        def per_spool(f):
            return (f("spool", big_keys), big_bytes, f("spool-small", small_keys), small_bytes,
                    f("spool-two", two_keys), two_bytes)

        py = [sys.executable, "-c", LIB_READ, lib]
        clients = {
            "spool": per_spool(lambda p, keys: py + ["spool", f"s3://{BUCKET}/{p}"]),
            "spool-f32": per_spool(lambda p, keys: py + ["spool-f32", f"s3://{BUCKET}/{p}"]),
            "spool-no-ahead": per_spool(lambda p, keys: [
                "env", "DFLASH_SPOOL_READ_AHEAD=0"] + py + ["spool", f"s3://{BUCKET}/{p}"])}
        if have_curl:
            clients["curl"] = per_spool(lambda p, keys: curl + [
                x for k in keys for x in (f"{url}/{BUCKET}/{k}", "-o", "/dev/null")])
        clients["boto3"] = per_spool(lambda p, keys: [sys.executable, "-c", BOTO_READ] + keys)
        rows = measure(clients, args.reps, env)
        table(f"spool of {big_bytes / 2**20:.0f} MiB: {len(big_keys)} shards, {n_big} samples of "
              f"[{min(2048, nbytes // (K * H * 2))}, {K}x{H}] bf16 (small: one shard, "
              f"{small_bytes / 2**20:.2f} MiB; steady: against a two-shard spool)", rows,
              (("spool", "curl"), ("spool", "boto3")))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
