#!/usr/bin/env python3
"""Parity of libdflash's C renderers with jinja2 as Hugging Face configures it,
over a generated corpus, for every template and a spread of switches; plus the
reasoning modes (against the official template with its split index forced) and
the inference-prefix property of spans. The kimi templates also go over a second,
reasoning-heavy corpus (gen_conversations.reasoning_corpus, N/4 conversations) with
every combination of generation prompt, thinking and preserve_thinking ("kc" rows).

Exit 0 when every comparison agrees, 1 on any disagreement, 77 when jinja2 or
the template fixtures are missing. Usage: test_parity.py [N_CONVERSATIONS]."""
import json
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

KIMI = ("kimi-k2-thinking", "kimi-k2.5", "kimi-k2.6")
QWEN = ("qwen3", "qwen3.5", "qwen3.6")

# libdflash refuses these inputs although the Jinja template renders something:
# documented in chat.h / src/chat/README.md.
STRICTER = ("tool message without tool_call_id", "prints a list here as a Python repr",
            "cannot render tool calls", "cannot declare tools", "lacks an id",
            "arguments are not a JSON object")


def options_for(name, rng_i):
    """A deterministic spread of switches per conversation."""
    o = {"add_generation_prompt": rng_i % 2 == 1}
    if name in KIMI[1:] or name in QWEN:
        o["thinking"] = rng_i % 3 != 0
    if name == "qwen3.6":
        o["preserve_thinking"] = rng_i % 5 == 0
    if name == "kimi-k2.6":  # with rng_i % 3, all four thinking x preserve pairs
        o["preserve_thinking"] = rng_i % 4 in (1, 2)
    return o


def option_grid(name):
    """Every combination of the switches a template reads."""
    grid = [{"add_generation_prompt": g} for g in (False, True)]
    if name in KIMI[1:] or name in QWEN:
        grid = [dict(o, thinking=t) for o in grid for t in (True, False)]
    if name in ("kimi-k2.6", "qwen3.6"):
        grid = [dict(o, preserve_thinking=p) for o in grid for p in (False, True)]
    return grid


def jinja_kwargs(name, o):
    kw = {}
    if "thinking" in o:
        kw["thinking" if name.startswith("kimi") else "enable_thinking"] = o["thinking"]
    if "preserve_thinking" in o:
        kw["preserve_thinking"] = o["preserve_thinking"]
    return kw


def c_render(tmpl, msgs, tools, **o):
    try:
        return tmpl.render_full(msgs, tools=tools, **o), None
    except libdflash.Error as e:
        return None, e.message


def j_render(ref, name, msgs, tools, **kw):
    try:
        return ref.render(name, hf_jinja.normalize(name, msgs), tools=tools, **kw), None
    except Exception as e:  # TemplateError, TypeError, UndefinedError...
        return None, f"{type(e).__name__}: {e}"


def compare(stats, name, label, c, cerr, j, jerr, failures, ctx):
    if c is not None and j is not None:
        if c.text == j:
            stats[name, label, "equal"] += 1
        else:
            stats[name, label, "DIFFERENT"] += 1
            failures.append((name, label, ctx, c.text, j))
    elif c is None and j is None:
        stats[name, label, "both reject"] += 1
    elif c is None:
        if any(s in cerr for s in STRICTER):
            stats[name, label, "refused (documented)"] += 1
        else:
            stats[name, label, "C REJECTS"] += 1
            failures.append((name, label, ctx, cerr, j))
    else:
        stats[name, label, "JINJA REJECTS"] += 1
        failures.append((name, label, ctx, c.text, jerr))


def last_assistant(msgs):
    return max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=-1)


def kimi_split(msgs, end):
    return max((i for i, m in enumerate(msgs[:end])
                if m["role"] == "assistant" and not m.get("tool_calls")), default=-1)


def qwen_lqi(name, msgs):
    for i in range(len(msgs) - 1, -1, -1):
        m = msgs[i]
        if m["role"] != "user":
            continue
        c = m["content"]
        if name != "qwen3":
            c = c if isinstance(c, str) else "".join(p["text"] for p in c)
            c = c.strip()
        elif not isinstance(c, str):
            continue
        if not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
            return i
    return len(msgs) - 1


def mode_override(name, mode, msgs):
    """The official template's own split index, forced to what each mode means."""
    last = last_assistant(msgs)
    if name in KIMI:
        return {"split_override": {"keep_all": -1, "drop": len(msgs) - 1,
                                   "keep_after_last_user": kimi_split(msgs, max(last, 0))}[mode]}
    lqi = qwen_lqi(name, msgs)
    return {"lqi_override": {"keep_all": -1, "drop": len(msgs),
                             "keep_after_last_user": min(lqi, last - 1) if last >= 0 else lqi}[mode]}


