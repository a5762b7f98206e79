"""End-to-end tests of `dflash fetch` against fake OpenAI servers on loopback.

The reference is the fake server's deterministic generator (fake_server.generate):
every completion must equal what the server generated for the prompt the
test computes on its own, and every input line must end up exactly once in
completions.jsonl or errors.jsonl, across faults, kill -9 and resumes.
"""
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fake_server as fs  # noqa: E402

CLI = os.environ.get("DFLASH_CLI")
if not CLI:
    pytest.skip("DFLASH_CLI not set (run through meson test)", allow_module_level=True)

FAST = ["--backoff", "0.02", "--idle-timeout", "1", "--probe-interval", "0.2",
        "--connect-timeout", "2", "--fsync-interval", "0"]


class Farm:
    """fake_server.py in a subprocess: N chat servers plus a control port."""

    def __init__(self, n=1, *args):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "fake_server.py"), "--servers", str(n),
             "--stall", "3", "--lifetime", "600", *args],
            stdout=subprocess.PIPE, text=True)
        info = json.loads(self.proc.stdout.readline())
        self.ports = info["ports"]
        self.control = info["control"]
        self.urls = [f"http://127.0.0.1:{p}/v1" for p in self.ports]

    def get(self, path):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.control}{path}", timeout=30) as r:
            return json.loads(r.read())

    def post(self, path, obj):
        req = urllib.request.Request(f"http://127.0.0.1:{self.control}{path}",
                                     data=json.dumps(obj).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def close(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def farm():
    f = Farm(1)
    yield f
    f.close()


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def fetch_cmd(farm, inp, out, *extra):
    servers = [a for u in farm.urls for a in ("--server", u)]
    return [CLI, "fetch", *servers, "--model", "fake", "--family", "kimi", *FAST, *extra,
            str(inp), "-o", str(out)]


def run_fetch(farm, inp, out, *extra, rc=0, env=None):
    p = subprocess.run(fetch_cmd(farm, inp, out, *extra), capture_output=True, text=True,
                       timeout=300, env=env)
    assert rc is None or p.returncode == rc, \
        f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    return json.loads(p.stdout) if p.stdout.strip() else None, p


def prompt_of(messages):
    """The prompt the fetcher must send: trailing assistant turns dropped."""
    m = list(messages)
    while m and m[-1]["role"] == "assistant":
        m.pop()
    return m


def expected(prompt, max_tokens=None, **kw):
    reasoning, content, finish, n = fs.generate(prompt, max_tokens, **kw)
    return "".join(reasoning), "".join(content), finish, n


def hash_id(messages):
    text = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "h" + hashlib.sha256(text.encode()).hexdigest()[:32]


def user(text, i=None):
    rec = {"messages": [{"role": "user", "content": text}]}
    if i is not None:
        rec["id"] = i
    return rec


def outputs(out):
    return read_jsonl(out / "completions.jsonl"), read_jsonl(out / "errors.jsonl")


def assert_exactly_once(out, ids, bad_lines=()):
    comps, errs = outputs(out)
    got = [r["id"] for r in comps] + [r["id"] for r in errs if r["id"] is not None]
    assert sorted(got) == sorted(ids), "ids missing or duplicated"
    assert sorted(r["line"] for r in errs if r["id"] is None) == sorted(bad_lines)


def assert_matches_server(comps, max_tokens=None, usage_may_be_cut=False):
    for r in comps:
        if usage_may_be_cut and r["usage"] is None:  # cut after the finish_reason chunk
            r["usage"] = {"completion_tokens": expected(r["messages"], max_tokens)[3]}
        reasoning, content, finish, n = expected(r["messages"], max_tokens)
        assert r["completion"]["reasoning"] == reasoning, r["id"]
        assert r["completion"]["content"] == content, r["id"]
        assert r["finish_reason"] == finish
        assert r["usage"]["completion_tokens"] == n


# ---------------------------------------------------------------------------------


def test_outputs_match_server_generation(farm, tmp_path):
    recs = []
    for i in range(40):
        if i % 3 == 0:
            recs.append({"id": f"s{i}", "system": "be brief", "conversations": [
                {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "old"}]})
        elif i % 3 == 1:
            recs.append({"messages": [{"role": "user", "content": f"q {i} é 日本"},
                                      {"role": "assistant", "content": "a"},
                                      {"role": "user", "content": "more"},
                                      {"role": "assistant", "content": "old answer"}]})
        else:
            recs.append(user(f"plain {i}", i))
    write_jsonl(tmp_path / "in.jsonl", recs)
    summary, _ = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out", "--max-tokens", "64",
                           "--temperature", "0.6", "--seed", "3")
    comps, errs = outputs(tmp_path / "out")
    assert errs == [] and len(comps) == 40
    assert summary["completed"] == 40 and summary["retries"] == 0
    by_line = {r["line"]: r for r in comps}
    for line, rec in enumerate(recs, 1):
        r = by_line[line]
        if "conversations" in rec:
            want_prompt = [{"role": "system", "content": "be brief"},
                           {"role": "user", "content": rec["conversations"][0]["value"]}]
            assert r["id"] == rec["id"]
        else:
            want_prompt = prompt_of(rec["messages"])
            assert r["id"] == str(rec["id"]) if "id" in rec else r["id"] == hash_id(rec["messages"])
        assert r["messages"] == want_prompt
        assert r["attempts"] == 1 and r["outcome"] == "ok"
        assert r["server"] == farm.urls[0]
    assert_matches_server(comps, 64)
    bodies = [q["body"] for q in farm.get("/requests")]
    assert len(bodies) == 40
    for b in bodies:
        assert b["chat_template_kwargs"] == {"thinking": True}
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["model"] == "fake" and b["max_tokens"] == 64
        assert b["temperature"] == 0.6 and b["seed"] == 3
        assert all("reasoning" not in m for m in b["messages"])


FAULT_CASES = {
    # id: (directive, expected attempts, expected outcome or error kind)
    "f503": ("[[fault:503*2]]", 3, "ok"),
    "f500": ("[[fault:500*1]]", 2, "ok"),
    "f429": ("[[fault:429*1;ra=1]]", 2, "ok"),
    "freset": ("[[fault:reset*1]]", 2, "ok"),
    "ftrunc": ("[[fault:trunc*1]]", 2, "ok"),
    "ferrevent": ("[[fault:errevent*1]]", 2, "ok"),
    "fstall": ("[[fault:stall*1]]", 2, "ok"),
    "fbadjson": ("[[fault:badjson*1]]", 2, "ok"),
    "fabort": ("[[fault:abort*1]]", 2, "ok"),
    "fnofinish": ("[[fault:nofinish*2]]", 3, "ok"),
    "fchain": ("[[fault:503*1]][[fault:reset*1]][[fault:errevent*1]]", 4, "ok"),
    "fsplit": ("[[fault:split]]", 1, "ok"),
    "fkeep": ("[[fault:keepalive]]", 1, "ok"),
    "fdrip": ("[[fault:drip]]", 1, "ok"),
    "frfield": ("[[fault:rfield=reasoning]]", 1, "ok"),
    "flength": ("[[fault:length]]", 1, "length"),
    "fempty": ("[[fault:empty]]", 1, "empty"),
    "f400": ("[[fault:400]]", 1, "http"),
    "ferr400": ("[[fault:errevent400]]", 1, "stream"),
}


def run_fault_cases(farm, tmp_path, *extra):
    recs = [user(f"case {k} {d}", k) for k, (d, _, _) in FAULT_CASES.items()]
    write_jsonl(tmp_path / "in.jsonl", recs)
    summary, _ = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out", *extra, rc=4)
    comps, errs = outputs(tmp_path / "out")
    assert_exactly_once(tmp_path / "out", list(FAULT_CASES))
    got = {r["id"]: r for r in comps}
    got.update({r["id"]: r for r in errs})
    for k, (directive, attempts, outcome) in FAULT_CASES.items():
        r = got[k]
        assert r["attempts"] == attempts, (k, r)
        if "completion" in r:
            assert r["outcome"] == outcome, (k, r)
        else:
            assert r["kind"] == outcome, (k, r)
    prompt = [{"role": "user", "content": "case flength [[fault:length]]"}]
    assert got["flength"]["completion"]["content"] == ""
    assert got["flength"]["completion"]["reasoning"] == expected(prompt)[0]
    assert got["fempty"]["completion"]["content"] == ""
    assert got["f400"]["http_status"] == 400 and "prompt is too long" in got["f400"]["error"]
    assert "context length exceeded" in got["ferr400"]["error"]
    ok = [r for r in comps if r["outcome"] == "ok"]
    assert_matches_server(ok)
    assert summary["retries"] == sum(a - 1 for _, a, _ in FAULT_CASES.values())
    assert summary["length"] == 1 and summary["empty"] == 1
    return farm.get("/requests")


def test_every_fault_streamed(farm, tmp_path):
    reqs = run_fault_cases(farm, tmp_path)
    assert all(q["body"]["stream"] is True for q in reqs if q["body"].get("max_tokens") != 1)


def test_retry_after_is_honoured(farm, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [user("[[fault:429*1;ra=2]]", "ra")])
    t0 = time.monotonic()
    run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out")
    assert time.monotonic() - t0 >= 2.0  # a lower bound: only a client ignoring Retry-After fails
    assert outputs(tmp_path / "out")[0][0]["attempts"] == 2


def test_every_fault_not_streamed(tmp_path):
    farm = Farm(1, "--reasoning-field", "reasoning")
    try:
        run_fault_cases(farm, tmp_path, "--no-stream")
        assert all(q["body"]["stream"] is False for q in farm.get("/requests"))
    finally:
        farm.close()


def test_deadline_and_give_up(farm, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [user("[[fault:hang*1]]", "hang"),
                                        user("[[fault:503*9]]", "dead"),
                                        user("[[fault:nofinish*9]]", "aborted")])
    summary, _ = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out", "--deadline", "1",
                           "--max-attempts", "3", "--fail-threshold", "100", rc=4)
    comps, errs = outputs(tmp_path / "out")
    assert [r["id"] for r in comps] == ["hang"] and comps[0]["attempts"] == 2
    errs = {e["id"]: e for e in errs}
    assert sorted(errs) == ["aborted", "dead"]
    assert errs["dead"]["attempts"] == 3
    assert errs["dead"]["kind"] == "http" and errs["dead"]["http_status"] == 503
    assert "gave up after 3 attempts" in errs["dead"]["error"]
    # [DONE] without a finish_reason every time: a failure, never a completion.
    e = errs["aborted"]
    assert e["attempts"] == 3 and e["kind"] == "stream", e
    assert "gave up after 3 attempts" in e["error"] and "without a finish_reason" in e["error"]
    assert "[DONE]" in e["error"], e
    assert summary["failed"] == 2 and summary["completed"] == 1


