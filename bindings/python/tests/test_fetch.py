"""libdflash.fetch() against the fake OpenAI server of tests/fetch on loopback."""
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

import libdflash
from libdflash.fetch import record_id

SERVER = pathlib.Path(__file__).resolve().parents[3] / "tests" / "fetch" / "fake_server.py"
sys.path.insert(0, str(SERVER.parent))
fs = pytest.importorskip("fake_server")


@pytest.fixture
def server():
    proc = subprocess.Popen([sys.executable, str(SERVER), "--lifetime", "300", "--stall", "2"],
                            stdout=subprocess.PIPE, text=True)
    info = json.loads(proc.stdout.readline())
    yield f"http://127.0.0.1:{info['ports'][0]}/v1"
    proc.kill()
    proc.wait()


def write_prompts(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]})
                    + "\n")


def test_fetch_writes_what_the_server_generated(server, tmp_path):
    write_prompts(tmp_path / "in.jsonl", 25)
    seen = []
    summary = libdflash.fetch(tmp_path / "in.jsonl", tmp_path / "out", [server], "fake",
                           family="qwen", max_tokens=8, temperature=0.0, progress=seen.append,
                           progress_interval=0.01, fsync_interval=0, extra={"top_k": 5})
    assert summary["completed"] == 25 and summary["failed"] == 0 and not summary["stopped"]
    assert seen and seen[-1]["completed"] == 25 and seen[-1]["total"] == 25
    rows = [json.loads(x) for x in open(tmp_path / "out" / "completions.jsonl")]
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}" for i in range(25))
    for r in rows:
        reasoning, content, finish, n = fs.generate(r["messages"], 8)
        assert r["completion"]["reasoning"] == "".join(reasoning)
        assert r["completion"]["content"] == "".join(content)
        assert r["finish_reason"] == finish and r["usage"]["completion_tokens"] == n
    again = libdflash.fetch(tmp_path / "in.jsonl", tmp_path / "out", server, "fake")
    assert again["skipped"] == 25 and again["completed"] == 0


def test_progress_can_stop_the_run(server, tmp_path):
    write_prompts(tmp_path / "in.jsonl", 40)
    summary = libdflash.fetch(tmp_path / "in.jsonl", tmp_path / "out", [server], "fake",
                           progress=lambda s: True, progress_interval=0.001, concurrency=1)
    assert summary["stopped"]
    done = summary["completed"]
    summary = libdflash.fetch(tmp_path / "in.jsonl", tmp_path / "out", [server], "fake")
    assert summary["skipped"] == done and done + summary["completed"] == 40


def test_errors_carry_status_and_detail(tmp_path):
    with pytest.raises(libdflash.Error) as info:
        libdflash.fetch(tmp_path / "missing.jsonl", tmp_path / "out", ["http://127.0.0.1:9/v1"], "m")
    assert info.value.status == "DFLASH_E_NOT_FOUND" and "missing.jsonl" in info.value.message
    with pytest.raises(libdflash.Error) as info:
        libdflash.fetch(tmp_path / "x.jsonl", tmp_path / "out", ["gopher://x"], "m")
    assert info.value.status == "DFLASH_E_CONFIG"
    with pytest.raises(TypeError):
        libdflash.fetch(tmp_path / "x.jsonl", tmp_path / "out", ["http://x"], "m", colour=1)


