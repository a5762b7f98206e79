#!/usr/bin/env python3
"""Per-call cost of Tokenizer.encode from Python on short strings, and encode_batch's scaling
from one thread to two (o200k).

  DFLASH_LIBRARY=build-x/libdflash.so DFLASH_PYEXT=build-x/bindings/python/ext/_fast*.so \\
    python3 bench/tokenizer_call.py [--calls 200000] [--mb 4]

Runs itself with .venv-tok's Python when it exists (bench/tokenizer_bench.py --setup), where
the peers are; DFLASH_PYEXT must then be a build of libdflash._fast for that venv's numpy (a
build folder configured with .venv-tok/bin first on PATH). The extension's absence is reported,
not an error: the ctypes path is timed regardless.

1. Per call: libdflash through its compiled extension (Tokenizer.encode when it loads) and
   through ctypes (Tokenizer._encode_ctypes), tiktoken, Hugging Face `tokenizers` and the peers
   of bench/tokenizer_bench.py that are installed, on the same short strings (ordinary text, no
   special tokens), in us per call (the call and the encoding of the string): the engines take
   turns for --repeat rounds of --calls calls, each keeps its best round, in process CPU time
   (and wall time, which a loaded machine inflates; ratios are of CPU time) (per_call); ids
   checked against tiktoken's.
2. Batch: encode_batch of --mb MB of documents (tests/tokenizer/corpus.py, fresh text per run;
   16 KiB and 256-byte documents) on 1 and 2 threads, through both paths: wall and CPU seconds,
   MB/s, the 2-thread speedup in wall time, with the load average (the machine may be shared),
   and an estimate of the speedup on two idle cores from CPU time (batch_scaling).
"""
import argparse
import base64
import gzip
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "tokenizer"))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, HERE)
os.environ.setdefault("RAYON_NUM_THREADS", "1")  # peers' pools: the per-call part is one thread

SHORT = ["Hello, world!", "The quick brown fox jumps over the lazy dog.", "x = f(a, b) + 1",
         "Grüße aus Köln, naïve café", "日本語のテキスト", "  indented\n\tcode();"]


def reexec_in_venv():
    venv = os.path.join(ROOT, ".venv-tok")
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(py) and os.path.realpath(sys.prefix) != os.path.realpath(venv):
        os.execv(py, [py, *sys.argv])


def o200k_files(fixtures, tmp):
    """(gz path, plain path, ranks) of the o200k rank file."""
    gz = os.path.join(fixtures, "tokenizers", "openai", "o200k_base.tiktoken.gz")
    plain = os.path.join(tmp, "o200k_base.tiktoken")
    with gzip.open(gz) as src:
        data = src.read()
    with open(plain, "wb") as dst:
        dst.write(data)
    ranks = {base64.b64decode(t): int(r) for t, r in (l.split() for l in data.splitlines() if l)}
    return gz, plain, ranks


def engines(gz, plain, ranks):
    """name -> encode(str) -> ids, each built or skipped with the reason printed."""
    import oracle_tiktoken as ot
    import libdflash
    from libdflash import tokenizer as lt
    out = {}
    tok = libdflash.Tokenizer(gz, pattern="o200k")
    # the call as users write it, tok.encode(s): SHORT has no special tokens, so the default
    # special="all" gives the ordinary ids (checked against tiktoken's encode_ordinary below)
    if lt._fast is not None:
        out["libdflash (extension)"] = tok._encode_fast
    else:
        print("  libdflash extension: not loaded (DFLASH_PYEXT unset, or built for another "
              "numpy); ctypes path only")
    out["libdflash (ctypes)"] = tok._encode_ctypes

    def add(name, make):
        try:
            out[name] = make()
        except ImportError as e:
            print(f"  skipped {name}: not installed ({e})")
        except Exception as e:  # noqa: BLE001 - a peer that cannot load this pattern
            print(f"  skipped {name}: {type(e).__name__}: {str(e)[:120]}")

    def tk():
        import tiktoken
        enc = tiktoken.Encoding("o200k", pat_str=ot.O200K, mergeable_ranks=ranks, special_tokens={})
        return enc.encode_ordinary

    def hf():
        import json
        import basetenkenizer
        import tiktoken
        import tokenizers
        enc = tiktoken.Encoding("o200k", pat_str=ot.O200K, mergeable_ranks=ranks, special_tokens={})
        spec = json.loads(basetenkenizer.tiktoken_to_tokenizer_json(enc))
        spec.pop("decoder", None)  # a ByteLevel decoder tokenizers 0.23 refuses; encode needs none
        t = tokenizers.Tokenizer.from_str(json.dumps(spec))
        return lambda s: t.encode(s, add_special_tokens=False).ids

    def giga():
        import gigatoken
        t = gigatoken.Tokenizer.from_tiktoken(plain, pretokenizer="o200k", special_tokens={})
        return t.encode

    def fast():
        import fastokens
        t = fastokens.Tokenizer.from_tiktoken(plain, pattern=ot.O200K, special_tokens={})
        return lambda s: t.encode(s).ids

    def quick():
        import quicktok
        return quicktok.get_encoding("o200k_base").encode_ordinary

    def baseten():
        import basetenkenizer
        import tiktoken
        enc = tiktoken.Encoding("o200k", pat_str=ot.O200K, mergeable_ranks=ranks, special_tokens={})
        t = basetenkenizer.Tokenizer.from_json_str(basetenkenizer.tiktoken_to_tokenizer_json(enc))
        return lambda s: t.encode(s).ids

    for name, make in (("tiktoken", tk), ("HF tokenizers", hf), ("gigatoken", giga),
                       ("fastokens", fast), ("quicktok-v1", quick), ("basetenkenizer", baseten)):
        add(name, make)
    return tok, out


