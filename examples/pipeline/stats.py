"""Standard errors for tau = sum(tokens) / sum(steps) over prompts, the unit
that is sampled: a bootstrap over prompts (seeded), also for the paired
difference of two measurements on the same prompts."""
import numpy as np


def ratio(tokens, steps):
    t, s = np.asarray(tokens, float), np.asarray(steps, float)
    return float(t.sum() / s.sum()) if s.sum() else 0.0


def bootstrap(pairs, n=2000, seed=0):
    """pairs: list of (tokens[], steps[]) per measurement, each over the same
    prompts. Returns (values, standard errors, se of values[0]-values[1]
    when two are given)."""
    rng = np.random.default_rng(seed)
    m = len(pairs[0][0])
    arrs = [(np.asarray(t, float), np.asarray(s, float)) for t, s in pairs]
    idx = rng.integers(0, m, size=(n, m))
    boots = [t[idx].sum(1) / np.maximum(s[idx].sum(1), 1) for t, s in arrs]
    values = [ratio(t, s) for t, s in arrs]
    ses = [float(b.std(ddof=1)) for b in boots]
    diff_se = float((boots[0] - boots[1]).std(ddof=1)) if len(boots) > 1 else None
    return values, ses, diff_se


def agreement(name_a, a, name_b, b, n=2000, seed=0):
    """a, b: dicts with per-prompt 'tokens' and 'steps' lists (same prompts).
    Agreement: |a - b| < 2 x the bootstrap SE of the paired difference."""
    (va, vb), (sa, sb), sd = bootstrap([(a["tokens"], a["steps"]), (b["tokens"], b["steps"])],
                                       n, seed)
    diff = va - vb
    return {name_a: round(va, 4), name_a + "_se": round(sa, 4), name_b: round(vb, 4),
            name_b + "_se": round(sb, 4), "diff": round(diff, 4), "diff_se": round(sd, 4),
            "combined_se": round(float(np.hypot(sa, sb)), 4),
            "z": round(diff / sd, 2) if sd else None,
            "agree": bool(abs(diff) < 2 * sd) if sd else abs(diff) < 1e-12}
