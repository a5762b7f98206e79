#!/usr/bin/env python3
"""Runs examples/fetch against the fetcher tests' fake OpenAI server and
checks its output with the server's own deterministic generator: every
prompt answered once with the expected text; a second run resumes and
fetches nothing.
usage: run_fetch_example.py FETCH_BINARY FAKE_SERVER_PY WORK_DIR"""
import json
import os
import shutil
import subprocess
import sys


def main():
    binary, fake, work = sys.argv[1:4]
    sys.path.insert(0, os.path.dirname(fake))
    import fake_server
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]}
               for i in range(12)]
    inp = os.path.join(work, "in.jsonl")
    with open(inp, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in prompts)
    srv = subprocess.Popen([sys.executable, fake, "--servers", "1", "--lifetime", "100"],
                           stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{json.loads(srv.stdout.readline())['ports'][0]}/v1"
        out = os.path.join(work, "out")
        subprocess.run([binary, url, "fake", inp, out], check=True)
        with open(os.path.join(out, "completions.jsonl")) as f:
            got = {r["id"]: r for r in map(json.loads, f)}
        assert sorted(got) == sorted(p["id"] for p in prompts), sorted(got)
        for p in prompts:
            _, content, finish, _ = fake_server.generate(p["messages"], 256)
            rec = got[p["id"]]
            assert rec["completion"]["content"] == "".join(content), (p["id"], rec)
            assert rec["finish_reason"] == finish, rec
        again = subprocess.run([binary, url, "fake", inp, out], check=True,
                               capture_output=True, text=True)
        summary = json.loads(again.stdout.splitlines()[0])
        assert summary["completed"] == 0 and summary["skipped"] == len(prompts), summary
    finally:
        srv.terminate()
        srv.wait()
    print(f"example-fetch: {len(prompts)} completions match the server's generator; resume ok")


if __name__ == "__main__":
    main()