def per_call(out, calls, repeat):
    """us per call of each engine over SHORT, ids checked against tiktoken's. The engines take
    turns, `repeat` rounds of `calls` calls each, and each keeps its fastest round, timed in
    process CPU time: on a shared machine, time spent descheduled is not the call's."""
    ref = out.get("tiktoken")
    strings = SHORT * (calls // len(SHORT))
    best = {}
    for name, fn in out.items():
        bad = sum(ref is not None and [int(i) for i in fn(s)] != ref(s) for s in SHORT)
        if bad:
            print(f"  {name}: MISMATCHES with tiktoken on {bad} of {len(SHORT)} strings")
        best[name] = (float("inf"), float("inf"))
    for _ in range(repeat):
        for name, fn in out.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for s in strings:
                fn(s)
            w, c = time.perf_counter() - w0, time.process_time() - c0
            best[name] = (min(best[name][0], c), min(best[name][1], w))
    res = {name: c / len(strings) * 1e6 for name, (c, w) in best.items()}
    for name, us in res.items():
        wall = best[name][1] / len(strings) * 1e6
        print(f"  {name:<24} {us:7.3f} us/call CPU time  ({wall:.3f} wall)", flush=True)
    ours = res.get("libdflash (extension)") or res["libdflash (ctypes)"]
    for name, us in res.items():
        if not name.startswith("libdflash"):
            print(f"  RATIO per call: {name} / libdflash = {us / ours:.2f}x "
                  "(above 1: libdflash is faster)")
    if "libdflash (extension)" in res:
        print(f"  RATIO per call: ctypes / extension = "
              f"{res['libdflash (ctypes)'] / res['libdflash (extension)']:.2f}x")


def batch_run(batch, docs, threads):
    """(wall s, process CPU s) of one encode_batch call."""
    w0, c0 = time.perf_counter(), time.process_time()
    batch(docs, special="none", n_threads=threads)
    return time.perf_counter() - w0, time.process_time() - c0


def batch_scaling(tok, mb, rounds):
    """encode_batch on 1 and 2 threads, through each path, over fresh documents of 16 KiB and
    of 256 bytes. Wall time is what the target is about, but a loaded machine decides it; so
    also an estimate for two idle cores from CPU time alone: T1 (1-thread CPU seconds) and the
    binding's serial part S (the same number of empty texts: everything a call does per text
    but encode it), speedup = T1 / (S + (T1 - S) / 2)."""
    import corpus
    from libdflash import tokenizer as lt
    paths = [("ctypes", tok._encode_batch_ctypes)]
    if lt._fast is not None:
        paths.insert(0, ("extension", tok._encode_batch_fast))
    print(f"  load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"(on {os.cpu_count()} CPUs)")
    tok.encode_batch(corpus.documents(0.2, seed=5000), n_threads=2)  # the pool, the caches
    for doc_kb in (16, 0.25):
        for pname, batch in paths:
            res = {}
            for threads in (1, 2):
                nbytes = wall = cpu = 0.0
                for r in range(rounds):
                    docs = corpus.documents(mb, seed=6000 + 10 * threads + r, doc_kb=doc_kb)
                    nbytes += sum(len(d.encode()) for d in docs)
                    w, c = batch_run(batch, docs, threads)
                    wall, cpu = wall + w, cpu + c
                res[threads] = (nbytes / wall / 1e6, cpu, wall)
                print(f"  {pname:<9} {doc_kb:>5} KiB docs, {threads} thread(s): "
                      f"{nbytes / 1e6:.1f} MB, wall {wall:.2f} s, CPU {cpu:.2f} s "
                      f"({cpu / wall:.2f} cores), {nbytes / wall / 1e6:.1f} MB/s wall, "
                      f"{nbytes / cpu / 1e6:.1f} MB/CPU-s", flush=True)
            empty = [""] * len(docs)
            serial = min(batch_run(batch, empty, 1)[1] for _ in range(3)) * rounds
            t1 = res[1][1]
            est = t1 / (serial + (t1 - serial) / 2)
            print(f"  RATIO encode_batch {pname}, {doc_kb} KiB docs, 2 threads / 1: "
                  f"{res[2][0] / res[1][0]:.2f}x wall (measured); serial part {serial:.3f} of "
                  f"{t1:.2f} CPU-s, {est:.2f}x on 2 idle cores (estimate)", flush=True)
    print(f"  load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200000, help="calls per timed run")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--mb", type=float, default=4.0, help="MB of text per batch run")
    ap.add_argument("--rounds", type=int, default=2, help="batch runs per thread count")
    ap.add_argument("--only", default="", help="call or batch (default both)")
    ap.add_argument("--fixtures", default=os.environ.get(
        "DFLASH_FIXTURES", os.path.join(ROOT, "..", "shared", "fixtures")))
    args = ap.parse_args()
    reexec_in_venv()
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        gz, plain, ranks = o200k_files(args.fixtures, tmp)
        tok, out = engines(gz, plain, ranks)
        if args.only in ("", "call"):
            print(f"per call, o200k, {len(SHORT)} short strings, best of {args.repeat} rounds x "
                  f"{args.calls} calls, CPU time:")
            per_call(out, args.calls, args.repeat)
        if args.only in ("", "batch"):
            print(f"encode_batch scaling, o200k, {args.mb} MB x {args.rounds} runs per thread count:")
            batch_scaling(tok, args.mb, args.rounds)


if __name__ == "__main__":
    main()
