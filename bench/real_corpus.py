"""Real text by category for bench/tokenizer_bench.py --real: files every Debian + CPython
machine has, or that the bench pins (sympy, mpmath in .venv-tok), nothing generated.

  english   man pages of sections 1-8 (/usr/share/man/man*/*.gz, the roff reduced to its text
            here, see roff_text) and the licence texts of /usr/share/common-licenses
  code      C headers under /usr/include (Debian's -dev packages) and this project's own
            sources (src/, cuda/, tools/, bindings/python/, tests/, bench/: .c .h .cu .py)
  math      docstrings of sympy and mpmath (pinned in PEERS) that hold LaTeX (`\\frac`,
            `.. math::`, `:math:`...): English around formulas, as a reasoning answer has them
  cjk       the ja, ko, zh_CN and zh_TW man pages, and CPython's Lib/test/cjkencodings/*-utf8.txt
            when the interpreter ships its tests
  scripts   the ru and uk man pages (Cyrillic), and the non-ASCII strings of the tokenizer tests
            (tests/tokenizer/*.c, *.py)
  completions  the demo's fetched completions (examples/pipeline: out/fetch/completions.jsonl, or
            --completions PATH): the assistant's reasoning and content; skipped when absent

Each category is a list of documents (a file, a man page, a docstring group), at most DOC_MAX
bytes each (longer files are cut at a line end). The files are taken in an order shuffled with a
fixed seed, so that a round of a few hundred KB samples the whole source (not only the man
pages that start with 'a'); round r of a category is the r-th slice of that list, so every
round is text no encoder has seen in this run, until a category runs out (rounds() says so).
`mix` is the "reasoning traces" headline: 70 % English, 20 % code, 10 % math by bytes, the
documents shuffled together.
"""
import glob
import gzip
import json
import os
import random
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_MAX = 32 << 10
MIX = (("english", 0.7), ("code", 0.2), ("math", 0.1))
CATEGORIES = ("english", "code", "math", "cjk", "scripts", "completions")

# ---- man pages -------------------------------------------------------------------------------

_ESC = [(re.compile(r"\\f(?:\[[^\]]*\]|\(..|.)"), ""), (re.compile(r"\\s[-+]?\d"), ""),
        (re.compile(r"\\\((?:em|en)"), "\u2014"), (re.compile(r"\\\((?:lq|rq|dq)"), '"'),
        (re.compile(r"\\\((?:oq|cq|aq)"), "'"), (re.compile(r"\\\(bu"), "\u2022"),
        (re.compile(r"\\\(co"), "\u00a9"), (re.compile(r"\\\(..|\\\[[^\]]*\]"), ""),
        (re.compile(r"\\[-]"), "-"), (re.compile(r"\\[e\\]"), "\\\\"), (re.compile(r"\\[&|^%:]"), ""),
        (re.compile(r"\\ "), " "), (re.compile(r"\\\*(?:\(..|\[[^\]]*\]|.)"), ""),
        (re.compile(r"\\[nk](?:\(..|\[[^\]]*\]|.)"), ""), (re.compile(r"\\[hvwl]'[^']*'"), "")]
_TEXT_MACROS = {"SH", "SS", "B", "I", "BI", "BR", "IB", "IR", "RB", "RI", "SM", "SB", "TP", "IP",
                "Nm", "Nd", "Sh", "Ss", "It", "Fl", "Ar", "Xr", "Pa", "Em", "Sy", "Dq", "Ql"}


def roff_text(src):
    """The text of a man page's roff source: request lines dropped, except the arguments of
    font and heading macros; escapes replaced by their characters or dropped. Not groff's
    layout (no filling, no hyphenation): the words, punctuation and line breaks a reader sees,
    which is what a tokenizer cares about."""
    out = []
    for line in src.splitlines():
        if line.startswith((".\\\"", "'\\\"", '.\\"')) or line.startswith("\\\""):
            continue
        if line[:1] in (".", "'"):
            name, _, rest = line[1:].strip().partition(" ")
            if name not in _TEXT_MACROS or not rest:
                continue
            line = rest.replace('"', "") if name in ("B", "I", "SH", "SS", "SM", "SB") else \
                rest.replace('"', "").replace(" ", "") if len(name) == 2 and name.isupper() else rest
        for rx, rep in _ESC:
            line = rx.sub(rep, line)
        out.append(line)
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _man(dirs):
    for d in dirs:
        for path in glob.glob(os.path.join("/usr/share/man", d, "man*", "*.gz")) + \
                glob.glob(os.path.join("/usr/share/man", d, "*.gz")):
            yield path


