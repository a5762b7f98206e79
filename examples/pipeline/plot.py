"""out/report.png: training loss (and its moving average) by step, held-out
tau (uniform anchors and speculative walk, untrained / trained; PyTorch live;
llama.cpp's tokens per verification step), per-position accuracy over every
anchor position, and llama.cpp's decode speed with and without the drafters."""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_dflash2_loss(ax, path, k):
    """The DFlash 2 drafter's loss (block CE + selector CE), moving average."""
    with open(path) as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    loss = [r["loss"] for r in rows]
    avg = [sum(loss[max(0, i - k + 1):i + 1]) / len(loss[max(0, i - k + 1):i + 1])
           for i in range(len(loss))]
    ax.plot([r["step"] for r in rows], avg, lw=1.8, label="DFlash 2, moving average")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--metrics", required=True, help="metrics.jsonl of dflash train")
    ap.add_argument("--summary-in", required=True,
                    help="JSON: eval_untrained, eval_trained, live, llama_cpp (optional)")
    ap.add_argument("--metrics2", default=None,
                    help="metrics.jsonl of the DFlash 2 drafter (pipeline.py --arch both)")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    with open(a.metrics) as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    s = json.loads(a.summary_in)
    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    k = max(1, len(loss) // 20)
    avg = [sum(loss[max(0, i - k + 1):i + 1]) / len(loss[max(0, i - k + 1):i + 1])
           for i in range(len(loss))]
    lc = s.get("llama_cpp")
    fig, ax = plt.subplots(1, 4 if lc else 3, figsize=(21 if lc else 15, 4.6),
                           gridspec_kw={"width_ratios": [1, 1.7, 1, 1] if lc else [1, 1, 1]})
    ax[0].plot(steps, loss, lw=0.5, alpha=0.4, label="loss per step")
    ax[0].plot(steps, avg, lw=1.8, label=f"moving average ({k} steps)")
    if a.metrics2:
        plot_dflash2_loss(ax[0], a.metrics2, k)
    ax[0].set(xlabel="optimizer step", ylabel="weighted cross-entropy", title="dflash train",
              yscale="log")
    ax[0].legend()
    # Every-position (uniform-anchor) tau, the speculative walk's tau (what
    # live decoding should get) and the live tau, with 2-SE error bars.
    u, t, lv = s["eval_untrained"], s["eval_trained"], s.get("live")
    names = ["untrained\nuniform", "trained\nuniform", "untrained\nwalk", "trained\nwalk"]
    taus = [u["position_tau"], t["position_tau"], u["walk_tau"], t["walk_tau"]]
    ses = [u["position_tau_se"], t["position_tau_se"], u["walk_tau_se"], t["walk_tau_se"]]
    colors = ["#999", "#1f77b4", "#bbb", "#ff7f0e"]
    if lv:  # pipeline.py --skip-live leaves it out
        names.append("trained\nPyTorch\nlive")
        taus.append(lv["tau"])
        ses.append(lv["tau_se"])
        colors.append("#2ca02c")
    if "dflash2" in s:
        e2 = s["dflash2"]["eval_trained"]
        names.append("DFlash 2\nwalk")
        taus.append(e2["walk_tau"])
        ses.append(e2["walk_tau_se"])
        colors.append("#9467bd")
    if lc:
        for name, c in (("untrained", "#ccc"), ("trained", "#d62728"), ("trained2", "#8c564b")):
            if name not in lc:
                continue
            names.append("DFlash 2\nllama.cpp" if name == "trained2" else f"{name}\nllama.cpp")
            taus.append(lc[name]["tokens_per_step"])
            ses.append(lc[name]["tokens_per_step_se"])
            colors.append(c)
    bars = ax[1].bar(names, taus, yerr=[2 * x for x in ses], capsize=4, color=colors)
    ax[1].bar_label(bars, fmt="%.3f", label_type="center")
    ax[1].tick_params(axis="x", labelsize=8)
    ax[1].set(ylabel="tau (tokens per verification step)",
              title="held-out acceptance length (bars: 2 SE)", ylim=(0.9, None))
    for name in ("untrained", "trained"):
        acc = s[f"eval_{name}"]["position_accuracy"]
        ax[2].plot(range(1, len(acc) + 1), acc, marker="o", label=name)
    if "dflash2" in s:
        acc = s["dflash2"]["eval_trained"]["position_accuracy"]
        ax[2].plot(range(1, len(acc) + 1), acc, marker="o", label="DFlash 2 trained")
    ax[2].set(xlabel="block position", ylabel="greedy accuracy", title="per-position accuracy",
              ylim=(0, 1))
    ax[2].legend()
    if lc:
        label = {"plain": ("target alone", "#999"), "untrained": ("untrained\ndrafter", "#ccc"),
                 "trained": ("trained\ndrafter", "#d62728"),
                 "trained2": ("DFlash 2\ntrained", "#8c564b")}
        keys = [k for k in label if k in lc]
        bars = ax[3].bar([label[k][0] for k in keys], [lc[k]["decode_tok_s"] for k in keys],
                         color=[label[k][1] for k in keys])
        ax[3].bar_label(bars, labels=[f"{lc['plain']['decode_tok_s']:.1f} tok/s"] + [
            f"{lc[k]['decode_tok_s']:.1f} tok/s\naccepted {lc[k]['acceptance']:.3f}" for k in keys[1:]],
            label_type="center")
        ax[3].set(ylabel="decode tokens/s",
                  title=f"llama-server decoding, {lc['threads']} thread")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(a.out)


if __name__ == "__main__":
    main()