def test_thousand_prompts_three_servers_with_chaos(tmp_path):
    farm = Farm(3, "--chaos", "0.2", "--seed", "5")
    try:
        n = 1200
        write_jsonl(tmp_path / "in.jsonl", [user(f"prompt number {i}", f"p{i}") for i in range(n)])
        summary, _ = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out", "--concurrency",
                               "16", "--max-attempts", "6", "--fail-threshold", "1000")
        comps, errs = outputs(tmp_path / "out")
        assert errs == []
        assert_exactly_once(tmp_path / "out", [f"p{i}" for i in range(n)])
        assert_matches_server(comps)
        stats = farm.get("/stats")
        # Every attempt the servers saw is one the fetcher counted, prompt by prompt.
        assert summary["retries"] == stats["total"] - n > 100
        for r in comps:
            assert r["attempts"] == stats["attempts"][fs.key_of(r["messages"])]
        used = {r["server"] for r in comps}
        assert used == set(farm.urls)
        assert all(s["completed"] > 200 for s in summary["servers"])
    finally:
        farm.close()


def wait_for_lines(path, n, proc, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if os.path.exists(path):
            with open(path, "rb") as f:
                if f.read().count(b"\n") >= n:
                    return
        time.sleep(0.02)
    raise AssertionError(f"{path} did not reach {n} lines")


def test_kill9_then_resume_loses_nothing(tmp_path):
    farm = Farm(2, "--token-delay", "0.01", "--chaos", "0.1")
    try:
        n = 500
        recs = [user(f"kill test {i}", f"k{i}") for i in range(n)]
        recs.insert(100, "{broken line")
        write_jsonl(tmp_path / "in.jsonl", recs)
        out = tmp_path / "out"
        for stop_at in (120, 300):
            proc = subprocess.Popen(fetch_cmd(farm, tmp_path / "in.jsonl", out, "--concurrency",
                                              "8", "--fsync-interval", "0.5"),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_for_lines(out / "completions.jsonl", stop_at, proc)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            done_before = len(read_jsonl(out / "completions.jsonl"))
            assert done_before < n
        summary, _ = run_fetch(farm, tmp_path / "in.jsonl", out, "--concurrency", "8", rc=4)
        assert summary["skipped"] >= 300
        assert_exactly_once(out, [f"k{i}" for i in range(n)], bad_lines=[101])
        assert_matches_server(outputs(out)[0])
        # A fourth run has nothing left to do.
        before = farm.get("/stats")["total"]
        summary, _ = run_fetch(farm, tmp_path / "in.jsonl", out, rc=4)  # the broken line
        assert summary["completed"] == 0 and summary["skipped"] == n + 1
        assert summary["errors_earlier"] == 1
        assert farm.get("/stats")["total"] == before
    finally:
        farm.close()


def start_midway(farm, tmp_path, n, lines, *extra):
    """Start a fetch of n prompts in the background; return once `lines` are written."""
    write_jsonl(tmp_path / "in.jsonl", [user(f"bg {i}", i) for i in range(n)])
    out = tmp_path / "out"
    proc = subprocess.Popen(fetch_cmd(farm, tmp_path / "in.jsonl", out, "--concurrency", "8",
                                      *extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_lines(out / "completions.jsonl", lines, proc)
    return proc, out


def test_sigint_drains_then_resume(tmp_path):
    farm = Farm(1, "--token-delay", "0.02")
    try:
        n = 200
        proc, out = start_midway(farm, tmp_path, n, 30)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 3, stderr
        summary = json.loads(stdout)
        assert summary["stopped"] and summary["pending"] > 0
        assert summary["stop_reason"] == "stop"
        # the stop's own message, not the summary's buffer size (it used to say
        # "fetch summary needs N bytes" here)
        assert "summary needs" not in stderr and "run the same command again" in stderr
        comps = read_jsonl(out / "completions.jsonl")
        # Draining finished what was in flight: every request the server got has its record.
        assert len(comps) == farm.get("/stats")["total"]
        run_fetch(farm, tmp_path / "in.jsonl", out)
        assert_exactly_once(out, [str(i) for i in range(n)])
    finally:
        farm.close()


def test_server_dies_and_comes_back(tmp_path):
    farm = Farm(2, "--token-delay", "0.005")
    try:
        n = 300
        proc, out = start_midway(farm, tmp_path, n, 40, "--fail-threshold", "2")
        farm.post("/down", {"port": farm.ports[0], "seconds": 1.5})
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        summary = json.loads(stdout)
        assert_exactly_once(out, [str(i) for i in range(n)])
        assert_matches_server(outputs(out)[0], usage_may_be_cut=True)
        s0 = summary["servers"][0]
        assert s0["failures"] >= 2 and s0["healthy"]
        probes = [q for q in farm.get("/requests") if q["body"].get("max_tokens") == 1]
        assert probes and all(q["port"] == farm.ports[0] for q in probes)
        assert all(q["body"]["stream"] is False for q in probes)
    finally:
        farm.close()


def test_all_servers_down_at_start(tmp_path):
    farm = Farm(1)
    try:
        farm.post("/down", {"port": farm.ports[0], "seconds": 2.0})
        write_jsonl(tmp_path / "in.jsonl", [user(f"late {i}", i) for i in range(20)])
        # A server that refuses connections at start is restarting, not misconfigured:
        # the run names it, waits for it (probing) and finishes when it answers.
        summary, p = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out",
                               "--max-attempts", "3")
        assert f"{farm.urls[0]}: unreachable" in p.stderr, p.stderr
        assert "joins when it answers" in p.stderr
        assert_exactly_once(tmp_path / "out", [str(i) for i in range(20)])
        assert summary["completed"] == 20 and summary["servers"][0]["healthy"]
    finally:
        farm.close()


def test_resume_with_one_of_three_servers_down(tmp_path):
    """A resume with one server restarting goes on with the other two and takes
    the third back when it answers; nothing lost or duplicated."""
    farm = Farm(3, "--token-delay", "0.01")
    try:
        n = 400
        proc, out = start_midway(farm, tmp_path, n, 60)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        done_before = len(read_jsonl(out / "completions.jsonl"))
        assert done_before < n
        farm.post("/down", {"port": farm.ports[2], "seconds": 2.0})
        seen = len(farm.get("/requests"))
        summary, p = run_fetch(farm, tmp_path / "in.jsonl", out, "--concurrency", "8")
        assert f"{farm.urls[2]}: unreachable" in p.stderr, p.stderr
        assert_exactly_once(out, [str(i) for i in range(n)])
        assert_matches_server(outputs(out)[0], usage_may_be_cut=True)
        assert summary["skipped"] == done_before
        by_url = {s["url"]: s for s in summary["servers"]}
        assert all(s["healthy"] and not s["excluded"] for s in by_url.values())
        # the third server came back and was given work (not only the 1-token probes)
        resumed = farm.get("/requests")[seen:]
        work = [q for q in resumed if q["body"].get("max_tokens") != 1]
        assert {q["port"] for q in work} == set(farm.ports)
        assert by_url[farm.urls[2]]["completed"] > 0
    finally:
        farm.close()


def test_resume_repairs_torn_line_and_fetches_only_missing(farm, tmp_path):
    n = 30
    write_jsonl(tmp_path / "in.jsonl", [user(f"r {i}", i) for i in range(n)])
    out = tmp_path / "out"
    run_fetch(farm, tmp_path / "in.jsonl", out)
    lines = (out / "completions.jsonl").read_bytes().splitlines(keepends=True)
    kept = lines[:25]
    (out / "completions.jsonl").write_bytes(b"".join(kept) + lines[25][:40])  # torn record
    farm.post("/reset", {})
    summary, p = run_fetch(farm, tmp_path / "in.jsonl", out)
    assert summary["skipped"] == 25 and summary["completed"] == 5
    assert farm.get("/stats")["total"] == 5
    assert "cutting" in p.stderr
    assert_exactly_once(out, [str(i) for i in range(n)])


def test_retry_errors_moves_records(farm, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [user("[[fault:503*2]]", "e"), user("fine", "f"),
                                        user("[[fault:400]]", "p")])
    out = tmp_path / "out"
    run_fetch(farm, tmp_path / "in.jsonl", out, "--max-attempts", "1", rc=4)
    assert sorted(r["id"] for r in outputs(out)[1]) == ["e", "p"]
    summary, _ = run_fetch(farm, tmp_path / "in.jsonl", out, rc=4)
    assert summary["skipped"] == 3 and summary["completed"] == 0
    assert summary["failed"] == 0 and summary["errors_earlier"] == 2
    summary, _ = run_fetch(farm, tmp_path / "in.jsonl", out, "--retry-errors", "--max-attempts",
                           "3", rc=4)  # "p" is a 400 every time
    comps, errs = outputs(out)
    assert sorted(r["id"] for r in comps) == ["e", "f"]
    assert [r["id"] for r in errs] == ["p"]
    assert sorted(r["id"] for r in read_jsonl(out / "errors.retried.jsonl")) == ["e", "p"]
    assert_exactly_once(out, ["e", "f", "p"])


def test_shards_cover_input_exactly_once(farm, tmp_path):
    recs = [user(f"shard {i}", f"s{i}") for i in range(90)] + ["not json", "{}"]
    write_jsonl(tmp_path / "in.jsonl", recs)
    ids, bad = [], []
    for i in range(3):
        out = tmp_path / f"out{i}"
        summary, p = run_fetch(farm, tmp_path / "in.jsonl", out, "--shard", f"{i}/3",
                               rc=None)
        assert p.returncode == (4 if summary["failed"] else 0), p.stderr
        comps, errs = outputs(out)
        assert 10 < len(comps) < 50
        ids += [r["id"] for r in comps]
        bad += [r["line"] for r in errs]
    assert sorted(ids) == sorted(f"s{i}" for i in range(90))
    assert sorted(bad) == [91, 92]


def test_malformed_lines_are_recorded_once(farm, tmp_path):
    recs = [user("ok", "a"), "{oops", json.dumps({"id": "x", "messages": []}),
            json.dumps({"conversations": [{"from": "alien", "value": "hi"}]}), "", "  ",
            user("dup first", "d"), user("dup second", "d")]
    write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / "out"
    # a reused id with other messages is an error unless asked (test_duplicate_ids_in_one_input)
    summary, _ = run_fetch(farm, tmp_path / "in.jsonl", out, "--keep-first", rc=4)
    comps, errs = outputs(out)
    assert sorted(r["id"] for r in comps) == ["a", "d"]
    assert summary["duplicates"] == 1
    by_line = {e["line"]: e for e in errs}
    assert set(by_line) == {2, 3, 4}
    assert "in.jsonl:2: invalid JSON at column" in by_line[2]["error"]
    assert by_line[3]["id"] == "x" and "empty" in by_line[3]["error"]
    assert "unknown speaker" in by_line[4]["error"] and all(e["kind"] == "input" for e in errs)
    summary, p = run_fetch(farm, tmp_path / "in.jsonl", out, "--keep-first", rc=4)
    assert len(outputs(out)[1]) == 3  # not recorded twice
    assert summary["failed"] == 0 and summary["errors_earlier"] == 3
    assert "3 prompts ended in" in p.stderr and "errors.jsonl" in p.stderr


def test_api_key_is_sent_and_never_written(farm, tmp_path):
    secret = "sk-test-0123456789abcdef"
    write_jsonl(tmp_path / "in.jsonl", [user("key", "k"), user("[[fault:400]]", "bad")])
    env = dict(os.environ, FAKE_KEY=secret)
    out = tmp_path / "out"
    _, p = run_fetch(farm, tmp_path / "in.jsonl", out, "--api-key-env", "FAKE_KEY", "-v", env=env,
                     rc=4)
    assert all(q["authorization"] == f"Bearer {secret}" for q in farm.get("/requests"))
    for f in out.iterdir():
        assert secret not in f.read_text()
    assert secret not in p.stdout + p.stderr
    (tmp_path / "key.txt").write_text(secret + "\n")
    farm.post("/reset", {})
    run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out2", "--api-key-file",
              str(tmp_path / "key.txt"), rc=4)
    assert all(q["authorization"] == f"Bearer {secret}" for q in farm.get("/requests"))
    _, p = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out3", "--api-key-env",
                     "DFLASH_UNSET_KEY_VAR", rc=1)
    assert "DFLASH_UNSET_KEY_VAR" in p.stderr


def test_all_turns_feed_back_regenerated_answers(farm, tmp_path):
    conv = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "old1"},
            {"role": "user", "content": "second"}, {"role": "assistant", "content": "old2"}]
    write_jsonl(tmp_path / "in.jsonl", [{"id": "m", "messages": conv}])
    run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out", "--all-turns", "--family", "qwen")
    r = outputs(tmp_path / "out")[0][0]
    r1, c1, _, _ = expected([conv[0]])
    assert r["messages"][1] == {"role": "assistant", "reasoning": r1, "content": c1}
    sent_second = [conv[0], {"role": "assistant", "content": c1}, conv[2]]
    r2, c2, _, _ = expected(sent_second)
    assert r["completion"]["content"] == c2 and r["completion"]["reasoning"] == r2
    assert len(r["turns"]) == 2
    bodies = [q["body"] for q in farm.get("/requests")]
    assert bodies[1]["messages"] == sent_second
    assert bodies[0]["chat_template_kwargs"] == {"enable_thinking": True}


