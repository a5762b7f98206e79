#!/usr/bin/env python3
"""Kimi K2.5/K2.6 TypeScript-like tool declarations: libdflash's C conversion
(dflash_chat_tools_typescript) against Moonshot's own tool_declaration_ts.py
(the copy pinned on PyPI in tinker-cookbook==0.6.1, loaded alone by path), byte for
byte, over generated tool lists that reach every branch of the reference (nested
objects, arrays of described items, enums of mixed types, anyOf, type unions,
$defs/$ref/self reference, constraints, defaults of every JSON type, unicode and
multi-line descriptions, empty or missing parameters) and inputs where it raises.
Then full kimi-k2.5/2.6 renders with such tools against jinja2 with the K2.6 fixture
template (K2.5: derived from it, see hf_jinja), given the tools and tools_ts_str as the
official tokenizer computes them.

Outcomes per tool list: equal (both print the same text), both raise (C reports
DFLASH_E_FORMAT where the reference raises: the tokenizer falls back to JSON),
repr refused (C reports DFLASH_E_UNSUPPORTED where the reference prints a Python
repr of a list or dict; checked to be that case). Anything else fails.

Exit 0 when all agree, 1 otherwise, 77 when jinja2, the reference or the template
fixtures are missing. Usage: test_tools_ts.py [N_TOOL_LISTS]."""
import json
import logging
import random
import sys
from collections import Counter

try:
    import jinja2  # noqa: F401
except ImportError:
    print("SKIP: jinja2 not installed")
    sys.exit(77)

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import gen_conversations  # noqa: E402
import hf_jinja  # noqa: E402

import libdflash  # noqa: E402
from libdflash.chat import ChatTemplate  # noqa: E402
from libdflash.chat_tools import tools_typescript  # noqa: E402

REF = hf_jinja.load_tools_ts()
if REF is None:
    print("SKIP: Moonshot's tool_declaration_ts.py not installed "
          "(pip install --no-deps tinker-cookbook==0.6.1)")
    sys.exit(77)
logging.getLogger(REF.__name__).setLevel(logging.ERROR)  # its warning for `false` schemas

TEXTS = ["", "City name", "数据 训练", "naïve café 🙂", "multi\nline", "blank\n\nline\n",
         "\n", "trailing\n", "  spaced  ", "tab\there", "quote \" and 'single'", "\r\nCRLF",
         "back\\slash", "emoji 👩‍💻", "Ω≈ç√", "// already a comment", "\u2028sep"]
FLOATS = [0.1, 1e20, 1e16, 1e15, 1.5, -0.0, 3.0, 1e-7, 0.0001, 123456789.125, 2.5e-5,
          -2.25, 1e300, 5e-324]
NAMES = ["city", "unit", "a", "b", "z", "Zeta", "_x", "名前", "é", "a b", "count", "x1",
         "x10", "x2"]


