#!/usr/bin/env python3
"""`dflash tokenize` end to end: the output is the same bytes for any thread
count and batch size, every line is accounted for (sample or rejection with its
file and line), samples are named by the records' ids (or fetch's documented
hash id, recomputed here with hashlib), a repeated id is rejected, the
manifest's tokenizer_hash is the tokenizer's identity (the same with another
model_max_length or chat template; not the hash of its files' bytes that
manifests held before), and the command fails
(exit 1) on a missing input, no samples, or too many rejects.
Needs DFLASH_CLI and the qwen2 tokenizer fixture (exit 77 without)."""
import filecmp
import glob
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

# The chat tests' references (jinja2 as Hugging Face configures it, the corpus generator).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "chat"))
import gen_conversations  # noqa: E402
import hf_jinja  # noqa: E402

CLI = os.environ.get("DFLASH_CLI")
TOK = hf_jinja.fixtures_dir() / "tokenizers" / "qwen2"
HASHED = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
          "added_tokens.json", "special_tokens_map.json", "tiktoken.model"]


def expected_hash(d):
    h = hashlib.sha256()
    for name in HASHED:
        p = d / name
        if p.is_file():
            data = p.read_bytes()
            h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return "sha256:" + h.hexdigest()


def check_tokenizer_hash(d, recorded, inputs):
    """The manifest's tokenizer_hash is what decides the ids, not the files' bytes: a copy of
    the tokenizer with another model_max_length and chat template records the same hash."""
    assert recorded.startswith("sha256:") and len(recorded) == 71, recorded
    assert recorded != expected_hash(TOK), "the files' bytes, not the tokenizer's identity"
    edited = d / "tok-edited"
    edited.mkdir()
    for name in HASHED:
        if (TOK / name).is_file():
            (edited / name).write_bytes((TOK / name).read_bytes())
    config = json.loads((edited / "tokenizer_config.json").read_text())
    config["model_max_length"] = 1024
    config["chat_template"] = "{{ messages }}"
    (edited / "tokenizer_config.json").write_text(json.dumps(config))
    out = d / "edited-config"
    r = subprocess.run([CLI, "tokenize", "--tokenizer", str(edited), "--template", "qwen3",
                        "--allow-split-control-tokens", "--max-reject-ratio", "1", "-o",
                        str(out), str(inputs[0])], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "dataset.json").read_text())["tokenizer_hash"] == recorded
    print("tokenizer_hash: the same with another model_max_length and chat template")


def jansson_compact(v):
    """json_dumps(v, JSON_COMPACT | JSON_SORT_KEYS) as jansson 2.14 writes it: reals as %.17g
    (".0" added to integral ones, exponent without "+" or leading zeros), control-character
    escapes in upper case, UTF-8 unescaped."""
    if isinstance(v, dict):
        return "{" + ",".join(jansson_compact(k) + ":" + jansson_compact(v[k])
                              for k in sorted(v)) + "}"
    if isinstance(v, list):
        return "[" + ",".join(map(jansson_compact, v)) + "]"
    if isinstance(v, float):
        r = "%.17g" % v
        if not any(c in r for c in ".e"):
            r += ".0"
        return re.sub(r"e([-+]?)0*(\d)", lambda m: "e" + m.group(1).replace("+", "") + m.group(2), r)
    if isinstance(v, str):
        short = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n",
                 "\r": "\\r", "\t": "\\t"}
        return '"' + "".join(short.get(c) or ("\\u%04X" % ord(c) if c < " " else c)
                             for c in v) + '"'
    return json.dumps(v)  # null, true, false, integers


def hash_id(obj):
    """fetch.h's derived id: "h" + 32 hex digits of SHA-256 of the key-sorted compact
    OpenAI messages (ShareGPT turns mapped to roles)."""
    text = jansson_compact(obj["messages"])
    return "h" + hashlib.sha256(text.encode()).hexdigest()[:32]


def expected_ids(paths):
    """(file, line) -> the id each accepted record must get."""
    ids = {}
    for p in paths:
        for ln, line in enumerate(p.read_text(encoding="utf-8").split("\n"), 1):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
                ids[str(p), ln] = str(obj["id"]) if "id" in obj else hash_id(obj)
    return ids


def sample_ids(out):
    from safetensors import safe_open
    ids = []
    for shard in sorted(glob.glob(str(out / "*.safetensors"))):
        with safe_open(shard, "np") as f:
            ids += json.loads(f.metadata()["sample_ids"])
    return ids


