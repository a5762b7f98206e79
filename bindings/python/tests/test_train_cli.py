"""`dflash train` / `dflash eval` end to end on synthetic data whose future
the hidden states determine: learning, and an exact resume after kill -9."""
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

import libdflash
from libdflash.hidden import write_dataset
from test_engine_checkpoint import launch

V, H, B = 17, 32, 4
CLI = os.environ.get("DFLASH_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="DFLASH_CLI not set (run through meson test)")


def make_world(root, n_train=64, n_test=16, S=40):
    """Token chains x[t+1] = perm_c[x[t]] with one of 4 permutations per
    sequence; every hidden state carries the sequence's code c. Given the
    context and the anchor token, the whole block is determined: the best
    achievable tau is B (minus anchors with no context at all)."""
    rng = np.random.default_rng(0)
    perms = [rng.permutation(16) for _ in range(4)]
    codes = rng.standard_normal((4, H)).astype(np.float32)

    def split(name, n):
        samples, hid = [], {}
        for i in range(n):
            c = int(rng.integers(4))
            x = [int(rng.integers(16))]
            for _ in range(S - 1):
                x.append(int(perms[c][x[-1]]))
            sid = f"{name}-{i}"
            samples.append((sid, np.array(x, np.int32), np.ones(S, np.uint8)))
            hid[sid] = codes[c][None] + 0.1 * rng.standard_normal((S, H)).astype(np.float32)
        write_dataset(root / name, samples)
        with libdflash.HiddenWriter(root / f"{name}-hidden", num_layers=1, hidden_size=H) as w:
            for sid, h in hid.items():
                w.append(sid, h)

    split("train", n_train)
    split("test", n_test)
    (root / "target").mkdir()
    libdflash.write_safetensors(root / "target" / "model.safetensors", {
        "model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
        "lm_head.weight": rng.standard_normal((V, H)).astype(np.float32)})
    cfg = {"architectures": ["DFlashDraftModel"], "hidden_size": H, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "vocab_size": V, "num_target_layers": 8, "block_size": B,
           "dflash_config": {"mask_token_id": 16, "target_layer_ids": [3]}}
    (root / "drafter.json").write_text(json.dumps(cfg))


def train_cmd(root, out, *extra):
    return [CLI, "train", "--config", str(root / "drafter.json"), "--target", str(root / "target"),
            "--data", str(root / "train"), "--hidden", str(root / "train-hidden"), "-o", str(out),
            "--threads", "2", "--batch", "4", "--anchors", "16", "--seed", "5", *extra]


def eval_tau(root, ckpt):
    out = subprocess.run([CLI, "eval", "--checkpoint", str(ckpt), "--target", str(root / "target"),
                          "--data", str(root / "test"), "--hidden", str(root / "test-hidden"),
                          "--anchors", "8"], capture_output=True, text=True, check=True).stdout
    return float(out.split()[1])


def test_training_reaches_near_optimal_tau(tmp_path):
    make_world(tmp_path)
    out = tmp_path / "run"
    subprocess.run(train_cmd(tmp_path, out, "--epochs", "1", "--max-steps", "1", "--lr", "0",
                             "--quiet"), check=True)
    before = eval_tau(tmp_path, out)
    subprocess.run(train_cmd(tmp_path, out, "--epochs", "90", "--lr", "1e-2", "--quiet",
                             "--overwrite"), check=True)
    after = eval_tau(tmp_path, out)
    print(f"held-out tau: {before:.3f} before training, {after:.3f} after (optimum {B})")
    assert before < 1.5
    assert after >= 0.9 * B
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 90 * 16
    assert json.loads(lines[-1])["loss"] < 0.1 * json.loads(lines[0])["loss"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"]["block_size"] == cfg["block_size"] == B
    # What an engine loads: every top-level *.safetensors holds only drafter weights.
    st = libdflash.SafeTensors(out)
    assert set(st.keys()) == set(libdflash.Trainer(cfg, np.zeros((V, H), np.float32),
                                                np.zeros((V, H), np.float32)).names())


def _stable(path):
    """Metrics without the timing fields."""
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        del r["tokens_per_s"], r["elapsed_s"]
    return rows


def test_resume_after_kill_is_exact(tmp_path):
    make_world(tmp_path, n_train=64)
    args = ["--epochs", "40", "--lr", "5e-3", "--save-every", "16", "--quiet"]
    subprocess.run(train_cmd(tmp_path, tmp_path / "full", *args), check=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(tmp_path, killed, *args))
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 150:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_killed = metrics.read_text().count("\n")
    assert n_killed < 640
    subprocess.run(train_cmd(tmp_path, killed, *args, "--resume"), check=True)
    assert _stable(metrics) == _stable(tmp_path / "full" / "metrics.jsonl")
    a = (tmp_path / "full" / "model.safetensors").read_bytes()
    b = (killed / "model.safetensors").read_bytes()
    assert a == b


def test_resume_before_the_first_save_starts_over(tmp_path):
    """A run killed before its first state save leaves train_state/ empty and some metrics
    lines: --resume starts it again from the first step and ends as the uninterrupted run
    (its metrics rewritten, not appended to). A folder that never held a run still fails."""
    make_world(tmp_path, n_train=16)
    args = ["--epochs", "2", "--lr", "5e-3", "--quiet"]
    subprocess.run(train_cmd(tmp_path, tmp_path / "full", *args), check=True)
    killed = tmp_path / "killed"
    (killed / "train_state").mkdir(parents=True)  # what a run makes at its start
    (killed / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # its first line
    subprocess.run(train_cmd(tmp_path, killed, *args, "--resume"), check=True)
    assert _stable(killed / "metrics.jsonl") == _stable(tmp_path / "full" / "metrics.jsonl")
    assert (killed / "model.safetensors").read_bytes() == \
        (tmp_path / "full" / "model.safetensors").read_bytes()
    typo = subprocess.run(train_cmd(tmp_path, tmp_path / "no-such-run", *args, "--resume"),
                          capture_output=True, text=True)
    assert typo.returncode != 0 and "DFLASH_E_NOT_FOUND" in typo.stderr, typo.stderr


def test_sigterm_saves_and_resumes_exactly(tmp_path):
    """SIGTERM (Slurm's preemption) without --save-every: the step in flight is finished, the
    state saved, exit 3; --resume gives the uninterrupted run's checkpoint byte for byte."""
    make_world(tmp_path, n_train=64)
    args = ["--epochs", "40", "--lr", "5e-3", "--quiet"]  # 16 steps an epoch
    subprocess.run(train_cmd(tmp_path, tmp_path / "full", *args), check=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(tmp_path, killed, *args), stderr=subprocess.PIPE, text=True)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 150:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate()[1]
    assert proc.returncode == 3, err
    assert "interrupted" in err and "state saved" in err and "--resume" in err, err
    n_stopped = metrics.read_text().count("\n")
    assert 150 <= n_stopped < 640 and (killed / "train_state" / "state.safetensors").exists()
    print(f"stopped after step {n_stopped} (step {n_stopped % 16} of its epoch)")
    subprocess.run(train_cmd(tmp_path, killed, *args, "--resume"), check=True)
    assert _stable(metrics) == _stable(tmp_path / "full" / "metrics.jsonl")
    assert (tmp_path / "full" / "model.safetensors").read_bytes() == \
        (killed / "model.safetensors").read_bytes()


def test_resume_refuses_changed_settings(tmp_path):
    """--resume with other hyperparameters is refused naming each change (the schedule and
    the data position would move silently); --allow-settings-change takes them."""
    make_world(tmp_path, n_train=16)
    out = tmp_path / "run"
    args = ["--epochs", "2", "--lr", "5e-3", "--quiet"]
    # Stopped early on purpose: the schedule stays the epochs' (--max-steps would end it).
    stop = ["--max-steps", "3", "--schedule-steps", "epochs"]
    subprocess.run(train_cmd(tmp_path, out, *args, *stop), check=True)
    state = (out / "train_state" / "state.safetensors").read_bytes()
    r = subprocess.run(train_cmd(tmp_path, out, "--epochs", "3", "--lr", "1e-3", "--quiet",
                                 "--resume"), capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    assert "lr 0.005 -> 0.001" in r.stderr and "epochs 2 -> 3" in r.stderr, r.stderr
    assert "batch" not in r.stderr.split("other settings")[1].split("(")[0]  # only the changes
    assert "--allow-settings-change" in r.stderr
    assert (out / "train_state" / "state.safetensors").read_bytes() == state  # untouched
    subprocess.run(train_cmd(tmp_path, out, *args, "--resume"), check=True)  # the same: fine
    subprocess.run(train_cmd(tmp_path, tmp_path / "b", *args, *stop), check=True)
    r = subprocess.run(train_cmd(tmp_path, tmp_path / "b", "--epochs", "3", "--quiet", "--resume",
                                 "--lr", "5e-3", "--allow-settings-change"),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert len(lrs) == 12
    # No jump: step 4 takes the rate the 2-epoch schedule had reached, then decays to 0.
    subprocess.run(train_cmd(tmp_path, tmp_path / "c", *args), check=True)
    two = [json.loads(x)["lr"] for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert lrs[:4] == two[:4], (lrs, two)
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:])) and lrs[-1] < 0.1 * lrs[3], lrs


def test_bad_sample_stops_with_state_saved(tmp_path):
    """A sample found bad mid-run (here: no target ids for --labels target, which the others
    have) stops the run naming it, with train_state/ saved as of the step before."""
    make_world(tmp_path, n_train=16)
    rng = np.random.default_rng(1)
    with libdflash.HiddenWriter(tmp_path / "t-hidden", num_layers=1, hidden_size=H) as w:
        for i in range(16):
            states = rng.standard_normal((40, H)).astype(np.float32)
            w.append(f"train-{i}", states, None if i == 9 else np.zeros(40, np.int32))
    out = tmp_path / "run"
    cmd = train_cmd(tmp_path, out, "--epochs", "2", "--quiet", "--labels", "target")
    cmd[cmd.index("--hidden") + 1] = str(tmp_path / "t-hidden")
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    assert "train-9" in r.stderr and "no target ids" in r.stderr, r.stderr
    assert "state saved in train_state/" in r.stderr and "--resume" in r.stderr, r.stderr
    assert (out / "train_state" / "state.safetensors").exists()


def eval_json(root, ckpt, hidden, *extra):
    r = subprocess.run([CLI, "eval", "--checkpoint", str(ckpt), "--target", str(root / "target"),
                        "--data", str(root / "test"), "--hidden", str(hidden), "--anchors", "8",
                        "--json", "--threads", "2", *extra], capture_output=True, text=True)
    return r.returncode, (json.loads(r.stdout) if r.returncode == 0 else r.stderr)


def test_eval_labels_target_compares_with_the_targets_tokens(tmp_path):
    """eval --labels target scores drafts against the store's target ids: equal to the data's
    next tokens, the numbers are the data labels' exactly; one token off everywhere, no draft
    of a drafter trained on the data is accepted but by chance (walk tau near 1). Each line
    names its labels."""
    make_world(tmp_path)
    out = tmp_path / "run"
    subprocess.run(train_cmd(tmp_path, out, "--epochs", "20", "--lr", "1e-2", "--quiet"),
                   check=True)
    data = libdflash.Dataset(tmp_path / "test")
    store = libdflash.HiddenStore(tmp_path / "test-hidden")
    for name, shift in (("same", 0), ("off", 1)):
        with libdflash.HiddenWriter(tmp_path / name, num_layers=1, hidden_size=H) as w:
            for i in range(len(data)):
                sid, ids, _ = data[i]
                nxt = np.append(ids[1:], ids[-1]).astype(np.int32)  # target_ids[t]: after t
                w.append(sid, store.read(sid), (nxt + shift) % 16)
    rc, base = eval_json(tmp_path, out, tmp_path / "same")
    assert rc == 0 and base["labels"] == "data", base
    rc, same = eval_json(tmp_path, out, tmp_path / "same", "--labels", "target")
    assert rc == 0 and same["labels"] == "target", same
    for k in ("walk_tau", "position_tau", "position_accuracy", "tokens", "steps"):
        assert same[k] == base[k], (k, same[k], base[k])
    assert base["walk_tau"] > 2
    rc, off = eval_json(tmp_path, out, tmp_path / "off", "--labels", "target")
    assert rc == 0 and off["walk_tau"] < 1.1 and off["walk_tau"] < base["walk_tau"] - 1, off
    rc, err = eval_json(tmp_path, out, tmp_path / "test-hidden", "--labels", "target")
    assert rc == 1 and "carries no target ids" in err, err
    text = subprocess.run([CLI, "eval", "--checkpoint", str(out), "--target",
                           str(tmp_path / "target"), "--data", str(tmp_path / "test"),
                           "--hidden", str(tmp_path / "same"), "--labels", "target"],
                          capture_output=True, text=True, check=True).stdout
    assert "walk tau" in text and "(target labels)" in text and "data labels" in text, text


@pytest.mark.parametrize("pruned", [False, True], ids=["full", "pruned"])
def test_dspark_launch_lines(tmp_path, pruned):
    """A DSpark drafter's summary prints DSpark's flags: vLLM's method "dspark" with
    block_size slots, SGLang's DSPARK with block_size + 1 draft tokens, and no SGLang line
    for a pruned vocabulary (test_engine_checkpoint.py: SGLang refuses it)."""
    make_world(tmp_path, n_train=4, n_test=1)
    cfg = json.loads((tmp_path / "drafter.json").read_text())
    cfg.update(architectures=["Qwen3DSparkModel"], tie_word_embeddings=False, markov_rank=4,
               markov_head_type="vanilla", enable_confidence_head=True,
               confidence_head_with_markov=True, sample_from_anchor=True)
    if pruned:
        cfg["draft_vocab_size"] = 8
    (tmp_path / "drafter.json").write_text(json.dumps(cfg))
    out = tmp_path / "run"
    r = subprocess.run(train_cmd(tmp_path, out, "--max-steps", "1", "--quiet"),
                       capture_output=True, text=True, check=True)
    assert json.loads(r.stdout)["launch"] == launch(out, B, "float32", dspark=True,
                                                    pruned=pruned), r.stdout


def test_never_overwrites_by_accident(tmp_path):
    """A non-empty -o without --resume is refused and left as it was; --overwrite replaces it;
    the run ends with a JSON summary on stdout; the progress total follows --max-steps."""
    make_world(tmp_path, n_train=16, n_test=1)
    out = tmp_path / "run"
    r = subprocess.run(train_cmd(tmp_path, out, "--epochs", "3", "--max-steps", "5"),
                       capture_output=True, text=True, check=True)
    summary = json.loads(r.stdout)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary == {"steps": 5, "epoch": last["epoch"], "tokens": last["tokens"],
                       "final_loss": last["loss"], "elapsed_s": last["elapsed_s"],
                       "checkpoint": str(out), "launch": launch(out, B, "float32")}, (summary, last)
    # 3 epochs of 4 steps would be 12: the bar and ETA stop at --max-steps.
    assert "5/5" in r.stderr and "/12" not in r.stderr, r.stderr
    model = (out / "model.safetensors").read_bytes()
    r = subprocess.run(train_cmd(tmp_path, out, "--epochs", "1", "--seed", "9", "--quiet"),
                       capture_output=True, text=True)
    assert r.returncode == 1 and "is not empty" in r.stderr and "--overwrite" in r.stderr
    assert (out / "model.safetensors").read_bytes() == model
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 5
    r = subprocess.run(train_cmd(tmp_path, out, "--resume", "--overwrite", "--quiet"),
                       capture_output=True, text=True)
    assert r.returncode == 2 and "exclude" in r.stderr
    r = subprocess.run(train_cmd(tmp_path, out, "--epochs", "1", "--quiet", "--overwrite"),
                       capture_output=True, text=True, check=True)
    assert json.loads(r.stdout)["steps"] == 4
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    (tmp_path / "empty").mkdir()  # an existing but empty folder is fine
    subprocess.run(train_cmd(tmp_path, tmp_path / "empty", "--max-steps", "1", "--quiet"),
                   capture_output=True, check=True)


def test_resume_with_no_step_left_reports_the_saved_run(tmp_path):
    """--resume at --max-steps trains nothing and writes no line, and its summary (from the
    run's stats, not metrics.jsonl) is the saved run's, to the digit."""
    make_world(tmp_path, n_train=16, n_test=1)
    out = tmp_path / "run"
    cmd = train_cmd(tmp_path, out, "--epochs", "3", "--max-steps", "2", "--quiet")
    first = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    again = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, check=True)
    assert json.loads(again.stdout) == first, (again.stdout, first)
    assert first["steps"] == 2 and first["final_loss"] > 0, first
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_cli_reports_bad_inputs(tmp_path):
    make_world(tmp_path, n_train=4, n_test=1)
    cfg = json.loads((tmp_path / "drafter.json").read_text())
    cfg["hidden_size"] = 48
    cfg["intermediate_size"] = 64
    (tmp_path / "bad.json").write_text(json.dumps(cfg))
    cmd = train_cmd(tmp_path, tmp_path / "o", "--quiet")
    cmd[cmd.index("--config") + 1] = str(tmp_path / "bad.json")
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 1 and "K*H = 1*48" in r.stderr
    (tmp_path / "target" / "model.safetensors").unlink()
    libdflash.write_safetensors(tmp_path / "target" / "model.safetensors",
                             {"other.weight": np.zeros((V, H), np.float32)})
    r = subprocess.run(train_cmd(tmp_path, tmp_path / "o2", "--quiet"), capture_output=True,
                       text=True)
    assert r.returncode == 1 and "no token embedding" in r.stderr
    assert not (tmp_path / "o2" / "model.safetensors").exists()


@pytest.mark.parametrize("args", [
    ["train", "--config", "c", "--target", "t", "--data", "d", "--hidden", "h", "-o", "o",
     "--epochs", "8x"],
    ["train", "--config", "c", "--target", "t", "--data", "d", "--hidden", "h", "-o", "o",
     "--lr", "abc"],
    ["train", "--plan", "--config", "c", "--world", "0"],
    ["eval", "--checkpoint", "c", "--target", "t", "--data", "d", "--hidden", "h",
     "--anchors", "sixty"],
    ["eval", "--checkpoint", "c", "--target", "t", "--data", "d", "--hidden", "h",
     "--max-tokens", "-1"],
    ["tokenize", "--tokenizer", "t", "--template", "smollm2", "-o", "o", "--threads", "2.5",
     "in.jsonl"],
])
def test_malformed_numbers_are_usage_errors(args):
    """A number option that does not parse whole (atoi would read "8x" as 8 and
    "abc" as 0) is refused before any work, naming the option and the value."""
    r = subprocess.run([CLI] + args, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    opt, val = args[-2], args[-1]
    if args[0] == "tokenize":
        opt, val = args[-3], args[-2]
    assert f"{opt} wants" in r.stderr and f"'{val}'" in r.stderr, r.stderr
