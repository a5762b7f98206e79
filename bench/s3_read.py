#!/usr/bin/env python3
"""Client CPU per GB of reading one S3 object: libdflash against curl and boto3, same object,
same server, one run.

    python3 bench/s3_read.py --cli BUILD/tools/dflash/dflash [--mib 512] [--reps 3]

The server is moto on loopback (tests/storage/s3env.py's, signatures checked), started in
this process; each client is a child process and its CPU (user + system, from
getrusage(RUSAGE_CHILDREN)) is what is reported, so the server's CPU is not counted. Loopback
hides network time, so the figure to compare is CPU-s per GB, not throughput.

Clients:
  libdflash       `dflash cp s3://B/K -` to /dev/null: dflash_storage_read (one GET into memory)
  libdflash-file  `dflash cp s3://B/K FILE`: dflash_storage_copy, ranged GETs into a reused
                  buffer, written to a durable file: how the spool consumer stages an S3 shard
  curl, curl-file the curl tool (the same libcurl) with --aws-sigv4, -o /dev/null or -o FILE
  boto3           get_object().read() in a fresh Python (its import is timed alone, subtracted)
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

KEY_ID, SECRET, REGION, BUCKET, KEY = "bench", "bench-secret", "us-east-1", "bench", "object.bin"


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


def put_object(url, nbytes):
    import boto3
    s3 = boto3.client("s3", endpoint_url=url, aws_access_key_id=KEY_ID,
                      aws_secret_access_key=SECRET, region_name=REGION)
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key=KEY, Body=os.urandom(nbytes))


BOTO_READ = """
import boto3, os, sys
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
if sys.argv[1] == "read":
    body = s3.get_object(Bucket="bench", Key="object.bin")["Body"]
    n = 0
    while True:
        b = body.read(1 << 20)
        if not b:
            break
        n += len(b)
    assert n == int(sys.argv[2]), n
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cli", required=True, help="the dflash command (BUILD/tools/dflash/dflash)")
    ap.add_argument("--mib", type=int, default=512, help="object size in MiB (512)")
    ap.add_argument("--reps", type=int, default=3, help="runs per client; the median is shown (3)")
    args = ap.parse_args()
    try:
        import boto3  # noqa: F401
        import moto  # noqa: F401
    except ImportError as e:
        sys.exit(f"needs moto[server] and boto3 (scripts/requirements.txt): {e}")
    nbytes = args.mib << 20
    url = start_moto()
    put_object(url, nbytes)
    env = dict(os.environ, AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID=KEY_ID,
               AWS_SECRET_ACCESS_KEY=SECRET, AWS_REGION=REGION, DFLASH_S3_ADDRESSING="path")
    env.pop("AWS_SESSION_TOKEN", None)
    tmp = tempfile.mkdtemp(prefix="s3-read-")
    clients = {"libdflash": [args.cli, "cp", f"s3://{BUCKET}/{KEY}", "-"],
               "libdflash-file": [args.cli, "cp", f"s3://{BUCKET}/{KEY}", f"{tmp}/dflash.bin"]}
    if shutil.which("curl"):
        curl = ["curl", "-sf", "--aws-sigv4", f"aws:amz:{REGION}:s3", "--user", f"{KEY_ID}:{SECRET}",
                f"{url}/{BUCKET}/{KEY}", "-o"]
        clients["curl"] = curl + ["/dev/null"]
        clients["curl-file"] = curl + [f"{tmp}/curl.bin"]
    clients["boto3"] = [sys.executable, "-c", BOTO_READ, "read", str(nbytes)]
    boto_import = statistics.median(child_cpu([sys.executable, "-c", BOTO_READ, "import"], env)[0]
                                    for _ in range(args.reps))
    gb = nbytes / 1e9
    rows = {}
    for name, cmd in clients.items():
        runs = [child_cpu(cmd, env) for _ in range(args.reps)]
        cpu = statistics.median(r[0] for r in runs)
        if name == "boto3":
            cpu -= boto_import
        rows[name] = (cpu / gb, statistics.median(r[1] for r in runs))
    print(f"object {args.mib} MiB from moto on loopback, median of {args.reps}"
          f" (boto3: minus its import, {boto_import:.2f} CPU-s)")
    print(f"{'client':10} {'CPU-s/GB':>9} {'wall s':>7}")
    for name, (cpu_gb, wall) in rows.items():
        print(f"{name:10} {cpu_gb:9.3f} {wall:7.2f}")
    shutil.rmtree(tmp, ignore_errors=True)
    for mine, peer in (("libdflash", "curl"), ("libdflash", "boto3"), ("libdflash-file", "curl-file")):
        if peer in rows:
            print(f"{mine} / {peer}: {rows[mine][0] / rows[peer][0]:.2f}x CPU per GB")


if __name__ == "__main__":
    main()
