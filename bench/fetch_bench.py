#!/usr/bin/env python3
"""Client overhead of `dflash fetch` vs the Python asyncio + OpenAI SDK peer.

Both clients fetch the same prompts from the same local canned server
(bench/fetch_server.py) at the same concurrency, as subprocesses; the client's
own CPU time (user + sys, from wait4) and wall time are measured. Two runs:
  zero-latency: the server answers at once, so throughput is client-bound;
  held streams: each stream lasts ~--hold-s seconds, so --held-concurrency
                streams are open at once (the server reports the peak).
Prints requests/s and client CPU seconds per 1,000 requests, and the ratios.

usage: python3 bench/fetch_bench.py [--cli build/tools/dflash/dflash] [--n 4000]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def start_server(tokens, delay):
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "fetch_server.py"), "--tokens",
                          str(tokens), "--token-delay", str(delay)], stdout=subprocess.PIPE,
                         text=True)
    port = json.loads(p.stdout.readline())["port"]
    return p, f"http://127.0.0.1:{port}/v1", port


def measure(cmd):
    """Wall seconds and CPU seconds (user + sys) of one child process."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    err = p.stderr.read().decode()
    p.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[0]} failed: {err[-2000:]}")
    return wall, ru.ru_utime + ru.ru_stime


def count_lines(path):
    with open(path) as f:
        return sum(1 for _ in f)


def one_mode(name, args, tokens, delay, n, conc, work):
    server, url, port = start_server(tokens, delay)
    inp = os.path.join(work, f"{name}.jsonl")
    with open(inp, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"b{i}", "messages": [
                {"role": "user", "content": f"benchmark prompt {i}"}]}) + "\n")
    out = os.path.join(work, f"{name}-dflash")
    results = {}
    try:
        peaks = {}
        for client in ("dflash", "python"):
            if client == "dflash":
                # The bench server is raw SSE with no GET /models: skip the start-up check.
                cmd = [args.cli, "fetch", "--server", url, "--model", "bench", "--family", "kimi",
                       "--max-tokens", "64", "--concurrency", str(conc), "--log-interval", "3600",
                       "--no-server-check", inp, "-o", out]
                done = lambda: count_lines(os.path.join(out, "completions.jsonl"))  # noqa: E731
            else:
                pout = os.path.join(work, f"{name}-python.jsonl")
                cmd = [sys.executable, os.path.join(HERE, "fetch_peer.py"), inp, pout,
                       "--server", url, "--concurrency", str(conc)]
                done = lambda: count_lines(pout)  # noqa: E731
            before = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/peak").read())
            wall, cpu = measure(cmd)
            assert done() == n, f"{client}: {done()} of {n} results"
            peak = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/peak").read())
            peaks[client] = peak["peak"]
            results[client] = (n / wall, cpu / n * 1000)
            del before
    finally:
        server.kill()
        server.wait()
    d, p = results["dflash"], results["python"]
    print(f"\n[{name}] {n} requests, {tokens} tokens each, concurrency {conc}"
          + (f", {delay * (tokens + 4):.1f} s per stream" if delay else ""))
    print(f"  {'client':<28}{'req/s':>10}{'CPU s / 1k req':>18}")
    print(f"  {'dflash fetch (C, libcurl)':<28}{d[0]:>10.0f}{d[1]:>18.3f}")
    print(f"  {'python asyncio + openai SDK':<28}{p[0]:>10.0f}{p[1]:>18.3f}")
    print(f"  ratio: {d[0] / p[0]:.1f}x requests/s, {p[1] / d[1]:.1f}x less client CPU per request")
    if delay:
        print(f"  peak streams open at the server: {peaks} (the dflash client runs one thread)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", default=os.path.join(HERE, "..", "build", "tools", "dflash", "dflash"))
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--held-n", type=int, default=6000)
    ap.add_argument("--held-concurrency", type=int, default=2000)
    ap.add_argument("--hold-s", type=float, default=3.0)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fetch-bench-")
    try:
        one_mode("zero-latency", args, args.tokens, 0.0, args.n, args.concurrency, work)
        delay = args.hold_s / 12  # 8 tokens + role, finish, usage and [DONE] events
        one_mode("held-streams", args, 8, delay, args.held_n, args.held_concurrency, work)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