def _read_man(path):
    try:
        with gzip.open(path) as f:
            raw = f.read()
    except OSError:
        return ""
    text = raw.decode("utf-8", "replace")
    if text.lstrip().startswith(".so "):  # a page that only includes another one
        return ""
    return roff_text(text)


def _read_plain(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


# ---- sources per category --------------------------------------------------------------------

def _files_english():
    return ([(p, _read_man) for p in _man(["man1", "man2", "man3", "man4", "man5", "man6",
                                            "man7", "man8"])]
            + [(p, _read_plain) for p in glob.glob("/usr/share/common-licenses/*")
               if os.path.isfile(p)])


def _files_code():
    out = []
    for dirpath, _, names in os.walk("/usr/include"):
        out.extend((os.path.join(dirpath, n), _read_plain) for n in names
                   if n.endswith((".h", ".hpp", ".hh")))
    for sub in ("src", "cuda", "tools", "bindings/python", "tests", "bench", "examples"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, sub)):
            out.extend((os.path.join(dirpath, n), _read_plain) for n in names
                       if n.endswith((".c", ".h", ".cu", ".py")))
    return out


_LATEX = re.compile(r"\\(?:frac|sum|int|prod|sqrt|left|right|alpha|beta|gamma|pi|infty|cdot|"
                    r"mathrm|operatorname|binom|zeta|Gamma|log|sin|cos|exp|lim|partial|le|ge)\b|"
                    r"\.\. math::|:math:`|\$[^$\n]+\$")


def _math_docstrings(path):
    """The docstrings of a Python file that hold LaTeX, joined (one document a file)."""
    import ast
    src = _read_plain(path)
    if not _LATEX.search(src):  # most files: no formula, no parse
        return ""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return ""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            d = ast.get_docstring(node, clean=True)
            if d and len(_LATEX.findall(d)) >= 2:
                docs.append(d)
    return "\n\n".join(docs) + ("\n" if docs else "")


def _package_dir(name):
    import importlib.util
    spec = importlib.util.find_spec(name)
    return os.path.dirname(spec.origin) if spec and spec.origin else None


def _files_math():
    out = []
    for pkg in ("sympy", "mpmath"):
        d = _package_dir(pkg)
        if not d:
            print(f"  math: {pkg} not installed (bench/tokenizer_bench.py --setup pins it)")
            continue
        for dirpath, _, names in os.walk(d):
            if "/tests" in dirpath:
                continue
            out.extend((os.path.join(dirpath, n), _math_docstrings) for n in names
                       if n.endswith(".py"))
    return out


def _cjkencodings():
    import sysconfig
    d = os.path.join(sysconfig.get_paths()["stdlib"], "test", "cjkencodings")
    files = sorted(glob.glob(os.path.join(d, "*-utf8.txt")))
    if not files:
        print(f"  cjk: {d}/*-utf8.txt absent (this interpreter ships without its tests)")
    return [(p, _read_plain) for p in files]


def _files_cjk():
    return [(p, _read_man) for p in _man(["ja", "ko", "zh_CN", "zh_TW"])] + _cjkencodings()


def _test_strings(path):
    """The string literals of a test source that hold a character outside ASCII."""
    text = _read_plain(path)
    lits = re.findall(r'"((?:[^"\\\n]|\\.)*)"', text)
    return "\n".join(s for s in lits if any(ord(ch) > 127 for ch in s)) + "\n"


def _files_scripts():
    tests = sorted(glob.glob(os.path.join(ROOT, "tests", "tokenizer", "*.c")) +
                   glob.glob(os.path.join(ROOT, "tests", "tokenizer", "*.py")))
    return [(p, _read_man) for p in _man(["ru", "uk"])] + [(p, _test_strings) for p in tests]


