#!/usr/bin/env python3
"""Tokenizer throughput: libdflash against every exact peer on PyPI, on the o200k, Kimi K2
(o200k ranks) and Qwen2 patterns (cl100k with --only cl100k).

  python3 bench/tokenizer_bench.py --setup        # once: .venv-tok with the pinned peers
  DFLASH_LIBRARY=build-x/libdflash.so python3 bench/tokenizer_bench.py [--mb 2] [--rounds 3]

The peers live in a venv of the bench's own (.venv-tok, gitignored, PEERS below); when it
exists the bench runs itself with it. A peer that is absent or cannot load the pattern is
skipped with the reason. Every round encodes text no encoder has seen before (a new corpus
seed per round and per thread count, so no piece cache is flattered). One thread: a loop of
single-text encode calls, MB per CPU-second (the median round, and the range), every engine
before any batch call (a peer's idle pool threads would otherwise be counted against the next
engine), the engines taking turns within each round. Two threads: each engine's batch call
with 2 threads, MB per wall-second (and its CPU/wall, which says whether both threads really
ran); SCALING compares that with one thread's MB per CPU-second, which is the 2-thread speed-up
when the machine gives the process two whole cores.
--by-category times one thread per category of the synthetic corpus (English, CJK, code, emoji,
...), which says where libdflash leads or trails.
--real times one thread on real text by category (bench/real_corpus.py: man pages and licences,
C headers and this project's sources, sympy/mpmath math docstrings, CJK and Cyrillic man pages,
the demo's completions) and on the "reasoning" mix (70 % English, 20 % code, 10 % math), the
headline; --mb is then per category and round, and each line gives libdflash's piece-cache hit
rate (pieces answered without the vocabulary or a merge, one-byte pieces included; from the
experimental dflash_tokenizer_thread_stats) and the thread's cache memory.
--engines gigatoken,tiktoken keeps those peers (and the reference, and libdflash) only. Every engine's ids are checked against the reference (tiktoken's encode_ordinary for the
tiktoken patterns, Hugging Face `tokenizers` for Qwen2): an engine with mismatches is listed
as not exact and is left out of the ratios."""
import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VENV = os.path.join(ROOT, ".venv-tok")
PEERS = ["gigatoken==0.10.0", "fastokens==0.3.5", "quicktok-v1==0.4.0", "basetenkenizer==0.2.8",
         "tuetoken==0.1.3", "tiktoken==0.14.0", "tokenizers==0.23.3", "numpy",
         "sympy==1.13.1", "mpmath==1.3.0"]  # sympy, mpmath: the math text of --real (real_corpus)
THREADS = 2
os.environ.setdefault("RAYON_NUM_THREADS", str(THREADS))  # HF tokenizers, gigatoken pools
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
sys.path.insert(0, os.path.join(ROOT, "tests", "tokenizer"))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))