def test_record_id_is_documented_sha256():
    msgs = [{"role": "user", "content": "Grüße, 世界 \"q\"\n"}]
    line = json.dumps({"conversations": [{"from": "human", "value": msgs[0]["content"]}]})
    text = json.dumps(msgs, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert record_id(line) == "h" + hashlib.sha256(text.encode()).hexdigest()[:32]
    assert record_id(json.dumps({"id": 7, "messages": msgs})) == "7"


def test_fetcher_counters_agree_with_outputs(server, tmp_path):
    write_prompts(tmp_path / "in.jsonl", 12)
    with open(tmp_path / "in.jsonl", "a") as f:
        f.write("{broken\n")
    with libdflash.Fetcher(tmp_path / "in.jsonl", tmp_path / "out", [server], "fake",
                        max_tokens=6, concurrency=4) as fetcher:
        before = fetcher.stats()
        assert before["total"] == 13 and before["completed"] == 0 and before["input_errors"] == 1
        assert [s["url"] for s in fetcher.server_stats()] == [server]
        assert fetcher.run() is True
        stats = fetcher.stats()
        servers = fetcher.server_stats()
        summary = fetcher.summary()
    rows = (tmp_path / "out" / "completions.jsonl").read_text().splitlines()
    errors = (tmp_path / "out" / "errors.jsonl").read_text().splitlines()
    assert stats["completed"] == len(rows) == 12 and stats["failed"] == len(errors) == 1
    assert stats["pending"] == 0 and stats["in_flight"] == 0 and stats["servers_healthy"] == 1
    tokens = sum(json.loads(r)["usage"]["completion_tokens"] for r in rows)
    assert stats["completion_tokens"] == tokens
    assert len(servers) == 1 and servers[0]["healthy"] and servers[0]["completed"] == 12
    assert servers[0]["requests"] >= 12 and servers[0]["completion_tokens"] == tokens
    assert summary["completed"] == 12
    # --concurrency N is fixed: the controller never moves it and logs no decision
    assert servers[0]["concurrency"] == 4
    assert summary["controller"]["mode"] == "fixed" and summary["controller"]["decisions"] == []


def test_fetcher_adaptive_by_default(server, tmp_path):
    write_prompts(tmp_path / "in.jsonl", 6)
    with libdflash.Fetcher(tmp_path / "in.jsonl", tmp_path / "out", [server], "fake",
                        max_tokens=6, max_concurrency=3) as fetcher:
        assert fetcher.run() is True
        servers = fetcher.server_stats()
        summary = fetcher.summary()
    assert summary["controller"]["mode"] == "adaptive" and summary["completed"] == 6
    assert 1 <= servers[0]["concurrency"] <= 3  # the cap holds from the first request
    assert summary["servers"][0]["concurrency"] == servers[0]["concurrency"]


def test_fetcher_stop_from_another_thread(server, tmp_path):
    import threading
    write_prompts(tmp_path / "in.jsonl", 200)
    with libdflash.Fetcher(tmp_path / "in.jsonl", tmp_path / "out", [server], "fake",
                        concurrency=1, drain_grace=5, progress_interval=0.005) as fetcher:
        stoppers = []

        def progress(stats):
            if stats["completed"] >= 3 and not stoppers:
                stoppers.append(threading.Thread(target=fetcher.stop))
                stoppers[0].start()
            return False  # the stop comes from the other thread only

        assert fetcher.run(progress) is False  # stopped: DFLASH_E_CANCELLED
        stats = fetcher.stats()
        stoppers[0].join()
        assert stats["stopping"] == 1 and 3 <= stats["completed"] < 200
    done = len((tmp_path / "out" / "completions.jsonl").read_text().splitlines())
    assert done == stats["completed"]


def test_fetcher_chunking_is_checked(server, tmp_path):
    write_prompts(tmp_path / "in.jsonl", 2)
    with pytest.raises(libdflash.Error) as e:
        libdflash.Fetcher(tmp_path / "in.jsonl", tmp_path / "out", server, "fake", worker="a/b")
    assert e.value.status == "DFLASH_E_CONFIG" and "a/b" in e.value.message
    with libdflash.Fetcher(tmp_path / "in.jsonl", tmp_path / "out", server, "fake", worker="w1",
                           chunk_records=1, chunk_seconds=5) as fetcher:  # local out: no effect
        fetcher.run()
    assert len((tmp_path / "out" / "completions.jsonl").read_text().splitlines()) == 2
    with pytest.raises(ValueError):
        fetcher.stats()  # closed


def test_fetcher_chunking_names_and_sizes_s3_chunks(server, tmp_path, monkeypatch):
    sys.path.insert(0, str(SERVER.parents[1] / "storage"))
    import s3env
    if not s3env.moto_available():
        pytest.skip("moto[server] not installed (pip install -r scripts/requirements.txt)")
    env = s3env.S3Env()
    try:
        for k, v in env.env.items():
            monkeypatch.setenv(k, v)
        write_prompts(tmp_path / "in.jsonl", 5)
        out = f"s3://{env.bucket}/chunked/"
        with libdflash.Fetcher(tmp_path / "in.jsonl", out, server, "fake", max_tokens=4,
                               worker="w1", chunk_records=2, chunk_seconds=600) as f:
            assert f.run()
        objects = libdflash.Storage().list(out + "completions/")
        names = [loc[len(out) + len("completions/"):] for loc, _ in objects]
        # 5 records, at most 2 per chunk, named after the worker: 3 chunks.
        assert len(names) == 3 and all(n.startswith("w1-") and n.endswith(".jsonl")
                                       for n in names), names
        rows = [json.loads(x) for loc, _ in objects
                for x in libdflash.Storage().read(loc).decode().splitlines()]
        assert sorted(r["id"] for r in rows) == [f"p{i}" for i in range(5)]
    finally:
        env.close()


def test_fetcher_guards_check_servers_before_any_work(server, tmp_path):
    """With the start-up check, a model the servers do not serve is named before anything
    is sent; a dead server is a server restarting (kept down, probed), not a refusal."""
    write_prompts(tmp_path / "in.jsonl", 2)
    dead = "http://127.0.0.1:9/v1"
    with libdflash.Fetcher(tmp_path / "in.jsonl", tmp_path / "out", [server, dead], "nope",
                        connect_timeout=2) as fetcher:
        with pytest.raises(libdflash.Error) as e:
            fetcher.run()
        assert 'does not serve model "nope"' in e.value.message, e.value.message
    assert not (tmp_path / "out" / "completions.jsonl").exists() or \
        not (tmp_path / "out" / "completions.jsonl").read_text()
    with libdflash.Fetcher(tmp_path / "in.jsonl", tmp_path / "out2", [server, dead], "fake",
                           connect_timeout=2, skip_bad_servers=True,
                           settings_change="refuse") as fetcher:
        fetcher.run()
    assert len((tmp_path / "out2" / "completions.jsonl").read_text().splitlines()) == 2


def test_an_id_means_one_prompt(server, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(inp, 3)
    libdflash.fetch(inp, out, [server], "fake", max_tokens=4)
    with open(inp, "w") as f:  # a second input reusing the ids for other prompts
        for i in range(3):
            f.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"o{i}"}]})
                    + "\n")
    with pytest.raises(libdflash.Error) as info:
        libdflash.Fetcher(inp, out, [server], "fake")
    assert info.value.status == "DFLASH_E_MISMATCH" and "3 ids already in" in info.value.message
    with libdflash.Fetcher(inp, out, [server], "fake", max_tokens=4, new_ids=True) as fetcher:
        assert fetcher.run() is True
        stats = fetcher.stats()
    assert stats["completed"] == 3 and stats["renamed"] == 3
    ids = sorted(json.loads(x)["id"] for x in open(out / "completions.jsonl"))
    assert ids == ["p0", "p0#2", "p1", "p1#2", "p2", "p2#2"]
    with open(inp, "a") as f:  # p0 again with other messages: refused unless the first is kept
        f.write(json.dumps({"id": "p0", "messages": [{"role": "user", "content": "z"}]}) + "\n")
    with pytest.raises(libdflash.Error) as info:
        libdflash.Fetcher(inp, out, [server], "fake")
    assert "1 ids come again with other messages (p0 (line 4))" in info.value.message
    with libdflash.Fetcher(inp, out, [server], "fake", keep_first_duplicates=True,
                           new_ids=True) as fetcher:
        assert fetcher.stats()["duplicates"] == 1


def test_stats_carry_what_the_summary_says(server, tmp_path):
    write_prompts(tmp_path / "in.jsonl", 5)
    with libdflash.Fetcher(tmp_path / "in.jsonl", tmp_path / "out", [server], "fake",
                           max_tokens=6) as fetcher:
        assert fetcher.run() is True
        stats, summary = fetcher.stats(), fetcher.summary()
        servers = fetcher.server_stats()
    assert servers[0]["excluded"] is False and servers[0]["overloaded"] == 0
    assert servers[0]["tok_per_s"] == pytest.approx(summary["servers"][0]["tok_per_s"])
    for key in ("errors_earlier", "attempts_failed", "probes_failed", "overloaded",
                "turns_counted", "turns_uncounted", "renamed", "stop_reason", "down_s"):
        assert stats[key] == summary[key], key
    assert stats["stop_reason"] is None and stats["servers_down"] == 0
    assert stats["down_timeout_s"] == summary["down_timeout_s"] == 600
    assert stats["completion_tok_per_s"] == pytest.approx(summary["completion_tok_per_s"])