def test_response_cap_and_directory_lock(farm, tmp_path):
    # "hang" keeps the first fetcher (and its lock) busy for the server's 3 s stall.
    write_jsonl(tmp_path / "in.jsonl", [user("[[fault:drip]] capped", "c"),
                                        user("[[fault:hang*1]]", "h")])
    out = tmp_path / "out"
    proc = subprocess.Popen(fetch_cmd(farm, tmp_path / "in.jsonl", out, "--max-response-bytes",
                                      "300"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    end = time.monotonic() + 30  # the first fetcher holds the lock while the drip lasts
    while not (out / "completions.jsonl").exists() and time.monotonic() < end:
        time.sleep(0.01)
    _, p = run_fetch(farm, tmp_path / "in.jsonl", out, rc=1)
    assert "another fetch is writing" in p.stderr
    proc.communicate(timeout=60)
    assert proc.returncode == 4  # every prompt ended in errors.jsonl
    comps, errs = outputs(out)
    assert comps == [] and sorted(e["id"] for e in errs) == ["c", "h"]  # no answer fits 300 B
    assert all(e["kind"] == "response" and "max_response_bytes" in e["error"] for e in errs)


# ---- token accounting: what each kind of server sends (fake_server.py --usage) and what
# the fetcher records and shows. A count the server did not send is unknown, never 0.

def usage_sent(kind, prompt, n):
    """The usage a record must carry for an answer of n tokens to `prompt` (None: unknown)."""
    p = len(json.dumps(prompt)) // 4  # the fake's prompt "tokens"
    if kind == "none":
        return None
    if kind == "openai":
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
    # llama: llama-server's own usage; timings: the same, built from its timings
    # (predicted_n, prompt_n + cache_n)
    return {"completion_tokens": n, "prompt_tokens": p, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": p // 3}}


RATE_RE = re.compile(r"prompts/s (\S+) tok/s(?: \((\d+) uncounted\))?")


def final_rate(stderr):
    """(tok/s as shown, uncounted answers or None) on the last progress line."""
    lines = [line for line in stderr.splitlines() if "tok/s" in line]
    assert lines, stderr
    m = RATE_RE.search(lines[-1])
    assert m, lines[-1]
    return m.group(1), m.group(2) and int(m.group(2))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "nostream"])
@pytest.mark.parametrize("kind", ["openai", "llama", "timings", "none"])
def test_token_counts_per_server_kind(kind, stream, tmp_path):
    farm = Farm(1, "--usage", kind)
    try:
        write_jsonl(tmp_path / "in.jsonl", [user(f"count {i}", f"c{i}") for i in range(12)])
        summary, p = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out",
                               *([] if stream else ["--no-stream"]))
        comps, errs = outputs(tmp_path / "out")
        assert len(comps) == 12 and not errs
        tokens = prompt_tokens = 0
        for r in comps:
            n = expected(r["messages"])[3]
            want = usage_sent(kind, r["messages"], n)
            assert r["usage"] == want, (kind, stream, r)
            if want:
                tokens += n
                prompt_tokens += want["prompt_tokens"]
        for q in farm.get("/requests"):
            b = q["body"]
            if b.get("max_tokens") == 1:
                continue
            assert b["stream"] is stream
            assert b.get("stream_options") == ({"include_usage": True} if stream else None)
        counted = kind != "none"
        assert summary["completion_tokens"] == tokens and summary["prompt_tokens"] == prompt_tokens
        assert summary["turns_counted"] == (12 if counted else 0)
        assert summary["turns_uncounted"] == (0 if counted else 12)
        assert summary["servers"][0]["turns_uncounted"] == summary["turns_uncounted"]
        assert summary["servers"][0]["completion_tokens"] == tokens
        rate, uncounted = final_rate(p.stderr)
        assert uncounted is None
        if counted:
            assert tokens > 0
            assert summary["completion_tok_per_s"] == pytest.approx(tokens / summary["elapsed_s"])
            assert float(rate) > 0
        else:  # no count came: unknown, not 0 tok/s
            assert summary["completion_tok_per_s"] is None and rate == "?"
    finally:
        farm.close()