class Gen:
    def __init__(self, rng):
        self.rng = rng
        self.defs = []  # names of $defs created so far in this function

    def chance(self, p):
        return self.rng.random() < p

    def text(self):
        return self.rng.choice(TEXTS)

    def scalar_value(self):
        r = self.rng.random()
        if r < 0.25:
            return self.text()
        if r < 0.45:
            return self.rng.randint(-1000, 10**12)
        if r < 0.7:
            return self.rng.choice(FLOATS)
        if r < 0.85:
            return self.chance(0.5)
        return None

    def json_value(self, depth=0):
        r = self.rng.random()
        if depth < 2 and r < 0.15:
            return [self.json_value(depth + 1) for _ in range(self.rng.randint(0, 3))]
        if depth < 2 and r < 0.3:
            return {self.rng.choice(NAMES): self.json_value(depth + 1)
                    for _ in range(self.rng.randint(0, 3))}
        return self.scalar_value()

    def describe(self, s):
        if self.chance(0.5):
            s["description"] = self.text()
        elif self.chance(0.02):
            s["description"] = self.rng.choice([0, None, [], 5, ["x"]])  # falsy / raises
        return s

    def constraints(self, s, keys, bad=0.01):
        for k in keys:
            if self.chance(0.3):
                v = self.rng.choice([self.rng.randint(0, 100), self.rng.choice(FLOATS),
                                     "^[a-z]+$", True, None])
                if self.chance(bad):
                    v = self.rng.choice([[1, 2], {"a": 1}])  # printed as a repr
                s[k] = v
        return s

    def schema(self, depth):
        r = self.rng.random()
        if depth > 3:
            r = r * 0.45
        if r < 0.2:
            t = self.rng.choice(["string", "integer", "number", "boolean", "null"])
            s = {"type": t}
            if t == "string":
                self.constraints(s, ["maxLength", "minLength", "pattern", "format"])
            elif t in ("integer", "number"):
                self.constraints(s, ["maximum", "minimum", "exclusiveMinimum"])
            return self.describe(s)
        if r < 0.25:
            return self.rng.choice([{}, True, False, {"type": "foo"}, {"type": 5},
                                    {"type": None, "description": "x"}])
        if r < 0.35:
            return self.enum()
        if r < 0.45:
            return self.describe(self.constraints({"type": "array", "items": self.items(depth)},
                                                  ["minItems", "maxItems", "uniqueItems"]))
        if r < 0.6:
            return self.obj(depth + 1)
        if r < 0.68:
            return self.describe({"anyOf": [self.schema(depth + 1)
                                            for _ in range(self.rng.randint(0, 3))]})
        if r < 0.74:
            ts = self.rng.sample(["string", "number", "integer", "boolean", "null", "object",
                                  "array"], self.rng.randint(0, 3))
            if self.chance(0.03):
                ts.append("date")  # unknown: raises
            return self.describe({"type": ts})
        if r < 0.84:
            return self.ref()
        if r < 0.86:
            return {"description": "no type"}  # raises
        return self.describe({"type": "string"})

    def items(self, depth):
        r = self.rng.random()
        if r < 0.1:
            return self.rng.choice([None, {}, False, [], True])
        return self.schema(depth + 1)

    def enum(self):
        r = self.rng.random()
        if r < 0.4:
            vals = self.rng.sample(["red", "green", "ü", "a b", "", "say \"hi\""],
                                   self.rng.randint(0, 4))
            s = {"enum": vals}
            if self.chance(0.5):
                s["type"] = self.rng.choice(["string", ["string", "null"], ["null", "string"],
                                             ["string"]])
        elif r < 0.6:
            s = {"enum": [self.rng.choice([1, 2, 30, -4, True]) for _ in range(3)]}
            if self.chance(0.6):
                s["type"] = self.rng.choice(["integer", "number", ["integer", "null"]])
        elif r < 0.85:
            s = {"enum": [self.scalar_value() for _ in range(self.rng.randint(1, 4))]}
            if self.chance(0.4):  # often raises: a value of another type
                s["type"] = self.rng.choice(["string", "number", "integer", "boolean",
                                             ["string", "number"], [], ["a", "b", "c"],
                                             "object"])
        elif r < 0.95:
            s = {"enum": self.rng.choice(["abc", "", {"k1": 1, "k2": 2}, None, 5])}
        else:
            s = {"enum": ["a", [1, "b"]] if self.chance(0.5) else [{"x": 1}]}  # repr
        return self.describe(s)

    def ref(self):
        r = self.rng.random()
        if r < 0.55 and self.defs:
            s = {"$ref": "#/$defs/" + self.rng.choice(self.defs)}
        elif r < 0.75:
            s = {"$ref": "#"}
        elif r < 0.85:
            s = {"$ref": "#/$defs/Later"}  # registered after use, or never: raises
        else:
            s = {"$ref": self.rng.choice(["#/definitions/X", "other.json#/X", 5])}  # raises
        return self.describe(s)

    def add_defs(self, s, depth):
        defs = {}
        for _ in range(self.rng.randint(1, 3)):
            name = self.rng.choice(["Address", "Item", "Later", "Node", "Tag", "名"])
            defs[name] = None
            self.defs.append(name)
        for name in defs:
            d = self.obj(depth + 2) if self.chance(0.7) else self.schema(depth + 2)
            if self.chance(0.05):
                d = self.rng.choice([True, {"$self_ref": True, "type": "object"}])
            defs[name] = d
        s["$defs"] = defs

    def obj(self, depth):
        s = {"type": "object"}
        if depth < 4 and self.chance(0.12):
            self.add_defs(s, depth)
        if depth < 4 and self.chance(0.85):
            names = self.rng.sample(NAMES, self.rng.randint(0, 4))
            s["properties"] = {}
            for n in names:
                p = self.schema(depth)
                if isinstance(p, dict) and self.chance(0.3):
                    p = dict(p, default=self.json_value())
                s["properties"][n] = p
            r = self.rng.random()
            if r < 0.6:
                s["required"] = [n for n in names if self.chance(0.5)] + (
                    ["missing"] if self.chance(0.1) else [])
            elif r < 0.65:
                s["required"] = self.rng.choice(["ab", {"a": 1}, None, [["a"]]])
        r = self.rng.random()
        if r < 0.08:
            s["additionalProperties"] = self.rng.choice([True, False])
        elif r < 0.12:
            s["additionalProperties"] = self.schema(depth + 1)
        elif r < 0.13:
            s["additionalProperties"] = self.rng.choice([1, "x", None])
        return self.describe(s)

    def function(self, i):
        self.defs = []
        fn = {}
        r = self.rng.random()
        if r < 0.9:
            fn["name"] = self.rng.choice([f"tool_{i}", "get_weather", "查询", "a.b"])
        elif r < 0.95:
            fn["name"] = self.rng.choice([7, None, True, 1.5])
        elif r < 0.97:
            fn["name"] = ["list", "name"]  # repr
        if self.chance(0.7):
            fn["description"] = self.text()
        r = self.rng.random()
        if r < 0.75:
            params = self.obj(1)
            if self.chance(0.15):
                self.add_defs(params, 1)
                if "properties" in params and self.defs:
                    params["properties"]["ref_" + self.defs[0]] = {"$ref": "#/$defs/" + self.defs[0]}
            fn["parameters"] = params
        elif r < 0.85:
            fn["parameters"] = self.rng.choice([{}, None, {"type": "object"},
                                                {"type": "object", "properties": {}}])
        elif r < 0.87:
            fn["parameters"] = self.rng.choice([[1], "x", {"description": "only"}])
        return fn

    def tool(self, i):
        r = self.rng.random()
        if r < 0.9:
            return {"type": "function", "function": self.function(i)}
        if r < 0.95:
            return {"type": "_plugin", "_plugin": {"name": "web"}}
        if r < 0.97:
            return {"type": "function", "function": self.rng.choice([{}, None, "x"])}
        return self.rng.choice(["not a dict", 5])

    def tools(self):
        return [self.tool(i) for i in range(self.rng.randint(1, 3))]


