"""The demo's summary and report layout, without a model or a server: what
pipeline.py makes of llama_spec.py's output and `dflash eval`'s JSON (the
llama_cpp and dflash2 parts of summary.json, the closing text) and what
plot.py draws from them, for the run kinds pipeline.py has:

  - the default run (untrained and trained drafters in llama.cpp, the live stage);
  - --arch both (DFlash 1 and DFlash 2 and the untrained drafter in llama.cpp),
    with and without the live stage;
  - --labels both (two trained drafters, no plain run, no untrained one);
  - --peers (the trainers' rows of bench/peer_trainers.py, what --check requires of them).

The inputs are made with the pipeline's own code where it has some
(llama_spec.summarize over per-prompt rows of the form run_config returns),
the eval dicts with the keys `dflash eval --json` prints.

    python examples/pipeline/test_summary.py OUT_DIR

Exit 77 when numpy or matplotlib is missing.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import matplotlib  # noqa: F401
    import numpy as np
except ImportError as e:
    print(f"skip: {e}")
    sys.exit(77)
import llama_spec  # noqa: E402
import pipeline  # noqa: E402
import plot  # noqa: E402

N_PROMPTS, MAX_NEW, N_DRAFT = 6, 32, 7


def eval_json(walk, pos, seed, dflash2=False):
    """A dict with the keys and shapes of `dflash eval --json` (block size 8)."""
    rng = np.random.default_rng(seed)
    acc = sorted(rng.uniform(0, 0.3, 7).round(4).tolist(), reverse=True)
    return {"block_size": 8, "tau": walk + 0.01, "blocks": 400, "accuracy": acc,
            "position_tau": pos, "position_tau_se": 0.011, "positions": 900,
            "position_accuracy": acc, "walk_tau": walk, "walk_tau_se": 0.013, "steps": 800,
            "tokens": int(800 * walk), "sequences": 30, "tokens_per_step_histogram": [1] * 8,
            "scored": 900, "selector_accuracy": acc[0] + 0.02 * dflash2,
            "backbone_accuracy": acc[0], "candidate_recall": 0.61 if dflash2 else None}


def spec_rows(accept_rate, seed, drafted=True):
    """Per-prompt rows as llama_spec.run_config returns them (tokens included)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(N_PROMPTS):
        n = MAX_NEW
        acc = int(rng.binomial(n // 2, accept_rate)) if drafted else 0
        steps = n - 1 - acc if drafted else 0
        rows.append({"id": f"p{i}", "tokens": list(range(n)), "stop": "limit",
                     "predicted_n": n, "predicted_ms": 1000.0 * n / (20 + 40 * accept_rate),
                     "prompt_n": 20, "prompt_ms": 100.0, "drafted": steps * N_DRAFT if drafted
                     else 0, "accepted": acc, "steps": steps})
    return rows


def spec_json(configs):
    """llama_spec.py's output file for configs [(name, draft or '', accept rate)]."""
    res = {"llama_dir": "/x", "version": ["version: 11434"], "samples": N_PROMPTS,
           "max_new": MAX_NEW, "threads": 1, "n_draft": N_DRAFT, "configs": {}}
    per_prompt, plain = {}, None
    for i, (name, draft, rate) in enumerate(configs):
        rows = spec_rows(rate, i, drafted=bool(draft))
        per_pos = [0.1 * rate] * N_DRAFT if draft else []
        s = llama_spec.summarize(rows, per_pos, plain)
        if not draft and plain is None:
            plain = rows
        res["configs"][name] = dict(s, draft=draft or None)
        per_prompt[name] = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    res["per_prompt"] = per_prompt
    return json.loads(json.dumps(res))  # as read back from the file


def metrics(n, start):
    return [{"step": i + 1, "loss": start * (0.99 ** i), "elapsed_s": 0.5 * i} for i in range(n)]


def labels(ax):
    return [t.get_text() for t in ax.get_xticklabels()]


def check_plot(s, rows2, want_tau, want_speed, out, name):
    fig = plot.figure(metrics(40, 8.0), s, rows2)
    got = labels(fig.axes[1])
    assert got == want_tau, f"{name}: tau bars {got}"
    if want_speed is None:
        assert len(fig.axes) == 3, f"{name}: {len(fig.axes)} panels"
    else:
        assert labels(fig.axes[3]) == want_speed, f"{name}: speed bars {labels(fig.axes[3])}"
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("DFlash 2" in x for x in legend) == bool(rows2), legend
    acc = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert ("DFlash 2" in acc) == ("dflash2" in s), acc
    # plot.py itself, from summary.json as pipeline.py runs it
    sj, mj, m2 = (os.path.join(out, f"{name}-{x}") for x in ("summary.json", "m.jsonl", "m2.jsonl"))
    with open(sj, "w") as f:
        json.dump(s, f)
    for p, rows in ((mj, metrics(40, 8.0)), (m2, rows2)):
        if rows:
            with open(p, "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))
    png = os.path.join(out, f"{name}.png")
    subprocess.run([sys.executable, os.path.join(HERE, "plot.py"), "--metrics", mj, "--summary", sj,
                    "-o", png] + (["--metrics2", m2] if rows2 else []), check=True,
                   stdout=subprocess.DEVNULL)
    assert os.path.getsize(png) > 10000, png


def live_part(s, spec):
    """The live stage's summary parts (pipeline.py's stage 8 on these prompts)."""
    rows = spec["per_prompt"]["trained"]
    s["live"] = {"tau": 1.1, "tau_se": 0.01, "steps": 500, "prompts": N_PROMPTS,
                 "per_prompt": [{"id": r["id"], "walk_tokens": r["predicted_n"] - 1,
                                 "walk_steps": r["predicted_n"] - 1 - r["accepted"]}
                                for r in rows]}
    s["llama_cpp"]["trained_vs_walk"] = dict(
        pipeline.stats.agreement("llama_cpp", {"tokens": [r["predicted_n"] - 1 for r in rows],
                                               "steps": [r["predicted_n"] - 1 - r["accepted"]
                                                         for r in rows]},
                                 "walk", {"tokens": [r["predicted_n"] - 1 for r in rows],
                                          "steps": [r["predicted_n"] - 1 - r["accepted"]
                                                    for r in rows]}),
        same_steps=len(rows), samples=len(rows))


def peer_row(tau, se, cpu, llama=None):
    r = {"tau": tau, "se": se, "cpu_s_per_step": cpu}
    if llama:
        r["llama_cpp"] = {"tokens_per_step": llama[0], "se": llama[1]}
    return r


def peers_demo(s1, out):
    """What a run with --peers must contain (pipeline.check_peers, which --check applies
    to it): every trainer's walk tau, llama.cpp tokens per step and CPU-s per step, in
    summary.json, the closing text and report.png's last panel."""
    drafters = {"libdflash": peer_row(1.086, 0.021, 0.305, (1.071, 0.018)),
                "specforge": peer_row(1.091, 0.022, 0.497, (1.069, 0.019)),
                "speculators": peer_row(1.093, 0.027, 0.646, (1.074, 0.02))}
    peers = {"recipe": "matched", "drafters": json.loads(json.dumps(drafters)), "wall_s": 1.0}
    pipeline.check_peers(peers)
    for k, broken in (("speculators", peer_row(1.09, 0.02, 0.6)),  # no llama.cpp
                      ("specforge", {"error": "specforge train failed"}),
                      ("libdflash", None)):
        d = dict(drafters, **{k: broken})
        if broken is None:
            del d[k]
        try:
            pipeline.check_peers({"drafters": d})
        except AssertionError as e:
            assert k in str(e), e
        else:
            raise AssertionError(f"check_peers passed without {k}'s full row: {d[k] if broken else None}")
    text = pipeline.peers_line(peers)
    for want in ("libdflash 1.086 +- 0.021, 1.071 +- 0.018, 0.305", "speculators 1.093"):
        assert want in text, f"{want!r} not in {text!r}"
    s4 = dict(s1, peers=peers)
    check_plot(s4, None, ["untrained\nuniform", "trained\nuniform", "untrained\nwalk",
                          "trained\nwalk", "trained\nPyTorch\nlive", "untrained\nllama.cpp",
                          "trained\nllama.cpp"],
               ["target alone", "untrained\ndrafter", "trained\ndrafter"], out, "peers")
    fig = plot.figure(metrics(40, 8.0), s4)
    assert len(fig.axes) == 5, len(fig.axes)
    got = labels(fig.axes[4])
    assert got == ["libdflash\n0.30 CPU-s/step", "specforge\n0.50 CPU-s/step",
                   "speculators\n0.65 CPU-s/step"], got
    heights = [round(b.get_height(), 3) for b in fig.axes[4].patches]
    assert heights == [1.086, 1.091, 1.093, 1.071, 1.069, 1.074], heights


def readme_figures():
    """README.md's sentence on the main job's time and tau (between its two
    "main-job sentence" comments) quotes examples/pipeline/README.md's table of the
    measured run (between its "main-job figures" comments, the rows pipeline.py prints
    at the end of a full run): every value of the table, and no figure that is not one."""
    root = os.path.dirname(os.path.dirname(HERE))
    with open(os.path.join(HERE, "README.md")) as f:
        table = f.read().split("<!-- main-job figures -->")
    with open(os.path.join(root, "README.md")) as f:
        sentence = f.read().split("<!-- main-job sentence -->")
    assert len(table) == 3 and len(sentence) == 3, "the markers are each there twice"
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", table[1], re.M))
    rows.pop("figure", None)  # the header
    for k in ("walk tau",):
        assert k in rows, f"examples/pipeline/README.md's table lacks {k!r}: {rows}"
    text = " ".join(sentence[1].split())
    for k, v in rows.items():
        assert v in text, f"README.md does not quote {k} = {v!r}:\n{text}"
    quoted = re.findall(r"\d+\.\d+ ± \d*\.\d+|\d+ min \d+ s|\d+\.\d+ CPU-min", text)
    for q in quoted:
        assert q in rows.values(), f"README.md quotes {q!r}, not in the table {rows}"
    # the rows pipeline.py prints are the table's form
    s = {"seconds": {"total": 1130.4}, "cpu_seconds": {"total": 2001.0},
         "eval_trained": eval_json(1.2891, 1.3, 0), "live": {"tau": 1.27, "tau_se": 0.022}}
    got = pipeline.main_job_figures(s)
    assert got[:3] == [("wall", "18 min 50 s"), ("CPU", "33.4 CPU-min"),
                       ("walk tau", "1.289 ± 0.013")], got


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    os.makedirs(out, exist_ok=True)
    gg = "/g"

    # --arch both: the untrained drafter is in llama.cpp too (the baseline of the table)
    args = pipeline.llama_drafters(gg, True)
    assert args == ["--config", "untrained=/g/untrained.gguf", "--config",
                    "trained=/g/drafter.gguf", "--config", "trained2=/g/drafter2.gguf"], args
    assert pipeline.llama_drafters(gg, False, untrained=False) == [
        "--config", "trained=/g/drafter.gguf"]
    configs = [("plain", "", 0)] + [(a.split("=")[0], a.split("=")[1], r)
                                    for a, r in zip(args[1::2], (0.0, 0.3, 0.6))]
    spec = spec_json(configs)
    assert spec["configs"]["untrained"]["accepted"] == 0, spec["configs"]["untrained"]
    s = {"eval_untrained": eval_json(1.0, 1.0, 0), "eval_trained": eval_json(1.08, 1.09, 1),
         "dflash2": {"config": pipeline.DFLASH2, "checkpoint": "/o/drafter2", "train_s": 10.0,
                     "final_loss": 7.0, "steps": 40, "eval_trained": eval_json(1.2, 1.21, 2, True)}}
    s["llama_cpp"] = lc = pipeline.llama_summary(spec, dflash2=True)
    for k in ("plain", "untrained", "trained", "trained2", "trained_vs_untrained",
              "dflash2_vs_dflash1", "dflash2_vs_dflash1_per_decode", "speedup_trained",
              "speedup_trained2"):
        assert k in lc, f"llama_cpp lacks {k}: {sorted(lc)}"
    d = lc["dflash2_vs_dflash1"]
    assert d["dflash2"] == lc["trained2"]["tokens_per_step"] and \
        d["dflash1"] == lc["trained"]["tokens_per_step"], (d, lc["trained"], lc["trained2"])
    assert lc["trained_vs_untrained"]["untrained"] == 1.0, lc["trained_vs_untrained"]
    s["dflash2"]["vs_dflash1"] = c = pipeline.dflash2_compare(s)
    assert c["walk_tau"]["diff"] == round(1.2 - 1.08, 4), c["walk_tau"]
    assert abs(c["walk_tau"]["combined_se"] - round(0.013 * 2 ** 0.5, 4)) < 1e-9, c["walk_tau"]
    assert c["llama_cpp"]["tokens_per_step"] == d and c["llama_cpp"]["untrained"]["accepted"] == 0
    assert c["selector"]["candidate_recall"] == 0.61, c["selector"]
    json.dumps(s)  # summary.json holds it
    text = pipeline.compare_line(s) + pipeline.llama_line(lc)
    s["seconds"] = {"total": 1.0}
    text += pipeline.result_lines(s, "/o/drafter", "/o")
    for want in ("DFlash 2 1.2000", "untrained 0/", "DFlash 2 - DFlash 1", "trained2"):
        assert want in text, f"{want!r} not in the closing text:\n{text}"
    tau_both = ["untrained\nuniform", "DFlash 1\nuniform", "DFlash 2\nuniform", "untrained\nwalk",
                "DFlash 1\nwalk", "DFlash 2\nwalk", "untrained\nllama.cpp", "DFlash 1\nllama.cpp",
                "DFlash 2\nllama.cpp"]
    speed_both = ["target alone", "untrained\ndrafter", "DFlash 1\ntrained", "DFlash 2\ntrained"]
    check_plot(s, metrics(40, 9.0), tau_both, speed_both, out, "arch-both-skip-live")

    # --arch both with the live stage: its text and plot
    live_part(s, spec)
    assert "vs walk" in pipeline.llama_line(s["llama_cpp"])
    check_plot(s, metrics(40, 9.0), tau_both[:6] + ["DFlash 1\nPyTorch\nlive"] + tau_both[6:],
               speed_both, out, "arch-both-live")

    # the default run (no DFlash 2), with the live stage
    spec1 = spec_json([("plain", "", 0), ("untrained", "/g/untrained.gguf", 0.0),
                       ("trained", "/g/drafter.gguf", 0.3)])
    s1 = {"eval_untrained": s["eval_untrained"], "eval_trained": s["eval_trained"],
          "llama_cpp": pipeline.llama_summary(spec1)}
    assert "trained2" not in s1["llama_cpp"] and "trained_vs_untrained" in s1["llama_cpp"]
    live_part(s1, spec1)
    pipeline.llama_line(s1["llama_cpp"])
    check_plot(s1, None, ["untrained\nuniform", "trained\nuniform", "untrained\nwalk",
                          "trained\nwalk", "trained\nPyTorch\nlive", "untrained\nllama.cpp",
                          "trained\nllama.cpp"],
               ["target alone", "untrained\ndrafter", "trained\ndrafter"], out, "default")

    # --peers: the trainers' rows, bench/peer_trainers.py --quick --json's last line
    peers_demo(s1, out)

    # the stage times pipeline.py writes (wall and CPU): a last panel, and the closing text
    s5 = dict(s1, seconds={"export": 5.0, "fetch": 200.0, "train": 400.0, "total": 700.0},
              cpu_seconds={"export": 4.0, "fetch": 380.0, "train": 395.0, "total": 900.0},
              resumed_stages=["fetch"], load_average=[2.0, 2.0, 2.0])
    fig = plot.figure(metrics(40, 8.0), s5)
    assert len(fig.axes) == 5, len(fig.axes)
    ax = fig.axes[4]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["export", "fetch", "train"]
    assert sorted(round(b.get_width()) for b in ax.patches) == [4, 5, 200, 380, 395, 400]
    assert "700 s wall, 900 CPU-s" in ax.get_title(), ax.get_title()
    text = pipeline.stage_table(s5)
    assert "fetch" in text and "380.0" in text and "(an earlier run)" in text, text
    fig = plot.figure(metrics(40, 8.0), dict(s5, peers={"drafters": {
        "libdflash": peer_row(1.086, 0.021, 0.305, (1.071, 0.018))}}))
    assert len(fig.axes) == 6 and labels(fig.axes[4]) == ["libdflash\n0.30 CPU-s/step"]

    readme_figures()

    # --labels both: two trained drafters, no plain run, no untrained drafter
    spec2 = spec_json([("trained", "/g/drafter.gguf", 0.3),
                       ("target_labels", "/g/drafter_target.gguf", 0.35)])
    lc2 = pipeline.llama_summary(spec2, labels_both=True)
    assert "target_vs_data_labels" in lc2 and "trained_vs_untrained" not in lc2, sorted(lc2)
    s2 = {"eval_untrained": s["eval_untrained"], "eval_trained": s["eval_trained"],
          "llama_cpp": lc2}
    pipeline.llama_line(lc2)
    check_plot(s2, None, ["untrained\nuniform", "trained\nuniform", "untrained\nwalk",
                          "trained\nwalk", "trained\nllama.cpp"], ["trained\ndrafter"], out,
               "labels-both")

    # no llama.cpp stage (serve.py): three panels
    s3 = {"eval_untrained": s["eval_untrained"], "eval_trained": s["eval_trained"]}
    check_plot(s3, None, ["untrained\nuniform", "trained\nuniform", "untrained\nwalk",
                          "trained\nwalk"], None, out, "no-llama")
    print(f"summary and plot layouts ok ({out})")


if __name__ == "__main__":
    main()