def test_tok_rate_over_counted_answers_only(tmp_path):
    farm = Farm(2, "--usage", "openai,none")
    try:
        write_jsonl(tmp_path / "in.jsonl", [user(f"mixed {i}", f"m{i}") for i in range(30)])
        summary, p = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out", "--concurrency", "2")
        comps = outputs(tmp_path / "out")[0]
        assert len(comps) == 30
        counted = [r for r in comps if r["server"] == farm.urls[0]]
        uncounted = [r for r in comps if r["server"] == farm.urls[1]]
        assert counted and uncounted
        tokens = 0
        for r in counted:
            n = expected(r["messages"])[3]
            assert r["usage"]["completion_tokens"] == n
            tokens += n
        assert all(r["usage"] is None for r in uncounted)
        assert summary["completion_tokens"] == tokens
        assert summary["turns_counted"] == len(counted)
        assert summary["turns_uncounted"] == len(uncounted)
        s0, s1 = summary["servers"]
        assert s0["turns_uncounted"] == 0 and s0["completion_tokens"] == tokens
        assert s1["turns_uncounted"] == len(uncounted) and s1["completion_tokens"] == 0
        assert summary["completion_tok_per_s"] == pytest.approx(tokens / summary["elapsed_s"])
        rate, n_uncounted = final_rate(p.stderr)
        assert float(rate) > 0 and n_uncounted == len(uncounted)
    finally:
        farm.close()