def shuffled(rng, v):
    """The same value with every object's keys in a random order."""
    if isinstance(v, dict):
        items = list(v.items())
        rng.shuffle(items)
        return {k: shuffled(rng, x) for k, x in items}
    if isinstance(v, list):
        return [shuffled(rng, x) for x in v]
    return v


def ref_encode(tools):
    try:
        return REF.encode_tools_to_typescript_style(tools), None
    except Exception as e:  # what the tokenizer catches
        return None, f"{type(e).__name__}: {e}"


def c_encode(tools, sort_keys):
    try:
        return tools_typescript(tools, sort_keys=sort_keys), None
    except libdflash.Error as e:
        return None, e


def has_repr(tools):
    """Whether the reference, succeeding, printed a Python repr of a list or dict (an
    enum member, constraint value, type or function name that is one)."""
    reprs = []

    def walk(v):
        if isinstance(v, dict):
            for k, x in v.items():
                if k in ("enum",) and isinstance(x, list):
                    reprs.extend(repr(e) for e in x if isinstance(e, (list, dict)))
                if k in ("maxLength", "minLength", "pattern", "maximum", "minimum",
                         "minItems", "maxItems", "type", "name") and isinstance(x, dict):
                    reprs.append(repr(x))
                if k in ("maxLength", "minLength", "pattern", "maximum", "minimum",
                         "minItems", "maxItems", "name") and isinstance(x, list):
                    reprs.append(repr(x))
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(tools)
    return reprs


def compare(stats, failures, tools, sort_keys):
    want, werr = ref_encode(hf_jinja.deep_sort_dict(tools) if sort_keys else tools)
    got, gerr = c_encode(tools, sort_keys)
    label = "sorted" if sort_keys else "as given"
    if want is not None and got is not None:
        ok = want == got
        stats[label, "equal" if ok else "DIFFERENT"] += 1
        if not ok:
            failures.append((label, tools, got, want))
    elif want is None and gerr is not None and gerr.status == "DFLASH_E_FORMAT":
        stats[label, "both raise"] += 1
    elif want is not None and gerr is not None and gerr.status == "DFLASH_E_UNSUPPORTED" and \
            any(r in want for r in has_repr(tools)):
        stats[label, "repr refused"] += 1
    else:
        stats[label, "MISMATCH"] += 1
        failures.append((label, tools, gerr and gerr.message or got, werr or want))