def completions_path(given=None):
    if given:
        return given
    for p in (os.path.join(ROOT, "examples", "pipeline", "out", "fetch", "completions.jsonl"),
              os.path.join(ROOT, "out", "fetch", "completions.jsonl"),
              os.path.join(ROOT, "out", "completions.jsonl")):
        if os.path.exists(p):
            return p
    return None


def _completion_docs(path):
    docs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                c = json.loads(line).get("completion") or {}
            except ValueError:
                continue
            text = "\n\n".join(x for x in (c.get("reasoning"), c.get("content")) if x)
            if text:
                docs.append(text)
    return docs


# ---- documents -------------------------------------------------------------------------------

def _cut(text):
    """Documents of at most DOC_MAX bytes, cut at line ends."""
    while text:
        b = text.encode()
        if len(b) <= DOC_MAX:
            yield text
            return
        head = b[:DOC_MAX].decode("utf-8", "ignore")
        k = head.rfind("\n") + 1 or len(head)
        yield head[:k]
        text = text[k:]


class Category:
    """The documents of one category, read lazily in a fixed shuffled order."""

    def __init__(self, name, files, seed):
        self.name = name
        self.files = sorted(files, key=lambda f: f[0])
        random.Random(seed).shuffle(self.files)
        self.docs, self.next_file, self.total = [], 0, 0

    def _grow(self, nbytes):
        while self.total < nbytes and self.next_file < len(self.files):
            path, read = self.files[self.next_file]
            self.next_file += 1
            for d in _cut(read(path)):
                if d.strip():
                    self.docs.append(d)
                    self.total += len(d.encode())

    def slice(self, start, nbytes):
        """Documents from byte `start` of the category, about nbytes of them (fewer when it
        runs out)."""
        self._grow(start + nbytes)
        out, at = [], 0
        for d in self.docs:
            n = len(d.encode())
            if at >= start and at < start + nbytes:
                out.append(d)
            at += n
            if at >= start + nbytes:
                break
        return out


class Corpus:
    def __init__(self, completions=None, seed=44):
        self.cats = {}
        srcs = {"english": _files_english, "code": _files_code, "math": _files_math,
                "cjk": _files_cjk, "scripts": _files_scripts}
        for k, name in enumerate(CATEGORIES[:-1]):
            self.cats[name] = Category(name, srcs[name](), seed + k)
        path = completions_path(completions)
        if path:
            c = Category("completions", [], seed)
            c.docs = [d for doc in _completion_docs(path) for d in _cut(doc)]
            c.total = sum(len(d.encode()) for d in c.docs)
            c.files = []
            self.cats["completions"] = c
            self.completions = path
        else:
            print("  completions: skipped, no examples/pipeline out/fetch/completions.jsonl "
                  "(run examples/pipeline, or pass --completions PATH)")
            self.completions = None

    def names(self):
        return list(self.cats)

    def rounds(self, name, mb, n):
        """n rounds of about mb MB of the category, each unseen text; fewer bytes per round
        when the category holds less than n * mb (said on stderr)."""
        c = self.cats[name]
        want = int(mb * 1e6)
        c._grow(want * n)
        per = min(want, c.total // n) if c.total < want * n else want
        if per < want:
            print(f"  {name}: {c.total / 1e6:.2f} MB in all, {per / 1e6:.3f} MB a round",
                  file=sys.stderr)
        return [c.slice(r * per, per) for r in range(n)]

    def mix_rounds(self, mb, n, skip_rounds=0, seed=4400):
        """n rounds of the reasoning mix: MIX's shares of mb MB each, documents shuffled; the text
        comes after the first skip_rounds rounds of each category (so the per-category rounds
        and the mix do not share text when skip_rounds is their count)."""
        out = []
        for r in range(n):
            docs = []
            for name, share in MIX:
                want = int(mb * share * 1e6)
                start = int(skip_rounds * mb * 1e6) + r * want
                docs += self.cats[name].slice(start, want)
            random.Random(seed + r).shuffle(docs)
            out.append(docs)
        return out