def test_all_turns_counted_from_timings(tmp_path):
    farm = Farm(1, "--usage", "timings")
    try:
        conv = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "old1"},
                {"role": "user", "content": "second"}, {"role": "assistant", "content": "old2"}]
        write_jsonl(tmp_path / "in.jsonl", [{"id": "t", "messages": conv}])
        summary, _ = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out", "--all-turns")
        r = outputs(tmp_path / "out")[0][0]
        c1 = expected([conv[0]])[1]
        prompts = [[conv[0]], [conv[0], {"role": "assistant", "content": c1}, conv[2]]]
        want = [usage_sent("timings", m, expected(m)[3]) for m in prompts]
        assert [t["usage"] for t in r["turns"]] == want
        assert r["usage"] == want[1]
        assert summary["turns_counted"] == 2 and summary["turns_uncounted"] == 0
        assert summary["completion_tokens"] == sum(u["completion_tokens"] for u in want)
    finally:
        farm.close()


def test_stream_options_follow_the_stream_the_body_asks_for(farm, tmp_path):
    # vLLM (and OpenAI) answer 400 to stream_options on an unstreamed request, so an
    # --extra that turns the stream off must take them out, and one that turns it on
    # must still ask for usage.
    write_jsonl(tmp_path / "in.jsonl", [user(f"extra {i}", f"e{i}") for i in range(4)])
    run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "off", "--extra", '{"stream": false}')
    comps, errs = outputs(tmp_path / "off")
    assert not errs and len(comps) == 4
    assert_matches_server(comps)
    run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "on", "--no-stream", "--extra",
              '{"stream": true}')
    comps, errs = outputs(tmp_path / "on")
    assert not errs and len(comps) == 4
    assert_matches_server(comps)
    bodies = [q["body"] for q in farm.get("/requests") if q["body"].get("max_tokens") != 1]
    assert [b.get("stream_options") for b in bodies] == [None] * 4 + [{"include_usage": True}] * 4


# ---- never hang, never call failure success --------------------------------------------

DEAD = "http://127.0.0.1:9/v1"  # the discard port: nothing listens, connections are refused


def dead_cmd(inp, out, *extra):
    return [CLI, "fetch", "--server", DEAD, "--model", "m", "--connect-timeout", "2",
            "--max-attempts", "2", *extra, str(inp), "-o", str(out)]


def run_dead(inp, out, *extra, timeout=60):
    """A fetch against a dead port; on today's main it ran forever (TimeoutExpired)."""
    p = subprocess.run(dead_cmd(inp, out, *extra), capture_output=True, text=True,
                       timeout=timeout)
    return (json.loads(p.stdout) if p.stdout.strip() else None), p


def test_dead_server_stops_after_down_timeout_naming_it(tmp_path):
    # Unreachable at start is a server restarting: kept and probed; only when every
    # server stays unreachable past --down-timeout does the run stop, naming them.
    write_jsonl(tmp_path / "in.jsonl", [user(f"d {i}", i) for i in range(5)])
    summary, p = run_dead(tmp_path / "in.jsonl", tmp_path / "out", "--down-timeout", "2",
                          "--probe-interval", "0.2")
    assert p.returncode == 5, p.stderr
    assert f"{DEAD}: unreachable" in p.stderr and "(the down timeout)" in p.stderr
    assert summary["stop_reason"] == "down_timeout" and summary["completed"] == 0
    assert summary["servers"][0]["probes_failed"] >= 2
    assert outputs(tmp_path / "out") == ([], [])  # nothing recorded: the prompts wait