def branch_coverage(lists):
    """Which reference branches the generated lists reach (printed, so a generator change
    that stops covering one shows)."""
    cov = Counter()
    for tools in lists:
        out, err = ref_encode(hf_jinja.deep_sort_dict(tools))
        if out is None:
            cov["raises"] += 1
            continue
        for probe, name in (("interface parameters", "self-ref interface"),
                            ("interface ", "$defs interface"), ("Array<\n", "array docstring"),
                            ("[k: string]", "additionalProperties"), ("// Default: ", "default"),
                            ("?: ", "optional"), (" | ", "union/anyOf/enum"),
                            ("// maxLength", "string constraint"), ("maximum: ", "number constraint"),
                            ("Items: ", "array constraint"), ("// blank\n\n", "blank description line")):
            if probe in out:
                cov[name] += 1
    return cov


def render_check(stats, failures, ref, n, rng):
    """Full renders with generated tools: C kimi-k2.5/2.6 vs jinja2 given what the
    tokenizer computes (sorted tools, tools_ts_str unless the conversion raises)."""
    corpus = gen_conversations.corpus(n, seed=77)
    for k, (msgs, _) in enumerate(corpus):
        tools = shuffled(rng, Gen(rng).tools())
        for name in ("kimi-k2.5", "kimi-k2.6"):
            o = {"add_generation_prompt": k % 2 == 1, "thinking": k % 3 != 0,
                 "preserve_thinking": name == "kimi-k2.6" and k % 5 == 0}
            kw = {"thinking": o["thinking"]}
            if name == "kimi-k2.6":
                kw["preserve_thinking"] = o["preserve_thinking"]
            try:
                c = ChatTemplate(name).render_full(msgs, tools=tools, **o).text
                cerr = None
            except libdflash.Error as e:
                c, cerr = None, e
            try:
                j = ref.render(name, hf_jinja.normalize(name, msgs), tools=tools,
                               add_generation_prompt=o["add_generation_prompt"], **kw)
            except Exception as e:
                j = None
                jerr = e
            ts, _ = ref_encode(hf_jinja.deep_sort_dict(tools))
            # The template tests `if tools_ts_str`: "" (no function tool) takes JSON too.
            path = "typescript" if ts else "json fallback"
            if c is not None and j is not None:
                ok = c == j
                stats["render " + name, path + (" equal" if ok else " DIFFERENT")] += 1
                if not ok:
                    failures.append(("render " + name, tools, c, j))
            elif c is None and j is None:
                stats["render " + name, "both reject"] += 1
            elif c is None and cerr.status == "DFLASH_E_UNSUPPORTED" and \
                    "Python repr" in cerr.message:
                stats["render " + name, "repr refused"] += 1
            elif c is None and any(s in cerr.message for s in ("tool_call_id", "lacks an id")):
                stats["render " + name, "refused (documented)"] += 1
            else:
                stats["render " + name, "MISMATCH"] += 1
                failures.append(("render " + name, tools, cerr and cerr.message or c,
                                 j if j is not None else repr(jerr)))


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 600
    ref = hf_jinja.Reference()
    if ref.missing:
        print("SKIP: missing:", ", ".join(ref.missing))
        sys.exit(77)
    rng = random.Random(2024)
    lists = [shuffled(rng, Gen(rng).tools()) for _ in range(n)]
    stats, failures = Counter(), []
    for tools in lists:
        compare(stats, failures, tools, sort_keys=True)
        compare(stats, failures, tools, sort_keys=False)
    render_check(stats, failures, ref, max(n // 3, 1), rng)
    for (label, outcome), count in sorted(stats.items()):
        print(f"{label:20s} {outcome:28s} {count:6d}")
    print("reference branches reached:", dict(sorted(branch_coverage(lists).items())))
    for label, tools, got, want in failures[:5]:
        print("\nFAILURE", label, json.dumps(tools, ensure_ascii=False)[:3000])
        print("--- libdflash:\n" + repr(got)[:3000])
        print("--- reference:\n" + repr(want)[:3000])
    total = sum(stats.values())
    print(f"\n{len(failures)} disagreement(s) over {total} comparisons ({n} tool lists)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
