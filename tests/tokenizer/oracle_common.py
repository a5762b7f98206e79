"""Helpers shared by the tokenizer parity oracles (run as meson tests)."""
import os
import sys

SKIP = 77


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


def fixtures_dir():
    d = os.environ.get("DFLASH_FIXTURES") or (sys.argv[1] if len(sys.argv) > 1 else "")
    if not d or not os.path.isdir(d):
        skip(f"fixtures folder {d!r} is absent (set DFLASH_FIXTURES)")
    return d


def corpus_mb(default):
    return float(os.environ.get("DFLASH_CORPUS_MB", default))


class Tally:
    """Counts matches per check and keeps the first mismatches for the report."""

    def __init__(self):
        self.rows = []
        self.failures = []

    def check(self, name, ours, refs, inputs):
        ok = 0
        for x, a, b in zip(inputs, ours, refs):
            if list(a) == list(b):
                ok += 1
            elif len(self.failures) < 12:
                self.failures.append((name, x, list(a), list(b)))
        self.rows.append((name, ok, len(refs)))
        if len(ours) != len(refs):
            self.failures.append((name, "count", len(ours), len(refs)))
        print(f"{name:<48} {ok:>7}/{len(refs):<7} {'ok' if ok == len(refs) else 'MISMATCH'}",
              flush=True)

    def finish(self):
        total = sum(r[2] for r in self.rows)
        good = sum(r[1] for r in self.rows)
        print(f"{'TOTAL':<48} {good:>7}/{total:<7}")
        for f in self.failures:
            name, x = f[0], f[1]
            shown = repr(x if len(repr(x)) < 300 else x[:100])
            print(f"  {name}: input {shown}\n    ours {f[2] if len(str(f[2])) < 400 else '...'}"
                  f"\n    ref  {f[3] if len(str(f[3])) < 400 else '...'}")
        return 0 if good == total and not self.failures else 1