def test_dead_server_every_attempt_failing_is_not_success(tmp_path):
    # --max-attempts 1 without the check: every prompt fails; that was exit 0.
    write_jsonl(tmp_path / "in.jsonl", [user(f"d {i}", i) for i in range(5)])
    summary, p = run_dead(tmp_path / "in.jsonl", tmp_path / "out", "--max-attempts", "1",
                          "--no-server-check")
    assert p.returncode == 4, p.stderr
    errs = outputs(tmp_path / "out")[1]
    assert sorted(e["id"] for e in errs) == [str(i) for i in range(5)]
    assert all(e["kind"] == "network" for e in errs)
    assert summary["failed"] == 5 and summary["attempts_failed"] == 5
    assert "5 prompts ended in" in p.stderr


def test_all_servers_down_stops_after_down_timeout(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [user(f"d {i}", i) for i in range(5)])
    t0 = time.monotonic()
    summary, p = run_dead(tmp_path / "in.jsonl", tmp_path / "out", "--no-server-check",
                          "--down-timeout", "2", "--probe-interval", "0.2", "--log-interval",
                          "0.3")
    took = time.monotonic() - t0
    assert p.returncode == 5, p.stderr
    assert 2 <= took < 15
    # The progress line says what is going on, and the counters move.
    assert re.search(r"all servers down for \d+ s, waiting \(stop at 2 s\)", p.stderr), p.stderr
    assert "attempts failed 5" in p.stderr
    assert summary["stop_reason"] == "down_timeout" and summary["stopped"]
    assert summary["attempts_failed"] == 5 and summary["probes_failed"] >= 2
    assert summary["servers"][0]["failures"] == 5 and summary["servers"][0]["probes_failed"] >= 2
    assert summary["down_s"] >= 2 and summary["down_timeout_s"] == 2
    assert "down timeout" in p.stderr and "run the same command again" in p.stderr
    # Nothing is burnt into errors.jsonl: the prompts wait for a resume.
    assert outputs(tmp_path / "out") == ([], [])


def test_down_timeout_mid_run_keeps_work_and_resumes(tmp_path):
    farm = Farm(1, "--token-delay", "0.02")
    try:
        n = 150
        proc, out = start_midway(farm, tmp_path, n, 20, "--down-timeout", "1.5",
                                 "--fail-threshold", "1")
        farm.post("/down", {"port": farm.ports[0], "seconds": 6})
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 5, stderr
        summary = json.loads(stdout)
        assert summary["stop_reason"] == "down_timeout"
        kept = outputs(out)[0]
        assert 20 <= len(kept) < n and outputs(out)[1] == []
        end = time.monotonic() + 30  # the server comes back
        while time.monotonic() < end:
            try:
                urllib.request.urlopen(farm.urls[0] + "/models", timeout=2).read()
                break
            except OSError:
                time.sleep(0.2)
        summary, _ = run_fetch(farm, tmp_path / "in.jsonl", out, "--concurrency", "8")
        assert summary["skipped"] == len(kept)
        assert_exactly_once(out, [str(i) for i in range(n)])
        assert_matches_server(outputs(out)[0], usage_may_be_cut=True)
    finally:
        farm.close()


def test_startup_check_model_not_served(farm, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [user("m", "m")])
    p = subprocess.run([CLI, "fetch", "--server", farm.urls[0], "--model", "nope",
                        str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 6, p.stderr
    assert f'{farm.urls[0]} does not serve model "nope"; it serves "fake"' in p.stderr
    assert farm.get("/stats")["total"] == 0 and farm.get("/stats")["models_requests"] == 1
    # The typo fixed, the same folder is fine: a refused start recorded no settings.
    run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out")


def test_startup_check_auth(tmp_path):
    farm = Farm(1, "--api-key", "right-key", "--forbid-key", "banned-key")
    try:
        write_jsonl(tmp_path / "in.jsonl", [user("a", "a")])
        _, p = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "o1", rc=6)
        assert "HTTP 401" in p.stderr and "without an API key" in p.stderr
        assert farm.urls[0] in p.stderr
        env = dict(os.environ, K="wrong-key")
        _, p = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "o2", "--api-key-env", "K",
                         env=env, rc=6)
        assert "HTTP 401" in p.stderr and "refused the API key" in p.stderr
        assert "wrong-key" not in p.stderr
        env = dict(os.environ, K="banned-key")
        _, p = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "o3", "--api-key-env", "K",
                         env=env, rc=6)
        assert "HTTP 403" in p.stderr and "may not use the model" in p.stderr
        assert farm.get("/stats")["total"] == 0
        env = dict(os.environ, K="right-key")
        summary, _ = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "o4", "--api-key-env", "K",
                               env=env)
        assert summary["completed"] == 1
    finally:
        farm.close()


