"""Interrupting the demo costs nothing (issue 43, item 5), at the smallest scale that
shows it: pipeline.py --quick on 20 prompts up to its hidden states, copied twice; one copy
trains uninterrupted, the other gets SIGTERM (what Ctrl-C through scripts/demo.sh sends)
while `dflash train` runs, then the same command again. Asserted:

  - the interrupted run exits 128 + SIGTERM, says how to resume, prints no traceback, and
    leaves no child behind (its training saved train_state/);
  - the re-run skips the finished stages (out/stages/*.json) and resumes training
    (`dflash train --resume`): it ends with the same model.safetensors, byte for byte, as
    the uninterrupted run (one training thread: the same sums in the same order).

    python examples/pipeline/test_resume.py --out DIR --build BUILD

Exit 77 without the model package, PyTorch or llama-server, as pipeline-smollm2.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def pipeline(out, build, *extra):
    return [sys.executable, os.path.join(HERE, "pipeline.py"), "--quick", "--n-prompts", "20",
            "--out", out, "--build", build, *extra]


def steps_logged(out):
    try:
        with open(os.path.join(out, "drafter", "metrics.jsonl")) as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--build", required=True)
    a = ap.parse_args()
    try:
        import pipeline as pl
        missing = pl.missing_packages(None)
    except ImportError as e:
        missing = [str(e)]
    if missing:
        print(f"skip: missing {missing}")
        sys.exit(77)
    out = os.path.abspath(a.out)
    shutil.rmtree(out, ignore_errors=True)
    base, whole, cut = (os.path.join(out, x) for x in ("base", "whole", "cut"))
    subprocess.run(pipeline(base, a.build, "--stop-after", "hidden"), check=True)
    shutil.copytree(base, whole)
    shutil.copytree(base, cut)
    subprocess.run(pipeline(whole, a.build, "--stop-after", "train"), check=True,
                   stdout=subprocess.DEVNULL)
    total = steps_logged(whole)

    p = subprocess.Popen(pipeline(cut, a.build, "--stop-after", "train"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while steps_logged(cut) < total // 4:  # well inside the training stage
        assert p.poll() is None, f"pipeline ended before training: {p.communicate()}"
        assert time.time() - t0 < 1200, "no training steps in 20 min"
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    so, se = p.communicate(timeout=300)
    at = steps_logged(cut)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, se[-3000:])
    assert "Traceback" not in se + so, se[-3000:]
    assert "the same command resumes" in se, se[-2000:]
    assert os.path.isdir(os.path.join(cut, "drafter", "train_state")), os.listdir(
        os.path.join(cut, "drafter"))
    assert not os.path.exists(os.path.join(cut, "stages", "train.json"))
    assert 0 < at < total, f"stopped at step {at} of {total}: not during training"

    r = subprocess.run(pipeline(cut, a.build, "--stop-after", "train"), check=True,
                       capture_output=True, text=True)
    for stage in ("fetch", "tokenize", "hidden"):
        assert f"== {stage}: done in an earlier run" in r.stdout, (stage, r.stdout[-3000:])
    assert "--resume" in r.stdout, r.stdout[-3000:]
    with open(os.path.join(cut, "stages", "train.json")) as f:
        assert json.load(f)["cpu_s"] > 0
    with open(os.path.join(whole, "drafter", "model.safetensors"), "rb") as f:
        want = f.read()
    with open(os.path.join(cut, "drafter", "model.safetensors"), "rb") as f:
        got = f.read()
    assert got == want, "the resumed run's checkpoint differs from the uninterrupted one's"
    assert steps_logged(cut) == total, (steps_logged(cut), total)
    print(f"resume ok: SIGTERM at step {at} of {total}, the resumed checkpoint equals the "
          f"uninterrupted one ({len(want)} bytes)")


if __name__ == "__main__":
    main()