def setup():
    """Create .venv-tok and install the pinned peers into it (never into .venv-ref)."""
    if not os.path.exists(os.path.join(VENV, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    subprocess.run([os.path.join(VENV, "bin", "pip"), "install", "-q", *PEERS], check=True)
    print(f"peers installed in {VENV}; run the bench without --setup")


def reexec_in_venv():
    py = os.path.join(VENV, "bin", "python")
    if os.path.exists(py) and os.path.realpath(sys.prefix) != os.path.realpath(VENV):
        os.execv(py, [py, *sys.argv])


class Engine:
    """one(text) -> ids; batch(texts) -> list of ids (THREADS threads), or None."""

    def __init__(self, name, one, batch=None):
        self.name, self.one, self.batch = name, one, batch


def peer(name, make):
    """An Engine from make(), or None with the reason printed."""
    try:
        return make()
    except ImportError as e:
        print(f"  skipped {name}: not installed ({e}); run bench/tokenizer_bench.py --setup")
    except Exception as e:  # noqa: BLE001 - a peer that cannot load this pattern
        print(f"  skipped {name}: {type(e).__name__}: {str(e)[:160]}")
    return None


def as_list(ids):
    return [int(i) for i in ids]


# ---- engines per pattern ---------------------------------------------------------------------

def tiktoken_engines(case, pat, ranks, plain, lib_path):
    """Engines for a tiktoken pattern, all without special tokens (encode_ordinary)."""
    import libdflash
    out = []

    def tk():
        import tiktoken
        enc = tiktoken.Encoding(case, pat_str=pat, mergeable_ranks=ranks, special_tokens={})
        return Engine(f"tiktoken {tiktoken.__version__ if hasattr(tiktoken, '__version__') else ''}",
                      enc.encode_ordinary,
                      lambda ds: enc.encode_ordinary_batch(ds, num_threads=THREADS))
    out.append(peer("tiktoken", tk))

    def ours():
        t = libdflash.Tokenizer(lib_path)
        return Engine("libdflash", lambda s: t.encode(s, special="none"),
                      lambda ds: t.encode_batch(ds, special="none", n_threads=THREADS))
    out.append(peer("libdflash", ours))

    def giga():
        import gigatoken
        pre = {"o200k": "o200k", "cl100k": "cl100k", "kimi": "kimi"}[case]
        t = gigatoken.Tokenizer.from_tiktoken(plain, pretokenizer=pre, special_tokens={})
        return Engine("gigatoken 0.10.0", t.encode,
                      lambda ds: t.encode_batch_list(ds, parallel=True))
    out.append(peer("gigatoken", giga))

    def fast():
        import fastokens
        t = fastokens.Tokenizer.from_tiktoken(plain, pattern=pat, special_tokens={})
        return Engine("fastokens 0.3.5", lambda s: t.encode(s).ids,
                      lambda ds: [e.ids for e in t.encode_batch(ds)])
    out.append(peer("fastokens", fast))

    if case in ("o200k", "cl100k"):
        def quick():
            import quicktok
            t = quicktok.get_encoding(f"{case}_base")

            def batch(ds):
                toks, offs = t.encode_batch(ds, THREADS, False)
                return [toks[offs[i]:offs[i + 1]] for i in range(len(ds))]
            return Engine("quicktok-v1 0.4.0", t.encode_ordinary, batch)
        out.append(peer("quicktok-v1", quick))
    else:
        print("  skipped quicktok-v1: no Kimi K2 encoding")

    def baseten():
        import basetenkenizer
        import tiktoken
        enc = tiktoken.Encoding(case, pat_str=pat, mergeable_ranks=ranks, special_tokens={})
        t = basetenkenizer.Tokenizer.from_json_str(basetenkenizer.tiktoken_to_tokenizer_json(enc))
        return Engine("basetenkenizer 0.2.8", lambda s: t.encode(s).ids,
                      lambda ds: [e.ids for e in t.encode_batch(ds)])
    out.append(peer("basetenkenizer", baseten))

    def tue():
        import tuetoken
        from tuetoken import _tiktoken
        # tuetoken's own conversion of ranks and a pattern to a tokenizer.json (what its
        # get_tiktoken_model_path does for a tiktoken.model, without its cache in $HOME)
        tj = os.path.join(os.path.dirname(plain), f"tuetoken_{case}.json")
        with open(tj, "w") as f:
            json.dump(_tiktoken.build_tiktoken_model_json(ranks, pat), f)
        t = tuetoken.Tokenizer(tj)
        return Engine(f"tuetoken {tuetoken.__version__}", t.encode_ordinary,
                      lambda ds: t.encode_ordinary_batch(ds, num_threads=THREADS))
    out.append(peer("tuetoken", tue))
    return [e for e in out if e]


def qwen2_engines(qdir, tmp):
    import libdflash
    import oracle_hf as oh
    ref = oh.build(qdir, oh.QWEN2)
    tj = os.path.join(tmp, "tokenizer.json")
    with open(tj, "w") as f:
        f.write(ref.to_str())
    out = [Engine("HF tokenizers", lambda s: ref.encode(s, add_special_tokens=False).ids,
                  lambda ds: [e.ids for e in ref.encode_batch(ds, add_special_tokens=False)])]

    def ours():
        t = libdflash.Tokenizer(qdir)
        return Engine("libdflash", t.encode, lambda ds: t.encode_batch(ds, n_threads=THREADS))
    out.append(peer("libdflash", ours))

    def giga():
        import gigatoken
        with open(tj) as f:
            t = gigatoken.Tokenizer.from_json(f.read())
        return Engine("gigatoken 0.10.0", t.encode, lambda ds: t.encode_batch_list(ds, parallel=True))
    out.append(peer("gigatoken", giga))

    def fast():
        import fastokens
        t = fastokens.Tokenizer.from_file(tj)
        return Engine("fastokens 0.3.5", lambda s: t.encode(s).ids,
                      lambda ds: [e.ids for e in t.encode_batch(ds)])
    out.append(peer("fastokens", fast))

    def quick():
        import quicktok
        t = quicktok.get_encoding("qwen3")

        def batch(ds):
            toks, offs = t.encode_batch(ds, THREADS, True)
            return [toks[offs[i]:offs[i + 1]] for i in range(len(ds))]
        return Engine("quicktok-v1 0.4.0 (qwen3)", lambda s: t.encode(s, allowed_special="all"),
                      batch)
    out.append(peer("quicktok-v1", quick))

    def baseten():
        import basetenkenizer
        t = basetenkenizer.Tokenizer.from_file(tj)
        return Engine("basetenkenizer 0.2.8", lambda s: t.encode(s).ids,
                      lambda ds: [e.ids for e in t.encode_batch(ds)])
    out.append(peer("basetenkenizer", baseten))

    def tue():
        import tuetoken
        t = tuetoken.Tokenizer(tj)
        return Engine(f"tuetoken {tuetoken.__version__}", t.encode_ordinary,
                      lambda ds: t.encode_ordinary_batch(ds, num_threads=THREADS))
    out.append(peer("tuetoken", tue))
    return [e for e in out if e]


# ---- measurement -----------------------------------------------------------------------------

def timed(fn, docs, per_doc):
    """(bytes, CPU s, wall s, ids) of one round."""
    w0, c0 = time.perf_counter(), time.process_time()
    got = [fn(d) for d in docs] if per_doc else fn(docs)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return sum(len(d.encode()) for d in docs), cpu, wall, got


def mismatches(got, ref):
    return sum(as_list(a) != as_list(b) for ga, ra in zip(got, ref) for a, b in zip(ga, ra))


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def fresh(docs):
    """Copies of the texts that no engine has touched, made outside the timing. A Rust engine
    (PyO3: tiktoken, HF tokenizers, gigatoken) reads a str through PyUnicode_AsUTF8AndSize,
    which keeps the UTF-8 inside the str object, so the next engine given the same object
    gets the conversion free: gigatoken on the mix, warm, went 145 -> 197 MB/CPU-s on strings
    tiktoken had encoded before (o200k, 2026-12-07). A user encodes a string once."""
    return [(d + "\0")[:-1] if isinstance(d, str) else d for d in docs]


def interleaved(engines, rounds, pick, per_doc, warm):
    """Per engine, one (bytes, CPU s, wall s, ids) per round, the engines taking turns in
    each round (the first one rotating), so that a slow minute of a shared machine lands on
    every engine's same round instead of on one engine."""
    live = []
    for e in engines:
        fn = pick(e)
        if not fn:
            continue
        try:
            timed(fn, warm, per_doc)  # first-call costs (tables, pools) are not throughput
            live.append(e)
        except Exception as ex:  # noqa: BLE001
            print(f"  {e.name:<30} failed: {type(ex).__name__}: {str(ex)[:160]}")
    out = {e.name: [] for e in live}
    for r, docs in enumerate(rounds):
        for k in range(len(live)):
            e = live[(r + k) % len(live)]
            if not per_doc:
                time.sleep(0.2)  # the previous engine's pool threads spin a while after a batch
            try:
                out[e.name].append(timed(pick(e), fresh(docs), per_doc))
            except Exception as ex:  # noqa: BLE001
                print(f"  {e.name:<30} failed in round {r}: {type(ex).__name__}: {str(ex)[:160]}")
                out[e.name] = None
                live = [x for x in live if x is not e] or live
    return {k: v for k, v in out.items() if v}


def bench_case(label, engines, one_rounds, two_rounds, warm):
    """One thread (MB per CPU-second, the median round and the range) for every engine first,
    then the batch calls: an engine's batch pool (gigatoken's and HF's rayon threads) must not
    exist yet while another engine's single-thread CPU time is counted, since process CPU time
    includes every thread of the process."""
    print(f"{label}: {len(one_rounds)} rounds x {len(one_rounds[0])} documents per thread count, "
          f"each round unseen text, engines interleaved", flush=True)
    one = interleaved(engines, one_rounds, lambda e: e.one, True, warm)
    two = interleaved(engines, two_rounds, lambda e: e.batch, False, warm)
    ref1 = next(iter(one.values()))
    ref2 = next(iter(two.values()), None)
    res = {}
    for e in engines:
        r1, r2 = one.get(e.name), two.get(e.name)
        if not r1:
            continue
        bad = mismatches([x[3] for x in r1], [x[3] for x in ref1])
        if r2 and ref2:
            bad += mismatches([x[3] for x in r2], [x[3] for x in ref2])
        rates = [b / c / 1e6 for b, c, _, _ in r1]
        med = median(rates)
        line = (f"  {e.name:<30} 1 thread {med:8.2f} MB/CPU-s ({min(rates):.1f}-{max(rates):.1f})")
        wall2 = None
        if r2:
            b2, c2, w2 = (sum(x[i] for x in r2) for i in range(3))
            wall2 = b2 / w2 / 1e6
            line += f"  {THREADS} threads {wall2:8.2f} MB/s wall (cpu/wall {c2 / w2:.2f})"
        line += f"  mismatches {bad}" + ("" if not bad else "  NOT EXACT")
        print(line, flush=True)
        res[e.name] = (med, wall2, bad, rates)
    ours = res.get("libdflash")
    if not ours:
        return 1
    peers = {k: v for k, v in res.items() if k != "libdflash" and not v[2]}
    for k, (med, wall2, _, rates) in sorted(peers.items(), key=lambda kv: -kv[1][0]):
        paired = [a / b for a, b in zip(ours[3], rates)]  # the same round's text
        two_ratio = f", {THREADS} threads {ours[1] / wall2:.2f}x" if wall2 and ours[1] else ""
        print(f"  RATIO {label}: libdflash / {k}: 1 thread {ours[0] / med:.2f}x "
              f"(per round {min(paired):.2f}-{max(paired):.2f}){two_ratio}")
    if peers:
        best = max(peers.items(), key=lambda kv: kv[1][0])
        print(f"  RATIO {label}: libdflash / fastest exact peer ({best[0]}): "
              f"{ours[0] / best[1][0]:.2f}x on 1 thread")
    if ours[1]:
        print(f"  SCALING {label}: libdflash {THREADS} threads (MB/s wall) / 1 thread (MB/CPU-s): "
              f"{ours[1] / ours[0]:.2f}x")
    return 1 if ours[2] else 0


def by_category(label, engines, rounds, mb, warm):
    """One thread, per corpus category: where libdflash leads or trails the exact peers."""
    import corpus
    print(f"{label}: one thread by category, MB/CPU-s (median of {rounds} rounds of {mb} MB)")
    for k, gen in enumerate(corpus.GENERATORS):
        sets = [corpus.documents(mb, seed=7000 + 100 * k + r, only=gen) for r in range(rounds)]
        res = interleaved(engines, sets, lambda e: e.one, True, warm)
        ref = next(iter(res.values()))
        rate = {n: median([b / c / 1e6 for b, c, _, _ in v]) for n, v in res.items()
                if not mismatches([x[3] for x in v], [x[3] for x in ref])}
        peers = {n: r for n, r in rate.items() if n != "libdflash"}
        best = max(peers.items(), key=lambda kv: kv[1]) if peers else None
        ours = rate.get("libdflash")
        cells = "  ".join(f"{n.split()[0]} {r:.1f}" for n, r in sorted(rate.items(), key=lambda kv: -kv[1]))
        ratio = f"  RATIO {ours / best[1]:.2f}x {best[0].split()[0]}" if best and ours else ""
        print(f"  {gen.__name__.lstrip('_'):<18} {cells}{ratio}", flush=True)
    return 0


def thread_stats():
    """(pieces, cache misses, cache bytes) of this thread in libdflash, or None when the
    library has no dflash_tokenizer_thread_stats (experimental.h)."""
    import ctypes
    from libdflash import _lib
    f = getattr(_lib.lib, "dflash_tokenizer_thread_stats", None)
    if f is None:
        return None
    p, m, b = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_size_t()
    f(ctypes.byref(p), ctypes.byref(m), ctypes.byref(b))
    return p.value, m.value, b.value


def real_text(label, engines, corp, rounds, mb, warm):
    """One thread on the real-text corpus (bench/real_corpus.py): per category and the
    reasoning mix, each engine's median MB/CPU-s over `rounds` rounds of unseen text, the
    ratio of libdflash to the fastest exact peer (the same rounds), and the share of
    libdflash's pieces its piece cache answered."""
    import real_corpus
    for e in engines:  # first-call costs once, not in any category's counters
        try:
            for d in warm:
                e.one(d)
        except Exception as ex:  # noqa: BLE001
            print(f"  {e.name:<30} failed: {type(ex).__name__}: {str(ex)[:160]}")
    load = os.getloadavg()
    print(f"{label}: one thread, MB/CPU-s, median of {rounds} rounds of {mb} MB per category "
          f"(load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})", flush=True)
    mix = f"mix {'/'.join(f'{int(s * 100)}' for _, s in real_corpus.MIX)} " + \
        "/".join(n for n, _ in real_corpus.MIX)
    cats = [(n, corp.rounds(n, mb, rounds)) for n in corp.names()]
    cats.append((mix, corp.mix_rounds(mb, rounds, skip_rounds=rounds)))
    bad, rows = 0, []
    for name, sets in cats:
        s0 = thread_stats()
        res = interleaved(engines, sets, lambda e: e.one, True, [])
        s1 = thread_stats()
        ref = next(iter(res.values()))
        rate, wrong = {}, []
        for n, v in res.items():
            if mismatches([x[3] for x in v], [x[3] for x in ref]):
                wrong.append(n)
            else:
                rate[n] = [b / c / 1e6 for b, c, _, _ in v]
        if "libdflash" in wrong:
            bad += 1
        med = {n: median(r) for n, r in rate.items()}
        peers = {n: r for n, r in med.items() if n != "libdflash"}
        ours = med.get("libdflash")
        cells = "  ".join(f"{n.split()[0]} {r:.1f}" for n, r in
                          sorted(med.items(), key=lambda kv: -kv[1]))
        line = f"  {name:<28} {sum(len(d.encode()) for d in sets[0]) / 1e6:5.2f} MB  {cells}"
        if peers and ours:
            best = max(peers.items(), key=lambda kv: kv[1])
            paired = [a / b for a, b in zip(rate["libdflash"], rate[best[0]])]
            line += (f"  RATIO {ours / best[1]:.2f}x {best[0].split()[0]} "
                     f"(per round {min(paired):.2f}-{max(paired):.2f})")
            for n, r in sorted(peers.items()):
                if n != best[0]:
                    line += f", {ours / r:.2f}x {n.split()[0]}"
        if s0 and s1 and s1[0] > s0[0]:
            pieces, missed = s1[0] - s0[0], s1[1] - s0[1]
            line += f"  hit {100 * (1 - missed / pieces):.1f}% of {pieces} pieces"
        if wrong:
            line += "  NOT EXACT: " + ", ".join(wrong)
        print(line, flush=True)
        rows.append(line)
    st = thread_stats()
    if st:
        print("  libdflash memory per encoding thread: piece caches and pair cache "
              f"{st[2] / 2**20:.2f} MiB (fixed); scratch grows with the longest text of a "
              "call and is cut back to <= 4 MiB a buffer after it")
    load = os.getloadavg()
    print(f"  (load after: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})", flush=True)
    return bad


def keep(engines, names):
    """The engines whose name starts with one of names (and always the first: the reference,
    and libdflash)."""
    if not names:
        return engines
    return [e for k, e in enumerate(engines)
            if k == 0 or e.name == "libdflash" or any(e.name.startswith(n) for n in names)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--setup", action="store_true", help="create .venv-tok with the peers")
    ap.add_argument("--mb", type=float, default=2.0, help="megabytes of text per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fixtures", default=os.environ.get("DFLASH_FIXTURES",
                                                         os.path.join(ROOT, "..", "shared", "fixtures")))
    ap.add_argument("--only", default="", help="comma list: o200k,kimi,qwen2,cl100k")
    ap.add_argument("--by-category", action="store_true",
                    help="one thread, per corpus category (English, CJK, code, ...) instead")
    ap.add_argument("--real", action="store_true",
                    help="one thread on real text by category and the reasoning mix "
                         "(bench/real_corpus.py); --mb is per category and round")
    ap.add_argument("--completions", default=None,
                    help="--real: a completions.jsonl of dflash fetch (default: examples/pipeline's)")
    ap.add_argument("--engines", default="",
                    help="comma list of peer name prefixes to run (the reference always runs)")
    args = ap.parse_args()
    if args.setup:
        return setup()
    reexec_in_venv()
    only = set(filter(None, args.only.split(","))) or {"o200k", "kimi", "qwen2"}
    import corpus
    names = [n for n in args.engines.split(",") if n]
    corp = None
    if args.real:
        sys.path.insert(0, HERE)
        import real_corpus
        corp = real_corpus.Corpus(args.completions)
    rounds = 0 if args.by_category or args.real else args.rounds
    one_rounds = [corpus.documents(args.mb, seed=1000 + r) for r in range(rounds)]
    two_rounds = [corpus.documents(args.mb, seed=2000 + r) for r in range(rounds)]
    warm = corpus.documents(0.1, seed=3000)
    import oracle_tiktoken as ot
    openai = os.path.join(args.fixtures, "tokenizers", "openai")
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for case, pat in (("cl100k", ot.CL100K), ("o200k", ot.O200K), ("kimi", ot.KIMI)):
            if case not in only:
                continue
            base = "o200k" if case == "kimi" else case
            gz = os.path.join(openai, f"{base}_base.tiktoken.gz")
            ranks = ot.load_ranks(gz)
            plain = os.path.join(tmp, f"{base}_base.tiktoken")
            if not os.path.exists(plain):
                with gzip.open(gz) as src, open(plain, "wb") as dst:
                    dst.write(src.read())
            lib_path = ot.kimi_dir(tmp, gz, ranks)[0] if case == "kimi" else gz
            label = "kimi-k2 pattern (o200k ranks)" if case == "kimi" else case
            engines = keep(tiktoken_engines(case, pat, ranks, plain, lib_path), names)
            if args.real:
                bad += real_text(label, engines, corp, args.rounds, args.mb, warm)
                continue
            if args.by_category:
                by_category(label, engines, args.rounds, args.mb / 8, warm)
                continue
            bad += bench_case(label, engines, one_rounds, two_rounds, warm)
        qdir = os.path.join(args.fixtures, "tokenizers", "qwen2")
        if "qwen2" in only and os.path.isdir(qdir) and args.real:
            bad += real_text("qwen2", keep(qwen2_engines(qdir, tmp), names), corp, args.rounds,
                             args.mb, warm)
        elif "qwen2" in only and os.path.isdir(qdir) and args.by_category:
            by_category("qwen2", qwen2_engines(qdir, tmp), args.rounds, args.mb / 8, warm)
        elif "qwen2" in only and os.path.isdir(qdir):
            bad += bench_case("qwen2", qwen2_engines(qdir, tmp), one_rounds, two_rounds, warm)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
