"""Speculative decoding in llama.cpp itself: llama-server (b11434, built by
scripts/llama_server.sh) serves the target alone, then with each DFlash
drafter GGUF (--model-draft X.gguf --spec-type draft-dflash, a full block of
B-1 drafts per step), greedy, on every held-out sample's own prompt tokens:

    python llama_spec.py --llama-dir ~/.cache/libdflash/llama-b11434 \
        --target-gguf SmolLM2.gguf --data out/data/heldout --max-new 128 \
        --config plain= --config untrained=out/gguf/untrained.gguf \
        --config trained=out/gguf/drafter.gguf -o out/llama_spec.json

llama.cpp's own counters give each number: drafted and accepted tokens
(timings.draft_n, timings.draft_n_accepted of each response), verification
steps (/metrics spec_decode_num_drafts_total before and after each request),
tokens per verification step = 1 + accepted / steps (what the server logs as
"mean len"; bootstrap SE over prompts), tokens per target decode after the
prefill = (predicted_n - 1) / (predicted_n - 1 - accepted) (the walk's tau:
it also counts the last decode, where the token cap leaves nothing to draft),
decode tokens/s (timings.predicted_n / predicted_ms, drafting included), the
share of steps whose i-th draft was
accepted (spec_decode_num_accepted_tokens_per_pos_total), and whether each
output equals the plain run's tokens (greedy verification is lossless up to
floating-point differences between batch shapes).

A configuration whose NAME starts with "dspark" is a DSpark drafter's GGUF: it runs
with --spec-type draft-dspark and a draft at every slot of its anchor-first block
(--spec-draft-n-max = --block-size).

The configurations run one after another, each on --servers servers (default
1; the samples dealt out in turn, one request at a time each) of one slot and
--threads (default 1), so that their speeds compare; llama.cpp's counters
are per server and add up. Two servers of one thread keep two cores busy
where one server of two threads would not (a batch of one token or one
block is too small to split well).
"""
import argparse
import concurrent.futures
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stats  # noqa: E402

VERSION = 11434
DEFAULT_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                           "libdflash", f"llama-b{VERSION}")


def llama_dir(arg=None):
    """The folder scripts/llama_server.sh built (bin/llama-server, src/), or None."""
    d = arg or os.environ.get("DFLASH_LLAMA_DIR") or DEFAULT_DIR
    return d if os.access(os.path.join(d, "bin", "llama-server"), os.X_OK) else None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(ldir, gguf, port, threads=1, parallel=1, ctx=2048, draft=None, n_draft=None,
               spec_type="draft-dflash"):
    """llama-server on loopback: `parallel` slots (one per concurrent stream)
    sharing ctx * parallel tokens of KV cache, /metrics on, no web UI."""
    cmd = [os.path.join(ldir, "bin", "llama-server"), "-m", gguf, "--host", "127.0.0.1",
           "--port", port, "-c", ctx * parallel, "-np", parallel, "-t", threads, "-tb", threads,
           "-a", "smollm2", "--metrics", "--no-webui"]
    if draft:
        cmd += ["--model-draft", draft, "--spec-type", spec_type, "--spec-draft-n-max", n_draft,
                "-td", threads, "-tbd", threads]
    return [str(c) for c in cmd]


def start(cmd, log_path):
    print("$ " + " ".join(shlex.quote(c) for c in cmd) + " &", flush=True)
    logf = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)


def wait_ready(base, proc, timeout=300):
    """base: http://host:port. Waits for /health (503 while loading)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"llama-server at {base} not ready after {timeout}s")


def stop(proc):
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def metrics(base):
    """/metrics as {name: value} (llamacpp: prefix dropped, labels kept)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        out = {}
        for ln in r.read().decode().splitlines():
            if ln and not ln.startswith("#"):
                k, v = ln.rsplit(" ", 1)
                out[k.replace("llamacpp:", "")] = float(v)
        return out