def test_some_servers_bad_refused_unless_skip_bad_servers(tmp_path):
    farm = Farm(3, "--models", "fake;other,more;fake")
    try:
        write_jsonl(tmp_path / "in.jsonl", [user(f"s {i}", i) for i in range(30)])
        cmd = fetch_cmd(farm, tmp_path / "in.jsonl", tmp_path / "out")
        cmd[cmd.index("--model"):cmd.index("--model")] = ["--server", DEAD]  # a fourth, dead
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert p.returncode == 6, p.stderr
        # the unreachable one is a server restarting, not a misconfiguration
        assert "1 of 4 servers failed the start-up check" in p.stderr
        assert f'{farm.urls[1]} does not serve model "fake"; it serves "other", "more"' in p.stderr
        assert f"{DEAD}: unreachable" in p.stderr and "--skip-bad-servers" in p.stderr
        assert farm.get("/stats")["total"] == 0
        p = subprocess.run(cmd + ["--skip-bad-servers"], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr
        assert "leaving out" in p.stderr and "going on with 3 of 4 servers" in p.stderr
        summary = json.loads(p.stdout)
        by_url = {s["url"]: s for s in summary["servers"]}
        assert by_url[farm.urls[1]]["excluded"] and not by_url[DEAD]["excluded"]
        assert not by_url[farm.urls[0]]["excluded"] and by_url[farm.urls[0]]["check"] is None
        assert not by_url[DEAD]["healthy"] and by_url[DEAD]["completed"] == 0
        # the progress line: the left-out server is not "down", the unreachable one is
        last = [line for line in p.stderr.splitlines() if "prompts/s" in line][-1]
        server = {part.split()[0]: part for part in last.split(" | ")[1:]}
        assert "s3" in server, last
        assert server["s1"].endswith("LEFT OUT") and server["s3"].endswith("DOWN"), last
        assert not server["s0"].endswith(("DOWN", "OUT")), last
        assert {q["port"] for q in farm.get("/requests")} == {farm.ports[0], farm.ports[2]}
        assert_exactly_once(tmp_path / "out", [str(i) for i in range(30)])
        # Only bad servers: refused even with --skip-bad-servers.
        cmd = [CLI, "fetch", "--server", farm.urls[1], "--model", "fake", *FAST,
               "--skip-bad-servers", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out2")]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert p.returncode == 6 and "no server passed the start-up check" in p.stderr
    finally:
        farm.close()


def test_nothing_left_needs_no_server(farm, tmp_path):
    # A finished folder resumed with every server gone: nothing to send, so no check, exit 0.
    write_jsonl(tmp_path / "in.jsonl", [user(f"n {i}", i) for i in range(3)])
    run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out")
    summary, p = run_dead(tmp_path / "in.jsonl", tmp_path / "out", "--model", "fake",
                          "--family", "kimi")
    assert p.returncode == 0, p.stderr
    assert summary["skipped"] == 3 and summary["stop_reason"] is None


def test_no_server_check_sends_no_models_request(farm, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [user("x", "x")])
    run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out", "--no-server-check")
    assert farm.get("/stats")["models_requests"] == 0
    run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out2")
    assert farm.get("/stats")["models_requests"] == 1


def test_settings_recorded_and_changes_refused(farm, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [user(f"q {i}", i) for i in range(6)])
    out = tmp_path / "out"
    base = ["--temperature", "0.6", "--max-tokens", "64", "--stop", '["END"]']
    run_fetch(farm, tmp_path / "in.jsonl", out, *base)
    rec = json.loads((out / "settings.json").read_text())
    assert rec["settings"] == {
        "model": "fake", "family": "kimi", "chat_template_kwargs": {"thinking": True},
        "max_tokens": 64, "temperature": 0.6, "top_p": None, "top_k": None, "min_p": None,
        "seed": None, "stop": ["END"], "extra": None, "all_turns": False}
    assert rec["earlier"] == [] and rec["since"]
    # The same settings resume; so do options that are not request settings.
    summary, _ = run_fetch(farm, tmp_path / "in.jsonl", out, *base, "--concurrency", "3")
    assert summary["skipped"] == 6
    write_jsonl(tmp_path / "in.jsonl", [user(f"q {i}", i) for i in range(8)])  # two more
    sent = farm.get("/stats")["total"]
    _, p = run_fetch(farm, tmp_path / "in.jsonl", out, *base[2:], "--temperature", "1",
                     "--no-thinking", rc=1)
    assert "DFLASH_E_MISMATCH" in p.stderr and "settings.json" in p.stderr
    assert "temperature 0.6 -> 1" in p.stderr
    assert 'chat_template_kwargs {"thinking":true} -> {"thinking":false}' in p.stderr
    assert "max_tokens" not in p.stderr and "--allow-settings-change" in p.stderr
    assert json.loads(p.stdout)["stop_reason"] == "settings"
    assert farm.get("/stats")["total"] == sent  # refused before anything was sent
    # nor checked: the first run's check is the only one (the second had nothing to send)
    assert farm.get("/stats")["models_requests"] == 1
    assert json.loads((out / "settings.json").read_text()) == rec
    summary, p = run_fetch(farm, tmp_path / "in.jsonl", out, *base[2:], "--temperature", "1",
                           "--no-thinking", "--allow-settings-change")
    assert summary["completed"] == 2 and summary["skipped"] == 6
    now = json.loads((out / "settings.json").read_text())
    assert now["settings"]["temperature"] == 1 and now["settings"]["chat_template_kwargs"] == {
        "thinking": False}
    assert [e["settings"] for e in now["earlier"]] == [rec["settings"]]
    assert now["earlier"][0]["since"] == rec["since"] and now["earlier"][0]["until"]
    # The new settings are now the recorded ones.
    run_fetch(farm, tmp_path / "in.jsonl", out, *base[2:], "--temperature", "1", "--no-thinking")


def test_options_parsed_by_the_shared_parser(farm, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [user("o", "o")])

    def fetch(*args):
        return subprocess.run([CLI, "fetch", *args], capture_output=True, text=True, timeout=60)
    inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out")
    p = fetch("--server", farm.urls[0], "--model", "fake", "--concurrency", "abc", inp, "-o", out)
    assert p.returncode == 2 and "--concurrency" in p.stderr and "'abc'" in p.stderr
    p = fetch("--server", farm.urls[0], "--model", "fake", "--top-p", "5", inp, "-o", out)
    assert p.returncode == 2 and "--top-p wants a number in [0, 1]" in p.stderr
    p = fetch("--server", farm.urls[0], "--model", "fake", "--max-tokens", "8x", inp, "-o", out)
    assert p.returncode == 2 and "--max-tokens" in p.stderr
    p = fetch("--server", farm.urls[0], "--model", "fake", "--concurency", "3", inp, "-o", out)
    assert p.returncode == 2 and "unknown option --concurency (did you mean --concurrency?)" \
        in p.stderr
    p = fetch("--server", farm.urls[0], "--model", "fake", "--family", "klmi", inp, "-o", out)
    assert p.returncode == 2 and "--family does not take 'klmi'" in p.stderr
    p = fetch("--server", farm.urls[0], "--model", "fake", inp)
    assert p.returncode == 2 and "missing -o OUTDIR" in p.stderr
    p = fetch("--model", "fake", inp, "-o", out)
    assert p.returncode == 2 and "missing --server" in p.stderr
    p = fetch("--help")
    assert p.returncode == 0 and "Exit status:" in p.stdout and "--down-timeout" in p.stdout
    # --opt=value, options after the input, a repeated --server, -o and -v.
    p = fetch(inp, f"--server={farm.urls[0]}", "--model=fake", "--max-tokens=8",
              "--server", farm.urls[0], "-o", out, "-v", "--family=qwen")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    assert summary["completed"] == 1 and len(summary["servers"]) == 2
    assert "summary needs" not in p.stderr  # -v showed a buffer-size query before
    body = [q["body"] for q in farm.get("/requests")][0]
    assert body["max_tokens"] == 8 and body["chat_template_kwargs"] == {"enable_thinking": True}


# ---- an id means one prompt -------------------------------------------------------


def test_overlapping_ids_refused_unless_new_ids(farm, tmp_path):
    """A second input whose ids overlap the first's is refused, not skipped as done;
    --new-ids fetches its prompts as "ID#2", and a resume finds them there."""
    out = tmp_path / "out"
    write_jsonl(tmp_path / "a.jsonl", [user(f"first {i}", i) for i in range(5)])
    run_fetch(farm, tmp_path / "a.jsonl", out)
    comps = outputs(out)[0]
    assert all(r["digest"] == hash_id(r["messages"])[1:] for r in comps)
    settings = json.loads((out / "settings.json").read_text())["settings"]
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    assert all(r["settings_digest"] == hashlib.sha256(text.encode()).hexdigest()[:32]
               for r in comps)
    write_jsonl(tmp_path / "b.jsonl", [user(f"second {i}", i) for i in range(4)] +
                [user("first 4", 4)])
    sent = farm.get("/stats")["total"]
    _, p = run_fetch(farm, tmp_path / "b.jsonl", out, rc=1)
    assert "DFLASH_E_MISMATCH" in p.stderr and "4 ids already in" in p.stderr, p.stderr
    assert "0 (line 1), 1 (line 2), 2 (line 3), 3 (line 4)" in p.stderr
    assert "--new-ids" in p.stderr and farm.get("/stats")["total"] == sent
    assert outputs(out)[0] == comps
    summary, _ = run_fetch(farm, tmp_path / "b.jsonl", out, "--new-ids")
    assert summary["completed"] == 4 and summary["skipped"] == 1 and summary["renamed"] == 4
    assert_exactly_once(out, [str(i) for i in range(5)] + [f"{i}#2" for i in range(4)])
    assert_matches_server(outputs(out)[0])
    summary, _ = run_fetch(farm, tmp_path / "b.jsonl", out, "--new-ids")
    assert summary["skipped"] == 5 and summary["completed"] == 0


def test_duplicate_ids_in_one_input(farm, tmp_path):
    """Two files with ids 0..N merged: an error naming the ids, not a silent loss of half."""
    merged = [user(f"a {i}", i) for i in range(4)] + [user(f"b {i}", i) for i in range(4)]
    write_jsonl(tmp_path / "in.jsonl", merged + [user("a 0", 0)])  # and one exact repeat
    _, p = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out", rc=1)
    assert "DFLASH_E_FORMAT" in p.stderr and "4 ids come again" in p.stderr, p.stderr
    assert "0 (line 5)" in p.stderr and "--keep-first" in p.stderr
    summary, _ = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "first", "--keep-first")
    assert summary["completed"] == 4 and summary["duplicates"] == 5
    summary, _ = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "all", "--new-ids")
    assert summary["completed"] == 8 and summary["duplicates"] == 1
    assert_exactly_once(tmp_path / "all", [str(i) for i in range(4)] +
                        [f"{i}#2" for i in range(4)])