def check_prefix(stats, ref, name, tmpl, msgs, tools, o, failures, tag=""):
    """In keep_after_last_user mode, the text before the first generated byte of the
    last assistant turn is exactly the official prompt the target saw when it wrote
    that turn, and everything generated after it is contiguous up to end-of-turn."""
    last = last_assistant(msgs)
    if last != len(msgs) - 1 or last < 1 or msgs[last - 1]["role"] == "assistant":
        return
    if msgs[last].get("name") and name in KIMI:
        return  # the generation prompt always says "assistant"
    content = msgs[last].get("content")
    if isinstance(content, list):
        content = "".join(p["text"] for p in content)
    if not o.get("thinking", True) and (msgs[last].get("reasoning_content") or
                                        msgs[last].get("reasoning") or
                                        (isinstance(content, str) and "</think>" in content)):
        return  # thinking off, yet the turn has reasoning: no inference prompt fits
    c, _ = c_render(tmpl, msgs, tools, reasoning="keep_after_last_user",
                    **dict(o, add_generation_prompt=False))
    j, _ = j_render(ref, name, msgs[:last], tools, add_generation_prompt=True,
                    **jinja_kwargs(name, o))
    if c is None or j is None:
        return
    gen = [s for s in c.spans if s["generated"] and s["message"] == last]
    if not gen:
        stats[name, tag + "prefix", "no generated span"] += 1
        return
    start = gen[0]["begin"]
    ok = c.data[:start].decode() == j
    contiguous = all(a["end"] == b["begin"] for a, b in zip(gen, gen[1:]))
    ends_eot = c.data[gen[-1]["begin"]:gen[-1]["end"]].endswith(tmpl.end_of_turn.encode())
    tail_scaffold = all(s["kind"] == "scaffold" for s in c.spans if s["begin"] >= gen[-1]["end"])
    if ok and contiguous and ends_eot and tail_scaffold:
        stats[name, tag + "prefix", "equal"] += 1
    else:
        stats[name, tag + "prefix", "DIFFERENT"] += 1
        failures.append((name, tag + "prefix", (msgs, tools, o), c.data[:start].decode(), j))


def check_spans(stats, name, c, failures, ctx, tag=""):
    pos = 0
    for s in c.spans:
        if s["begin"] != pos or s["end"] <= s["begin"]:
            failures.append((name, tag + "spans", ctx, str(c.spans), ""))
            stats[name, tag + "spans", "BROKEN"] += 1
            return
        pos = s["end"]
    if pos != len(c.data):
        stats[name, tag + "spans", "BROKEN"] += 1
        failures.append((name, tag + "spans", ctx, str(c.spans), ""))


def check_one(stats, failures, ref, name, tmpl, msgs, tools, o, k, tag=""):
    """The official render with switches `o`, its spans, one reasoning mode (by k) and
    the inference-prefix property; `tag` prefixes the labels (which corpus)."""
    ctx = (msgs, tools, o)
    c, cerr = c_render(tmpl, msgs, tools, **o)
    j, jerr = j_render(ref, name, msgs, tools, add_generation_prompt=o["add_generation_prompt"],
                       **jinja_kwargs(name, o))
    compare(stats, name, tag + "official", c, cerr, j, jerr, failures, ctx)
    if c is not None:
        check_spans(stats, name, c, failures, ctx, tag)
    if name in KIMI or name in QWEN:
        mode = ("keep_all", "drop", "keep_after_last_user")[k % 3]
        mo = dict(o, thinking=True, preserve_thinking=False)
        c, cerr = c_render(tmpl, msgs, tools, reasoning=mode, **mo)
        j, jerr = j_render(ref, name, msgs, tools, add_generation_prompt=mo["add_generation_prompt"],
                           **jinja_kwargs(name, {"thinking": True}),
                           **mode_override(name, mode, msgs))
        compare(stats, name, tag + mode, c, cerr, j, jerr, failures, (msgs, tools, mo, mode))
    check_prefix(stats, ref, name, tmpl, msgs, tools, o, failures, tag)


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    ref = hf_jinja.Reference()
    if ref.missing:
        print("SKIP: template fixtures missing:", ", ".join(ref.missing))
        sys.exit(77)
    corpus = gen_conversations.corpus(n)
    # Kimi: a second corpus of reasoning-heavy multi-turn and tool-loop conversations,
    # each rendered with every combination of switches (thinking, preserve_thinking,
    # generation prompt).
    n_kimi = max(n // 4, 1)
    kimi_corpus = gen_conversations.reasoning_corpus(n_kimi)
    stats, failures = Counter(), []
    for name in hf_jinja.TEMPLATES:
        tmpl = ChatTemplate(name)
        for k, (msgs, tools) in enumerate(corpus):
            check_one(stats, failures, ref, name, tmpl, msgs, tools, options_for(name, k), k)
        if name.startswith("kimi"):
            for k, (msgs, tools) in enumerate(kimi_corpus):
                for g, o in enumerate(option_grid(name)):
                    check_one(stats, failures, ref, name, tmpl, msgs, tools, o, k + g, "kc ")
    for (name, label, outcome), count in sorted(stats.items()):
        official = "" if hf_jinja.TEMPLATES[name][2] else "  (spec-derived reference)"
        print(f"{name:17s} {label:24s} {outcome:22s} {count:6d}{official}")
    for f in failures[:5]:
        print("\nFAILURE", f[0], f[1], json.dumps(f[2], ensure_ascii=False)[:3000])
        print("--- libdflash:\n" + repr(f[3])[:3000])
        print("--- jinja:\n" + repr(f[4])[:3000])
    by_template = Counter(f[0] for f in failures)
    print(f"\n{len(failures)} disagreement(s) over {n} conversations x {len(hf_jinja.TEMPLATES)} "
          f"templates and {n_kimi} reasoning conversations ('kc') x every switch combination "
          f"for the kimi templates" + (f"; by template: {dict(sorted(by_template.items()))}"
                                        if failures else ""))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
