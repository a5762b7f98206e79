"""DSpark's loss and its gradients (spec/dspark.md sections 1-2), written from the spec in
float64 PyTorch autograd, against libdflash's CPU pass (df_dspark_loss, through
tests/train/dspark_loss_tool). argv[1]: the tool. Exit 77 (skipped) without torch.

Per supervised row: e = W1[prev], z = E x + W2 e, p = softmax(z), q = softmax(E xt),
CE = -log p[label], L1 = sum |p - q|, c* = clamp(1 - L1/2, 0, 1) detached,
s = w.[x; e] + b, BCE = BCE-with-logits(s, c*). Loss = sum coef (a_ce CE + a_l1 L1 + a_conf BCE).
"""
import os
import struct
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    print("torch is not installed: skipped")
    sys.exit(77)

import numpy as np

TOOL = sys.argv[1]


def reference(x, xt, E, W1, W2, cw, cb, prev, target, coef, alphas, detach=True):
    x = x.clone().requires_grad_(True)
    W1 = W1.clone().requires_grad_(True)
    W2 = W2.clone().requires_grad_(True)
    cw = cw.clone().requires_grad_(True) if cw is not None else None
    cb = cb.clone().requires_grad_(True) if cb is not None else None
    e = W1[prev]                                     # [R, r], a gather: sparse gradient
    z = x @ E.T + e @ W2.T                           # the Markov bias on the LM head's logits
    logp = torch.log_softmax(z, dim=-1)
    ce = -logp.gather(1, target[:, None])[:, 0]
    zero = torch.zeros_like(ce)
    l1, bce, conf, cstar = zero, zero, zero, zero
    if xt is not None:
        p = logp.exp()
        q = torch.softmax(xt @ E.T, dim=-1)
        l1 = (p - q).abs().sum(-1)                   # full L1 = 2 TV, not halved
        if cw is not None:
            cstar = (1 - 0.5 * l1).clamp(0, 1)
            if detach:
                cstar = cstar.detach()
            s = torch.cat([x, e], dim=-1) @ cw + cb
            bce = torch.nn.functional.binary_cross_entropy_with_logits(s, cstar,
                                                                       reduction="none")
            conf = torch.sigmoid(s)
    a_ce, a_l1, a_conf = alphas
    loss = (coef * (a_ce * ce + a_l1 * l1 + a_conf * bce)).sum()
    loss.backward()
    sums = [(coef * t).sum().item() for t in (ce, l1, bce)]
    g = lambda t: t.grad if t is not None and t.grad is not None else None
    return dict(sums=sums, dx=x.grad, dw1=W1.grad, dw2=W2.grad, dcw=g(cw), dcb=g(cb),
                conf=conf.detach(), cstar=cstar.detach())


def run_tool(case):
    R, H, V, r = case["R"], case["H"], case["V"], case["r"]
    xt, cw = case["xt"], case["cw"]
    f32 = lambda t: t.to(torch.float32).numpy().tobytes()
    i32 = lambda t: t.to(torch.int32).numpy().tobytes()
    blob = struct.pack("7i", R, H, V, r, xt is not None, cw is not None, case["chunk"])
    blob += struct.pack("3f", *case["alphas"])
    blob += f32(case["x"]) + (f32(xt) if xt is not None else b"") + f32(case["E"])
    blob += f32(case["W1"]) + f32(case["W2"])
    if cw is not None:
        blob += f32(torch.cat([cw, case["cb"].reshape(1)]))
    blob += i32(case["prev"]) + i32(case["target"]) + f32(case["coef"])
    with tempfile.TemporaryDirectory() as d:
        fin, fout = os.path.join(d, "in"), os.path.join(d, "out")
        with open(fin, "wb") as f:
            f.write(blob)
        subprocess.run([TOOL, fin, fout], check=True)
        raw = open(fout, "rb").read()
    sums = struct.unpack("3d", raw[:24])
    a = np.frombuffer(raw[24:], dtype=np.float32).astype(np.float64)
    out, o = {"sums": list(sums)}, 0
    for name, n in (("dx", R * H), ("dw1", V * r), ("dw2", V * r), ("dcw", H + r), ("dcb", 1),
                    ("conf", R), ("cstar", R)):
        out[name] = torch.from_numpy(a[o:o + n].copy())
        o += n
    return out