# ---- reporting that is true -------------------------------------------------------


def test_overload_is_retried_and_never_takes_a_server_out(farm, tmp_path):
    """429 and 503 (with or without Retry-After, or as an error event after 200) lower the
    server's concurrency and are retried; the server stays in service, unprobed."""
    faults = ["[[fault:503*2]]", "[[fault:503*1;ra=1]]", "[[fault:429*2]]",
              "[[fault:errevent*2]]"]
    write_jsonl(tmp_path / "in.jsonl", [user(f"busy {i} {f}", f"o{i}")
                                        for i, f in enumerate(faults * 3)])
    summary, p = run_fetch(farm, tmp_path / "in.jsonl", tmp_path / "out", "--fail-threshold",
                           "1", "--log-interval", "0.05", "-v")
    assert summary["completed"] == 12 and summary["overloaded"] == 3 * 7
    s0 = summary["servers"][0]
    assert s0["healthy"] and s0["probes_failed"] == 0 and s0["overloaded"] == 21
    assert "taken out" not in p.stderr and "DOWN" not in p.stderr
    assert "every server is down" not in p.stderr and "all servers down" not in p.stderr
    assert not [q for q in farm.get("/requests") if q["body"].get("max_tokens") == 1]
    whys = [d["why"] for d in summary["controller"]["decisions"]]
    assert any("overloaded" in w for w in whys), whys


def test_rates_over_a_window_and_per_server(tmp_path):
    """A resume of 5000 done prompts and 20 new ones reports the new ones' rate (it showed
    millions per second), and each server's tok/s is its completed tokens' rate (they add
    up to the total)."""
    farm = Farm(2, "--token-delay", "0.03")
    try:
        out = tmp_path / "out"
        out.mkdir()
        with open(out / "completions.jsonl", "w") as f:
            for i in range(5000):
                f.write(json.dumps({"id": f"old{i}", "outcome": "ok"}) + "\n")
        write_jsonl(tmp_path / "in.jsonl", [user(f"old {i}", f"old{i}") for i in range(5000)] +
                    [user(f"new {i}", f"new{i}") for i in range(20)])
        summary, p = run_fetch(farm, tmp_path / "in.jsonl", out, "--concurrency", "2",
                               "--log-interval", "0.05")
        assert summary["skipped"] == 5000 and summary["completed"] == 20
        lines = [line for line in p.stderr.splitlines() if "prompts/s" in line]
        assert len(lines) >= 2, p.stderr
        for line in lines:
            reporter, note = (float(x) for x in re.findall(r"([\d.]+) prompts/s", line)[:2])
            assert reporter <= 20, line  # this run's 20 over at least 1 s
        running = [line for line in lines if "20/20" not in line]
        assert running, p.stderr
        for line in running:  # while running: the last 10 s, never less than 2 s
            assert float(re.findall(r"([\d.]+) prompts/s", line)[1]) <= 10, line
        servers = summary["servers"]
        assert all(s["tok_per_s"] > 0 for s in servers)
        assert sum(s["tok_per_s"] for s in servers) == pytest.approx(
            summary["completion_tok_per_s"])
        for s in servers:
            assert s["tok_per_s"] == pytest.approx(s["completion_tokens"] / summary["elapsed_s"])
    finally:
        farm.close()


def test_help_matches_the_exit_statuses():
    """An unreachable server is waited for (exit 5 after --down-timeout), no longer exit 6."""
    p = subprocess.run([CLI, "fetch", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    codes = dict(re.findall(r"^  (\d)  (.*(?:\n     .*)*)", p.stdout, re.M))
    assert "reached" in codes["5"] and "host" in codes["5"]
    assert "reach" not in codes["6"] and "NAME" in codes["6"]
    assert not re.search(r"unreachable[^.]*exit 6", p.stdout), p.stdout
    assert "429 and 503" in p.stdout
