"""out/report.png: training loss (and its moving average) by step, held-out
tau (uniform anchors and speculative walk, untrained / trained; PyTorch live;
llama.cpp's tokens per verification step), per-position accuracy over every
anchor position, and llama.cpp's decode speed with and without the drafters.
With a DFlash 2 drafter (pipeline.py --arch both) each panel shows it beside
the DFlash 1 one: its loss, walk and every-position tau, llama.cpp's tokens per
verification step and decode speed, per-position accuracy. With pipeline.py
--peers a last panel has the trainers at matched settings (libdflash, SpecForge,
speculators): walk tau and llama.cpp's tokens per verification step, CPU-s per step.
With summary.json's stage times (pipeline.py writes "seconds" and "cpu_seconds") the
last panel has each stage's wall and CPU seconds.

    python plot.py --metrics out/drafter/metrics.jsonl --summary out/summary.json \
        [--metrics2 out/drafter2/metrics.jsonl] -o out/report.png
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path):
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def moving_average(loss, k):
    return [sum(loss[max(0, i - k + 1):i + 1]) / len(loss[max(0, i - k + 1):i + 1])
            for i in range(len(loss))]


def tau_bars(s):
    """The tau panel's bars: (label, tau, SE, colour), in order."""
    u, t, lv = s["eval_untrained"], s["eval_trained"], s.get("live")
    two = "dflash2" in s
    sp = s.get("dspark", {}).get("eval_trained")
    tr = "DFlash 1" if two or sp else "trained"
    bars = [("untrained\nuniform", u["position_tau"], u["position_tau_se"], "#999"),
            (f"{tr}\nuniform", t["position_tau"], t["position_tau_se"], "#1f77b4")]
    if two:
        e2 = s["dflash2"]["eval_trained"]
        bars.append(("DFlash 2\nuniform", e2["position_tau"], e2["position_tau_se"], "#17becf"))
    bars += [("untrained\nwalk", u["walk_tau"], u["walk_tau_se"], "#bbb"),
             (f"{tr}\nwalk", t["walk_tau"], t["walk_tau_se"], "#ff7f0e")]
    if two:
        bars.append(("DFlash 2\nwalk", e2["walk_tau"], e2["walk_tau_se"], "#9467bd"))
    if sp:
        bars.append(("DSpark\nwalk", sp["walk_tau"], sp["walk_tau_se"], "#e377c2"))
    if lv:  # pipeline.py --skip-live leaves it out
        bars.append((f"{tr}\nPyTorch\nlive", lv["tau"], lv["tau_se"], "#2ca02c"))
    lc = s.get("llama_cpp") or {}
    for name, label, c in (("untrained", "untrained", "#ccc"), ("trained", tr, "#d62728"),
                           ("trained2", "DFlash 2", "#8c564b"), ("dspark", "DSpark", "#bcbd22")):
        if name in lc and "tokens_per_step" in lc[name]:
            bars.append((f"{label}\nllama.cpp", lc[name]["tokens_per_step"],
                         lc[name]["tokens_per_step_se"], c))
    return bars


def speed_bars(s):
    """llama.cpp's decode speed panel: (label, tok/s, bar text, colour)."""
    lc, two = s["llama_cpp"], "dflash2" in s
    label = {"plain": ("target alone", "#999"), "untrained": ("untrained\ndrafter", "#ccc"),
             "trained": ("DFlash 1\ntrained" if two else "trained\ndrafter", "#d62728"),
             "trained2": ("DFlash 2\ntrained", "#8c564b"), "dspark": ("DSpark\ntrained", "#bcbd22")}
    out = []
    for k, (name, c) in label.items():
        if k not in lc:
            continue
        text = f"{lc[k]['decode_tok_s']:.1f} tok/s"
        if "acceptance" in lc[k]:
            text += f"\naccepted {lc[k]['acceptance']:.3f}"
        out.append((name, lc[k]["decode_tok_s"], text, c))
    return out


def peer_bars(s):
    """The peers panel (pipeline.py --peers): per drafter (label with its CPU-s per
    step, walk tau, SE, llama.cpp tokens per step, SE; None where llama.cpp did not run)."""
    out = []
    for name, r in s["peers"]["drafters"].items():
        if "tau" not in r:
            continue
        lc = r.get("llama_cpp") or {}
        out.append((f"{name}\n{r['cpu_s_per_step']:.2f} CPU-s/step", r["tau"], r["se"],
                    lc.get("tokens_per_step"), lc.get("se")))
    return out


def draw_peers(ax, s):
    names, taus, ses, lts, lses = zip(*peer_bars(s))
    x = range(len(names))
    bars = ax.bar([i - 0.2 for i in x], taus, 0.4, yerr=[2 * e for e in ses], capsize=4,
                  color="#ff7f0e", label="walk (dflash eval)")
    ax.bar_label(bars, fmt="%.3f", label_type="center", fontsize=8)
    have = [i for i in x if lts[i] is not None]
    if have:
        bars = ax.bar([i + 0.2 for i in have], [lts[i] for i in have], 0.4,
                      yerr=[2 * lses[i] for i in have], capsize=4, color="#d62728",
                      label="llama.cpp")
        ax.bar_label(bars, fmt="%.3f", label_type="center", fontsize=8)
    ax.set_xticks(list(x), names, fontsize=8)
    ax.set(ylabel="tau (tokens per verification step)", ylim=(0.9, None),
           title="trainers at matched settings (bars: 2 SE)")
    ax.legend(fontsize=8)