def make_case(seed, R, H, V, r, with_xt, with_cw, chunk, alphas=(0.1, 0.9, 1.0), sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    # float32-representable inputs, so that both sides see the same numbers
    q = lambda t: t.to(torch.float32).to(torch.float64)
    case = dict(R=R, H=H, V=V, r=r, chunk=chunk, alphas=alphas,
                x=q(rn(R, H)), E=q(rn(V, H) * sharp / H ** 0.5), W1=q(rn(V, r) * 0.5),
                W2=q(rn(V, r) * 0.5), xt=q(rn(R, H)) if with_xt else None,
                cw=q(rn(H + r) * 0.3) if with_cw else None, cb=q(rn(1)[0] * 0.3),
                # repeated previous tokens: W1's scatter must add, not overwrite
                prev=torch.randint(0, min(V, 3), (R,), generator=g),
                target=torch.randint(0, V, (R,), generator=g),
                coef=q(torch.rand(R, generator=g, dtype=torch.float64) + 0.1))
    return case


def rel(a, b):
    a, b = a.reshape(-1), b.reshape(-1)
    return ((a - b).abs().max() / max(b.abs().max().item(), 1e-30)).item()


# float32 logits and GEMMs against float64, relative to a tensor's largest entry (1.1e-5 seen
# in the sharp case, 4e-7 in the others); a wrong term is off by 1e-2 or more
TOL = 5e-5


def check(name, case, want_nonzero=("dx", "dw1", "dw2")):
    ref = reference(case["x"], case["xt"], case["E"], case["W1"], case["W2"], case["cw"],
                    case["cb"] if case["cw"] is not None else None, case["prev"],
                    case["target"], case["coef"], case["alphas"])
    got = run_tool(case)
    bad, worst = [], 0.0
    for k in range(3):
        want, have = ref["sums"][k], got["sums"][k]
        if abs(want - have) > TOL * max(abs(want), 1e-3):
            bad.append(f"sum {('ce', 'l1', 'bce')[k]}: {have} vs {want}")
    for key in ("dx", "dw1", "dw2", "dcw", "dcb", "conf", "cstar"):
        want = ref[key]
        if want is None:
            want = torch.zeros_like(got[key])
        if key in want_nonzero and want.abs().max() == 0:
            bad.append(f"{key}: the reference gradient is zero (a vacuous case)")
        e = rel(got[key], want.reshape(-1)) if want.abs().max() > 0 else got[key].abs().max().item()
        worst = max(worst, e)
        if e > TOL:
            bad.append(f"{key}: max error {e:.3g} of its scale")
    has_conf = case["cw"] is not None and case["xt"] is not None
    clamped = int((ref["cstar"] == 0).sum()) if has_conf else 0
    print(f"{name}: {'FAIL ' + '; '.join(bad) if bad else 'ok'} (largest error {worst:.2g} of "
          f"a tensor's scale; rows with c* = 0: {clamped})")
    return not bad


def main():
    ok = True
    cases = [
        ("all terms", make_case(1, 6, 16, 40, 8, True, True, 4)),
        ("all terms, one chunk", make_case(2, 5, 12, 33, 4, True, True, 0)),
        ("no confidence head", make_case(3, 4, 8, 20, 4, True, False, 3)),
        ("CE only (no target state)", make_case(4, 4, 8, 20, 4, False, True, 2)),
        ("sharp: p and q disjoint on a row (c* = 0)", make_case(5, 6, 16, 40, 8, True, True, 4,
                                                           sharp=40.0)),
        ("other weights", make_case(6, 7, 16, 50, 8, True, True, 3, alphas=(1.0, 0.5, 2.0))),
    ]
    for name, c in cases:
        want_nonzero = ("dx", "dw1", "dw2") + (("dcw", "dcb") if c["cw"] is not None and
                                               c["xt"] is not None else ())
        ok &= check(name, c, want_nonzero)
    # The stop-gradient on c* matters here: without it the reference differs from libdflash.
    c = make_case(1, 6, 16, 40, 8, True, True, 4)
    nd = reference(c["x"], c["xt"], c["E"], c["W1"], c["W2"], c["cw"], c["cb"], c["prev"],
                   c["target"], c["coef"], c["alphas"], detach=False)
    got = run_tool(c)
    diff = rel(got["dx"], nd["dx"].reshape(-1))
    print(f"without the stop-gradient the reference's dx differs by {diff:.3g} of its scale")
    ok &= diff > 100 * TOL
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