def write_inputs(d):
    """Two files: generated conversations, interleaved with bad and blank lines."""
    bad = ["{not json", "[]", json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
           json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
           json.dumps({"messages": [{"role": "user", "content": 3}]}), "", "\"\\ud800\"",
           json.dumps({"messages": [{"role": "user", "content": "e\u0301"},
                                    {"role": "assistant", "content": "A\u030a \u1100\u1161"}]})]
    lines = [json.dumps({"id": "twice", "messages": [{"role": "user", "content": "a"},
                                                     {"role": "assistant", "content": "b"}]})]
    for i, (msgs, tools) in enumerate(gen_conversations.corpus(900, seed=31)):
        obj = {"messages": msgs, "tools": tools} if tools else {"messages": msgs}
        if i % 7 == 0:  # fetcher record: the last assistant turn as "completion"
            if msgs and msgs[-1]["role"] == "assistant":
                obj = dict(obj, messages=msgs[:-1], completion=msgs[-1])
        if i % 3 == 0:  # explicit ids, strings and integers
            obj = dict(obj, id=f"rec-{i}" if i % 2 else i)
        lines.append(json.dumps(obj, ensure_ascii=False))
        if i % 50 == 0:
            lines.append(bad[(i // 50) % len(bad)])
        if i == 450:  # the same id again, other content: rejected as a duplicate
            lines.append(json.dumps({"id": "twice", "messages": [
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}))
    paths = [d / "a.jsonl", d / "b.jsonl"]
    half = len(lines) // 2
    paths[0].write_text("\n".join(lines[:half]) + "\n", encoding="utf-8")
    paths[1].write_text("\n".join(lines[half:]) + "\n", encoding="utf-8")
    return paths, len(lines) - sum(1 for x in lines if not x)


def run_tokenize(out, inputs, *extra, template="qwen3",
                 split=("--allow-split-control-tokens",)):
    """The qwen2 fixture stands in for Qwen3's tokenizer, which has <think> and the tool tags as
    added tokens; qwen2 splits them, hence --allow-split-control-tokens."""
    return subprocess.run([CLI, "tokenize", "--tokenizer", str(TOK), "--template", template,
                           "-o", str(out), *split, *extra, *map(str, inputs)],
                          capture_output=True, text=True)


def tokenize(out, inputs, *extra):
    """The corpus is a stress test (about 8 % of its lines are bad on purpose)."""
    r = run_tokenize(out, inputs, "--max-reject-ratio", "0.5", *extra)
    assert r.returncode == 0, r.stderr
    return r.stderr


def check_failures(d, inputs):
    """Exit 1 with a message, never a quiet 0: missing input, no samples, too many rejects."""
    r = run_tokenize(d / "missing", [inputs[0], d / "nope.jsonl"])
    assert r.returncode == 1 and "cannot read input" in r.stderr and "nope.jsonl" in r.stderr
    assert not (d / "missing").exists(), "a missing input must fail before any output"
    junk = d / "junk.jsonl"
    junk.write_text("{not json\n[]\n", encoding="utf-8")
    r = run_tokenize(d / "junk", [junk], "--max-reject-ratio", "1")
    assert r.returncode == 1 and "no sample written" in r.stderr, r.stderr
    r = run_tokenize(d / "ratio", inputs)  # default --max-reject-ratio 0.05
    assert r.returncode == 1 and "--max-reject-ratio 0.05" in r.stderr, r.stderr
    # Refused: no dataset is left (only the reasons), so the retry needs no --overwrite.
    assert sorted(p.name for p in (d / "ratio").iterdir()) == ["rejected.jsonl"], r.stderr
    r = run_tokenize(d / "ratio", inputs, "--max-reject-ratio", "0.5")
    assert r.returncode == 0, r.stderr
    assert json.loads((d / "ratio" / "dataset.json").read_text())["samples"] > 500
    r = run_tokenize(d / "ratio", inputs, "--max-reject-ratio", "0.5")
    assert r.returncode == 1 and "already holds a dataset" in r.stderr, r.stderr
    assert "--overwrite" in r.stderr, r.stderr
    # Another family's tokenizer: refused before any output, naming what it splits.
    r = run_tokenize(d / "split", inputs, split=())
    assert r.returncode == 1 and not (d / "split").exists(), r.stderr
    for tag in ("<think> (3 ids)", "</think>", "<tool_call>", "<tool_response>"):
        assert tag in r.stderr, (tag, r.stderr)
    assert "<|im_start|>" not in r.stderr  # qwen2 has the ChatML markers as specials
    r = run_tokenize(d / "chatml", inputs, "--max-reject-ratio", "1", template="chatml",
                     split=())
    assert r.returncode == 0, r.stderr
    print("failures: missing input, no samples, reject ratio above 0.05, split control "
          "tokens -> exit 1")


def fetch_record(rid, reasoning, content, finish, outcome):
    """A fetch completion record as fetch writes it (fetch.c, df_fetch_record_completion)."""
    return {"id": rid, "messages": [{"role": "user", "content": "Count to twenty, slowly."}],
            "completion": {"role": "assistant", "reasoning_content": reasoning,
                           "content": content},
            "finish_reason": finish, "outcome": outcome}


def render_mask(record):
    r = subprocess.run([CLI, "render", "--template", "qwen3", "--tokenizer", str(TOK), "--mask"],
                       input=json.dumps(record), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    return out["ids"], out["loss_mask"]


def check_unfinished(d):
    """An answer the target never finished (finish_reason length, or empty) is not trained as
    finished: dropped by default, or kept with no closing token (</think>, <|im_end|>)
    supervised; render --mask shows the same mask."""
    thought = "one, two, three, four, five, six, seven, eight, nine, ten, eleven"
    records = [fetch_record("ok", thought, "Twenty.", "stop", "ok"),
               fetch_record("cut-thinking", thought, "", "length", "length"),
               fetch_record("cut-answer", thought, "One, two, three", "length", "length"),
               fetch_record("empty", thought, " ", "stop", "empty")]
    src = d / "unfinished.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    r = run_tokenize(d / "unf-drop", [src], "--max-reject-ratio", "0")
    assert r.returncode == 0, r.stderr
    assert "3 rejected (0 too long, 3 unfinished dropped)" in r.stderr, r.stderr
    assert sample_ids(d / "unf-drop") == ["ok"]
    rejected = [json.loads(x) for x in (d / "unf-drop" / "rejected.jsonl").read_text().split("\n")
                if x]
    assert [x["line"] for x in rejected] == [2, 3, 4], rejected
    assert all("the target did not finish this answer" in x["reason"] for x in rejected)
    assert 'outcome "length"' in rejected[0]["reason"] and 'outcome "empty"' in rejected[2]["reason"]
    r = run_tokenize(d / "unf-keep", [src], "--max-reject-ratio", "0", "--keep-unfinished")
    assert r.returncode == 0, r.stderr
    assert "0 rejected (0 too long, 3 unfinished kept)" in r.stderr, r.stderr
    assert sample_ids(d / "unf-keep") == ["ok", "cut-thinking", "cut-answer", "empty"]
    opts = json.loads((d / "unf-keep" / "dataset.json").read_text())["options"]
    assert opts["unfinished"] == "keep", opts
    im_end = json.loads((TOK / "added_tokens.json").read_text())["<|im_end|>"]
    for cut in records[1:]:
        whole = dict(cut, finish_reason="stop", outcome="ok")
        ids, mask = render_mask(cut)
        ids_ok, mask_ok = render_mask(whole)
        assert ids == ids_ok  # the same text; only what is supervised differs
        last = max(i for i, m in enumerate(mask) if m)
        assert mask[:last + 1] == mask_ok[:last + 1], cut["id"]
        assert not any(mask[last + 1:]) and any(mask_ok[last + 1:]), cut["id"]
        end = len(ids) - 1 - ids[::-1].index(im_end)  # the completion's end of turn
        assert mask_ok[end] == 1 and mask[end] == 0, cut["id"]
        if not cut["completion"]["content"]:  # cut while thinking: </think> is the template's, not supervised
            assert sum(mask_ok) - sum(mask) > 1, (sum(mask_ok), sum(mask))
    # A dataset already there: refused, or replaced with --overwrite (other files kept).
    (d / "unf-drop" / "notes.txt").write_text("mine")
    r = run_tokenize(d / "unf-drop", [src], "--keep-unfinished")
    assert r.returncode == 1 and "already holds a dataset" in r.stderr, r.stderr
    r = run_tokenize(d / "unf-drop", [src], "--keep-unfinished", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert sample_ids(d / "unf-drop") == sample_ids(d / "unf-keep")
    assert (d / "unf-drop" / "rejected.jsonl").read_text() == ""
    assert (d / "unf-drop" / "notes.txt").read_text() == "mine"
    print("unfinished answers: 3 of 4 dropped by default, kept with --keep-unfinished with "
          "no closing token supervised (render --mask alike)")


def check_fetch_settings(d):
    """A fetch output's settings.json decides the rendering: fetched with thinking off means
    --no-thinking without saying so; a flag that contradicts it is refused, naming both."""
    def fetched(name, family, kwargs):
        out = d / name
        out.mkdir()
        (out / "completions.jsonl").write_text(
            json.dumps(fetch_record("a", None, "Twenty.", "stop", "ok")) + "\n", encoding="utf-8")
        (out / "settings.json").write_text(json.dumps(
            {"dflash_fetch_settings": 1, "settings": {"model": "m", "family": family,
                                                       "chat_template_kwargs": kwargs,
                                                       "extra": None}, "earlier": []}))
        return out / "completions.jsonl"
    off = fetched("fetch-off", "qwen", {"enable_thinking": False})
    r = run_tokenize(d / "off-out", [off])
    assert r.returncode == 0, r.stderr
    opts = json.loads((d / "off-out" / "dataset.json").read_text())["options"]
    assert opts.get("thinking") is False, opts
    r = run_tokenize(d / "off-told", [off], "--no-thinking")
    assert r.returncode == 0, r.stderr
    assert stored_masks(d / "off-out") == stored_masks(d / "off-told")
    on = fetched("fetch-on", "qwen", {"enable_thinking": True})
    r = run_tokenize(d / "x", [on], "--no-thinking")
    assert r.returncode == 1 and "--no-thinking" in r.stderr and "settings.json" in r.stderr, \
        r.stderr
    kimi = fetched("fetch-kimi", "kimi", {"thinking": True})
    r = run_tokenize(d / "x", [kimi])
    assert r.returncode == 1 and "--template" in r.stderr and '"kimi"' in r.stderr, r.stderr
    assert not (d / "x").exists()
    check_fetch_then_tokenize(d)
    print("fetch settings: thinking off taken from settings.json; contradicting flags refused")


def check_fetch_then_tokenize(d):
    """The settings.json that `dflash fetch` itself writes (here against the fetch tests'
    fake server) is the one tokenize reads: fetched with --no-thinking, tokenized without."""
    server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fetch",
                          "fake_server.py")
    proc = subprocess.Popen([sys.executable, server, "--lifetime", "120"],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(proc.stdout.readline())["ports"][0]
        prompts = d / "prompts.jsonl"
        prompts.write_text('{"id": "p", "messages": [{"role": "user", "content": "hi"}]}\n')
        r = subprocess.run([CLI, "fetch", "--server", f"http://127.0.0.1:{port}/v1", "--model",
                            "fake", "--family", "qwen", "--no-thinking", str(prompts), "-o",
                            str(d / "gen")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    finally:
        proc.kill()
        proc.wait()
    r = run_tokenize(d / "gen-out", [d / "gen" / "completions.jsonl"])
    assert r.returncode == 0, r.stderr
    opts = json.loads((d / "gen-out" / "dataset.json").read_text())["options"]
    assert opts.get("thinking") is False, opts


def stored_masks(out):
    """The loss masks a dataset stores, per sample, read with the safetensors package."""
    from safetensors import safe_open
    masks = []
    for shard in sorted(glob.glob(str(out / "*.safetensors"))):
        with safe_open(shard, "np") as f:
            meta = json.loads(f.metadata()["sample_ids"])
            mask, offsets = f.get_tensor("loss_mask"), f.get_tensor("offsets")
            masks += [mask[offsets[i]:offsets[i + 1]].tolist() for i in range(len(meta))]
    return masks


def check_no_thinking(d):
    """--no-thinking: an answer written with thinking off gets no supervised think block
    (the template's empty <think></think> is prompt), as render --no-thinking --mask shows."""
    rec = {"id": "plain", "messages": [{"role": "user", "content": "Say hello."}],
           "completion": {"role": "assistant", "content": "Hello there, friend."},
           "finish_reason": "stop", "outcome": "ok"}
    src = d / "plain.jsonl"
    src.write_text(json.dumps(rec) + "\n", encoding="utf-8")
    runs = {}
    for name, extra in (("think", ()), ("nothink", ("--no-thinking",))):
        r = run_tokenize(d / name, [src], *extra)
        assert r.returncode == 0, r.stderr
        runs[name] = float(re.search(r"supervised ([0-9.]+)%", r.stderr).group(1))
        r = subprocess.run([CLI, "render", "--template", "qwen3", "--tokenizer", str(TOK),
                            "--mask", *extra], input=json.dumps(rec), capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        mask = json.loads(r.stdout)["loss_mask"]
        assert abs(100.0 * sum(mask) / len(mask) - runs[name]) < 0.05, (name, runs[name])
        masks = stored_masks(d / name)
        assert masks == [mask], name
    opts = json.loads((d / "nothink" / "dataset.json").read_text())["options"]
    assert opts["thinking"] is False, opts
    assert runs["nothink"] < runs["think"], runs
    print(f"--no-thinking: supervised {runs['nothink']}% instead of {runs['think']}% (the empty "
          f"think block is prompt)")


def check_too_long(d, inputs):
    """Over-long samples dominating (the length limit is wrong, not the data): exit 1."""
    r = run_tokenize(d / "long", inputs, "--max-len", "8", "--max-reject-ratio", "0.5")
    assert r.returncode == 1 and "longer than --max-len 8" in r.stderr, r.stderr
    assert "--max-tokens" in r.stderr, r.stderr
    print("over-long samples above --max-reject-ratio -> exit 1")


def same_tree(a, b):
    cmp = filecmp.dircmp(a, b)
    assert not cmp.left_only and not cmp.right_only, (cmp.left_only, cmp.right_only)
    names = sorted(cmp.common_files)
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
    return names


def main():
    if not CLI or not (TOK / "vocab.json").exists():
        print("SKIP: needs DFLASH_CLI and the qwen2 tokenizer fixture")
        sys.exit(77)
    with tempfile.TemporaryDirectory() as tmp:
        d = pathlib.Path(tmp)
        inputs, n_lines = write_inputs(d)
        runs = {}
        for threads, batch in ((1, "2048"), (2, "2048"), (3, "2048"), (2, "37"), (3, "1")):
            out = d / f"t{threads}-b{batch}"
            log = tokenize(out, inputs, "--threads", str(threads), "--batch-lines", batch)
            runs[threads, batch] = out
        base = runs[1, "2048"]
        for key, out in runs.items():
            names = same_tree(base, out)
            print(f"threads={key[0]} batch-lines={key[1]}: {len(names)} files identical to "
                  f"1 thread")
        manifest = json.loads((base / "dataset.json").read_text())
        rejected = [json.loads(x) for x in (base / "rejected.jsonl").read_text().splitlines()]
        print(log.strip().splitlines()[-1])
        check_tokenizer_hash(d, manifest["tokenizer_hash"], inputs)
        assert manifest["options"] == {"reasoning": "keep_after_last_user", "turns": "all",
                                       "max_len": 0, "truncate": False, "nfc": True}
        assert manifest["samples"] + len(rejected) == n_lines, (manifest["samples"],
                                                                len(rejected), n_lines)
        assert len(manifest["shards"]) == 1 and manifest["samples"] > 500
        for r in rejected:  # every rejection names its file, line and reason
            assert r["file"] in map(str, inputs) and r["line"] > 0 and r["reason"], r
        reasons = " | ".join(r["reason"] for r in rejected)
        for needle in ("invalid JSON", "unknown role", "no assistant turn", "content",
                       'duplicate id "twice"'):
            assert needle in reasons, needle
        # Sample ids: the record's id, else fetch's hash id; sources.jsonl maps them back.
        want = expected_ids(inputs)
        sources = [json.loads(x) for x in (base / "sources.jsonl").read_text().splitlines()]
        assert [s["id"] for s in sources] == sample_ids(base)
        assert len(set(s["id"] for s in sources)) == len(sources) == manifest["samples"]
        for s in sources:
            assert want[s["file"], s["line"]] == s["id"], s
        print(f"ids: {len(sources)} samples named by their record's id or the hash id "
              f"({sum(1 for s in sources if not s['id'].startswith('h'))} explicit)")
        check_failures(d, inputs)
        check_fetch_settings(d)
        check_unfinished(d)
        check_no_thinking(d)
        check_too_long(d, inputs)
        # Over-long samples: dropped by default, cut with --truncate.
        r = run_tokenize(d / "drop", inputs, "--max-len", "64", "--max-reject-ratio", "0.9")
        assert r.returncode == 0 and "longer than --max-len 64" in r.stderr, r.stderr  # warned
        tokenize(d / "cut", inputs, "--max-len", "64", "--truncate")
        drop = json.loads((d / "drop" / "dataset.json").read_text())
        cut = json.loads((d / "cut" / "dataset.json").read_text())
        assert cut["samples"] == manifest["samples"] and cut["tokens"] <= 64 * cut["samples"]
        assert drop["samples"] < manifest["samples"]
        assert all(s["tokens"] <= 64 * s["samples"] for s in drop["shards"])
        print(f"max-len 64: {drop['samples']} kept when dropping, {cut['samples']} when "
              f"truncating")
    print("tokenize CLI: OK")


if __name__ == "__main__":
    main()