def complete(base, ids, max_new):
    body = json.dumps({"prompt": [int(x) for x in ids], "n_predict": max_new, "temperature": 0.0,
                       "repeat_penalty": 1.0, "cache_prompt": False, "return_tokens": True,
                       "stream": False}).encode()
    req = urllib.request.Request(base + "/completion", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def prompts(data_dir, n=0):
    """(id, prompt ids, answer ids) of each sample: the prompt is everything
    before the first supervised token, as the walk and live_check use it."""
    import libdflash
    out = []
    with libdflash.Dataset(data_dir) as ds:
        for i in range(len(ds) if n <= 0 else min(n, len(ds))):
            sid, ids, mask = ds[i]
            ids, mask = np.asarray(ids), np.asarray(mask, dtype=bool)
            s = int(np.argmax(mask))
            e = s
            while e < len(mask) and mask[e]:
                e += 1
            out.append((sid, ids[:s].tolist(), ids[s:e].tolist()))
    return out


def run_config(ldir, gguf, draft, samples, max_new, n_draft, threads, log_path, servers=1,
               spec_type="draft-dflash"):
    """Every sample through `servers` servers (sample k on server k % servers); the rows
    in sample order and llama.cpp's per-position acceptance counters summed."""
    if servers <= 1:
        return run_server(ldir, gguf, draft, list(enumerate(samples)), max_new, n_draft, threads,
                          log_path, spec_type=spec_type)
    root, ext = os.path.splitext(log_path)
    with concurrent.futures.ThreadPoolExecutor(servers) as ex:
        parts = list(ex.map(lambda i: run_server(
            ldir, gguf, draft, [(k, s) for k, s in enumerate(samples) if k % servers == i],
            max_new, n_draft, threads, f"{root}-{i}{ext}", len(samples), spec_type),
            range(servers)))
    rows = sorted((r for part, _ in parts for r in part), key=lambda r: r.pop("_k"))
    per_pos = [sum(v) for v in zip(*(pp for _, pp in parts))] if parts[0][1] else []
    return rows, per_pos


def run_server(ldir, gguf, draft, samples, max_new, n_draft, threads, log_path, total=None,
               spec_type="draft-dflash"):
    """samples: (k, sample) pairs, through one server; rows keep k as "_k" when total is set."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start(server_cmd(ldir, gguf, port, threads, draft=draft, n_draft=n_draft,
                            spec_type=spec_type), log_path)
    rows = []
    try:
        wait_ready(base, proc)
        m0 = metrics(base)
        for k, (sid, prompt, _) in samples:
            r = complete(base, prompt, max_new)
            m1 = metrics(base)
            t = r["timings"]
            rows.append({"id": sid, "tokens": r.get("tokens", []), "stop": r.get("stop_type"),
                         "predicted_n": t["predicted_n"], "predicted_ms": t["predicted_ms"],
                         "prompt_n": t["prompt_n"], "prompt_ms": t["prompt_ms"],
                         "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0),
                         "steps": int(m1.get("spec_decode_num_drafts_total", 0) -
                                      m0.get("spec_decode_num_drafts_total", 0))})
            if total is not None:
                rows[-1]["_k"] = k
            m0 = m1
            print(f"\r  {len(rows)}/{len(samples)}" + (f" of {total}" if total else ""),
                  end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        per_pos = [v for k, v in sorted(
            ((k, v) for k, v in m0.items() if k.startswith("spec_decode_num_accepted_tokens_per_pos")),
            key=lambda kv: int(kv[0].split('"')[1]))]
    finally:
        stop(proc)
    return rows, per_pos


def summarize(rows, per_pos, plain=None):
    col = lambda k: np.array([r[k] for r in rows], dtype=float)  # noqa: E731
    n_tok, ms = col("predicted_n"), col("predicted_ms")
    res = {"prompts": len(rows), "tokens": int(n_tok.sum()),
           "decode_tok_s": round(float(n_tok.sum() / ms.sum() * 1000), 2),
           "decode_s": round(float(ms.sum() / 1000), 1),
           "prompt_tok_s": round(float(col("prompt_n").sum() / col("prompt_ms").sum() * 1000), 1)}
    steps, acc, drafted = col("steps"), col("accepted"), col("drafted")
    if drafted.sum() > 0:
        (tau, tpd), (tau_se, tpd_se), _ = stats.bootstrap([(acc + steps, steps),
                                                           (n_tok - 1, n_tok - 1 - acc)])
        res.update({"drafted": int(drafted.sum()), "accepted": int(acc.sum()),
                    "steps": int(steps.sum()), "decodes": int((n_tok - 1 - acc).sum()),
                    "acceptance": round(float(acc.sum() / drafted.sum()), 4),
                    "tokens_per_step": round(tau, 4), "tokens_per_step_se": round(tau_se, 4),
                    "tokens_per_decode": round(tpd, 4), "tokens_per_decode_se": round(tpd_se, 4),
                    "drafts_per_step": round(float(drafted.sum() / max(steps.sum(), 1)), 3),
                    "accepted_at_position": [round(v / max(steps.sum(), 1), 4) for v in per_pos]})
    if plain is not None:
        ref = {str(r["id"]): r["tokens"] for r in plain}
        res["same_as_plain"] = sum(r["tokens"] == ref.get(str(r["id"])) for r in rows)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-dir", default=None, help=f"scripts/llama_server.sh's folder ({DEFAULT_DIR})")
    ap.add_argument("--target-gguf", required=True)
    ap.add_argument("--data", required=True, help="tokenized held-out dataset")
    ap.add_argument("--config", action="append", required=True,
                    help="NAME=DRAFT.gguf, or NAME= for the target alone (the first such is the plain run)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=8, help="drafts per step: block size - 1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--servers", type=int, default=1,
                    help="servers per configuration, the samples dealt out among them")
    ap.add_argument("--n", type=int, default=0, help="samples (0: all)")
    ap.add_argument("--plain-ref", default=None,
                    help="an earlier run's -o JSON whose plain run the outputs are compared with "
                         "(its NAME-plain-tokens.json beside it), when this run has none")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    ldir = llama_dir(a.llama_dir)
    if not ldir:
        raise SystemExit("llama-server not found: run scripts/llama_server.sh (or pass --llama-dir)")
    samples = prompts(a.data, a.n)
    version = subprocess.run([os.path.join(ldir, "bin", "llama-server"), "--version"],
                             capture_output=True, text=True)
    res = {"llama_dir": ldir, "version": (version.stdout + version.stderr).strip().splitlines()[-2:],
           "samples": len(samples), "max_new": a.max_new, "threads": a.threads,
           "servers": a.servers,
           "n_draft": a.block_size - 1, "configs": {}}
    per_prompt, plain = {}, None
    if a.plain_ref:  # pipeline.py runs the plain config beside the training, the rest after it
        with open(os.path.splitext(a.plain_ref)[0] + "-plain-tokens.json") as f:
            plain = [{"id": k, "tokens": v} for k, v in json.load(f).items()]
    for spec in a.config:
        name, _, draft = spec.partition("=")
        print(f"llama.cpp {name}: " + (f"--model-draft {draft}" if draft else "target alone"), flush=True)
        log = os.path.splitext(a.out)[0] + f"-{name}.log"
        # A configuration named dspark* is a DSpark drafter: --spec-type draft-dspark and a
        # draft at every slot of its anchor-first block (llama.cpp clamps --spec-draft-n-max
        # to the GGUF's block size).
        dspark = name.startswith("dspark")
        rows, per_pos = run_config(ldir, a.target_gguf, draft or None, samples, a.max_new,
                                   a.block_size - (0 if dspark else 1), a.threads, log, a.servers,
                                   "draft-dspark" if dspark else "draft-dflash")
        s = summarize(rows, per_pos, plain)
        if not draft and plain is None:
            plain = rows
            with open(os.path.splitext(a.out)[0] + "-plain-tokens.json", "w") as f:
                json.dump({r["id"]: r["tokens"] for r in rows}, f)
        res["configs"][name] = dict(s, draft=draft or None,
                                    spec_type=("draft-dspark" if dspark else "draft-dflash")
                                    if draft else None)
        per_prompt[name] = rows
        print(f"  {name}: {s['tokens']} tokens at {s['decode_tok_s']} tok/s" +
              (f"; accepted {s['accepted']}/{s['drafted']} = {s['acceptance']:.4f}, "
               f"{s['tokens_per_step']:.4f} +- {s['tokens_per_step_se']:.4f} tokens per "
               f"verification step ({s['steps']} steps), {s['tokens_per_decode']:.4f} per target "
               f"decode ({s['decodes']})" if "drafted" in s else "") +
              (f"; same tokens as plain {s['same_as_plain']}/{s['prompts']}" if "same_as_plain" in s else ""),
              flush=True)
    res["per_prompt"] = {k: [{kk: v for kk, v in r.items() if kk != "tokens"} for r in rows]
                         for k, rows in per_prompt.items()}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