def stage_rows(s):
    """(stage, wall s, CPU s) of each stage that ran, in order ("total" left out)."""
    w, c = s.get("seconds", {}), s.get("cpu_seconds", {})
    return [(k, w[k], c[k]) for k in w if k != "total" and k in c]


def draw_stages(ax, s):
    """Wall and CPU (user + system, children included) seconds of each stage, as
    pipeline.py measured them; stages that ran beside another (llama.cpp's runs beside the
    training, the live check beside llama.cpp) have more wall than their share."""
    rows = stage_rows(s)
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], [r[1] for r in rows], height=0.4, label="wall")
    ax.barh([i + 0.2 for i in y], [r[2] for r in rows], height=0.4, label="CPU (user + sys)")
    ax.set_yticks(list(y), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    tw, tc = s["seconds"].get("total"), s["cpu_seconds"].get("total")
    ax.set(xlabel="seconds", title=f"stages: {tw:.0f} s wall, {tc:.0f} CPU-s in all"
           if tw is not None and tc is not None else "stages")
    ax.legend(fontsize=8)


def figure(rows, s, rows2=None):
    """The report's figure: rows = metrics.jsonl of the DFlash 1 run, s = summary.json
    (eval_untrained, eval_trained; live, llama_cpp, dflash2 when there), rows2 = the
    DFlash 2 run's metrics.jsonl."""
    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    k = max(1, len(loss) // 20)
    lc = s.get("llama_cpp")
    stages = bool(stage_rows(s))
    widths = ([1, 2, 1, 1] if lc else [1, 1.4, 1]) + [1.2] * ("peers" in s) + [1] * stages
    fig, ax = plt.subplots(1, len(widths), figsize=(5.5 * sum(widths) / 1.2 + 1, 4.8),
                           gridspec_kw={"width_ratios": widths})
    two = "dflash2" in s
    ax[0].plot(steps, loss, lw=0.5, alpha=0.4, label="loss per step")
    ax[0].plot(steps, moving_average(loss, k), lw=1.8,
               label=f"{'DFlash 1, ' if two else ''}moving average ({k} steps)")
    if rows2:  # block CE + selector CE
        ax[0].plot([r["step"] for r in rows2], moving_average([r["loss"] for r in rows2], k),
                   lw=1.8, label="DFlash 2 (block + selector CE), moving average")
    ax[0].set(xlabel="optimizer step", ylabel="weighted cross-entropy", title="dflash train",
              yscale="log")
    ax[0].legend(fontsize=8)
    # Every-position (uniform-anchor) tau, the speculative walk's tau (what
    # live decoding should get), the live tau and llama.cpp's, 2-SE error bars.
    names, taus, ses, colors = zip(*tau_bars(s))
    bars = ax[1].bar(names, taus, yerr=[2 * x for x in ses], capsize=4, color=colors)
    ax[1].bar_label(bars, fmt="%.3f", label_type="center")
    ax[1].tick_params(axis="x", labelsize=8)
    ax[1].set(ylabel="tau (tokens per verification step)",
              title="held-out acceptance length (bars: 2 SE)", ylim=(0.9, None))
    for name in ("untrained", "trained"):
        acc = s[f"eval_{name}"]["position_accuracy"]
        ax[2].plot(range(1, len(acc) + 1), acc, marker="o",
                   label="DFlash 1" if two and name == "trained" else name)
    if two:
        acc = s["dflash2"]["eval_trained"]["position_accuracy"]
        ax[2].plot(range(1, len(acc) + 1), acc, marker="o", label="DFlash 2")
    if "dspark" in s:  # its block's slot k drafts position k + 1, as DFlash's position k + 1
        acc = s["dspark"]["eval_trained"]["position_accuracy"]
        ax[2].plot(range(1, len(acc) + 1), acc, marker="o", label="DSpark")
    ax[2].set(xlabel="block position", ylabel="greedy accuracy", title="per-position accuracy",
              ylim=(0, 1))
    ax[2].legend()
    if lc:
        names, speeds, texts, colors = zip(*speed_bars(s))
        bars = ax[3].bar(names, speeds, color=colors)
        ax[3].bar_label(bars, labels=texts, label_type="center", fontsize=8)
        ax[3].tick_params(axis="x", labelsize=8)
        ax[3].set(ylabel="decode tokens/s",
                  title=f"llama-server decoding, {lc['threads']} thread, "
                        f"{lc['trained']['prompts']} prompts")
    if "peers" in s:  # pipeline.py --peers
        draw_peers(ax[len(widths) - 1 - stages], s)
    if stages:
        draw_stages(ax[-1], s)
    fig.tight_layout()
    return fig


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--metrics", required=True, help="metrics.jsonl of dflash train")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--summary", help="summary.json of pipeline.py")
    g.add_argument("--summary-in",
                   help="the same as JSON text: eval_untrained, eval_trained; live, llama_cpp, "
                        "dflash2 (optional)")
    ap.add_argument("--metrics2", default=None,
                    help="metrics.jsonl of the DFlash 2 drafter (pipeline.py --arch both)")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    if a.summary:
        with open(a.summary) as f:
            s = json.load(f)
    else:
        s = json.loads(a.summary_in)
    fig = figure(read_metrics(a.metrics), s, read_metrics(a.metrics2) if a.metrics2 else None)
    fig.savefig(a.out, dpi=110)
    print(a.out)


if __name__ == "__main__":
    main()
