"""Reference renderer: jinja2 configured exactly as Hugging Face transformers'
apply_chat_template configures it (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, loopcontrols, its tojson/raise_exception/strftime_now), over the
official template fixtures, plus the spec-derived variants for families with no
official copy at hand (documented below)."""
import datetime
import importlib.util
import json
import os
import pathlib

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def fixtures_dir():
    env = os.environ.get("DFLASH_FIXTURES")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures"


def _raise(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override of Jinja's tojson (which would HTML-escape).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _edit(text, old, new):
    assert text.count(old) == 1, f"template edit anchor not found once: {old!r}"
    return text.replace(old, new)


# The generic ChatML template (as published with ChatML and used by many HF models).
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


def _kimi_split_override(t):
    # Lets a test force the history/suffix split (reasoning modes).
    return _edit(t, "{%- set hist_msgs = messages[:ns.last_non_tool_call_assistant_msg+1] -%}",
                 "{%- if split_override is defined -%}{%- set ns.last_non_tool_call_assistant_msg"
                 " = split_override -%}{%- endif -%}\n"
                 "{%- set hist_msgs = messages[:ns.last_non_tool_call_assistant_msg+1] -%}")


def _qwen_lqi_override(t):
    anchor = "{%- for message in messages %}\n"
    i = t.index(anchor, t.index("last_query_index = index"))
    return (t[:i] + "{%- if lqi_override is defined %}{%- set ns.last_query_index = lqi_override"
            " %}{%- endif %}\n" + t[i:])


def _kimi25_from_k26(t):
    """Kimi K2.5 derived from the K2.6 fixture: no copy of K2.5's own template was found;
    it is described publicly as K2.6's without `preserve_thinking`. So the preserve switch
    goes: the history/suffix split is always made, and with thinking=false every suffix
    turn collapses to `<think></think>`. Everything else (no default system prompt,
    `tools_ts_str` when truthy else compact JSON, `reasoning` read before
    `reasoning_content`, the generation prompt) is K2.6's text unchanged."""
    t = _edit(t, "{%- set preserve_thinking = preserve_thinking | default(false) -%}\n", "")
    t = _edit(t, "{%- if not preserve_thinking -%}\n{%- for idx", "{%- for idx")
    t = _edit(t, "{%- endfor -%}\n{%- endif -%}\n\n{# split", "{%- endfor -%}\n\n{# split")
    t = _edit(t, "thinking is false and preserve_thinking is false -%}", "thinking is false -%}")
    assert "preserve_thinking" not in t.replace(
        "{# Find last non-tool-call assistant message. If preserve_thinking", ""), t
    return t


def _qwen36(t):
    """Qwen3.6 derived from the Qwen3.5 fixture: preserve_thinking keeps every think block."""
    return _edit(t, "{%- if loop.index0 > ns.last_query_index %}",
                 "{%- if (preserve_thinking is defined and preserve_thinking is true) or "
                 "loop.index0 > ns.last_query_index %}")


# name -> (fixture file or None, transform, official?)
TEMPLATES = {
    "kimi-k2": ("kimi-k2-instruct.jinja", None, True),
    "kimi-k2-thinking": ("kimi-k2-thinking.jinja", _kimi_split_override, True),
    # K2.6: a renamed copy of the official template (fixtures' SOURCES.md); K2.5 derived
    # from it at load time (no copy of K2.5's own template was found).
    "kimi-k2.5": ("kimi-k2.6.jinja", lambda t: _kimi_split_override(_kimi25_from_k26(t)), False),
    "kimi-k2.6": ("kimi-k2.6.jinja", _kimi_split_override, True),
    "qwen3": ("qwen3.jinja", _qwen_lqi_override, True),
    "qwen3.5": ("qwen3.5.jinja", _qwen_lqi_override, True),
    "qwen3.6": ("qwen3.5.jinja", lambda t: _qwen_lqi_override(_qwen36(t)), False),
    "smollm2": ("smollm2.jinja", None, True),
    "chatml": (None, None, False),
}


def load_tools_ts():
    """Moonshot's tool_declaration_ts.py as pinned on PyPI (tinker-cookbook==0.6.1 ships
    a copy): that one module, loaded by path without importing its package. None when
    it is not installed."""
    spec = importlib.util.find_spec("tinker_cookbook")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = (pathlib.Path(list(spec.submodule_search_locations)[0]) / "renderers" /
            "kimi_k2_5_tool_declaration_ts.py")
    if not path.exists():
        return None
    mod_spec = importlib.util.spec_from_file_location("kimi_tool_declaration_ts", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def deep_sort_dict(obj):
    """tokenization_kimi.py's deep_sort_dict (every Kimi K2-family tokenizer)."""
    if isinstance(obj, dict):
        return {k: deep_sort_dict(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort_dict(x) for x in obj]
    return obj


def kimi25_tool_kwargs(ts, tools):
    """What K2.5/K2.6's TikTokenTokenizer.apply_chat_template passes the template:
    the tools deep-sorted and, unless the conversion raises, tools_ts_str."""
    tools = deep_sort_dict(tools)
    kw = {"tools": tools}
    if tools:
        try:
            kw["tools_ts_str"] = ts.encode_tools_to_typescript_style(tools)
        except Exception:  # the tokenizer prints the error and keeps the JSON branch
            pass
    return kw


class Reference:
    def __init__(self):
        self.env = _env()
        self.compiled = {}
        self.missing = []
        self.tools_ts = load_tools_ts()
        if self.tools_ts is None:
            self.missing.append("tinker-cookbook==0.6.1 (Moonshot's tool_declaration_ts.py, "
                                "for kimi-k2.5/2.6 tools; pip install --no-deps)")
        for name, (fname, transform, _) in TEMPLATES.items():
            if fname is None:
                text = CHATML
            else:
                path = fixtures_dir() / "templates" / fname
                if not path.exists():
                    self.missing.append(str(path))
                    continue
                text = path.read_text(encoding="utf-8")
            if transform:
                text = transform(text)
            self.compiled[name] = self.env.from_string(text)

    def official(self, name):
        return TEMPLATES[name][2]

    def render(self, name, messages, tools=None, add_generation_prompt=False, **kwargs):
        """apply_chat_template(tokenize=False) semantics: messages, tools (None when
        absent), add_generation_prompt, and extra template kwargs. kimi-k2.5/2.6 go
        through their tokenizer's wrapper (kimi25_tool_kwargs)."""
        if name in ("kimi-k2", "kimi-k2-thinking"):
            tools = deep_sort_dict(tools)  # their tokenizer's apply_chat_template
        if name in ("kimi-k2.5", "kimi-k2.6") and "tools_ts_str" not in kwargs:
            kw = kimi25_tool_kwargs(self.tools_ts, tools)
            tools = kw.pop("tools")
            kwargs.update(kw)
        return self.compiled[name].render(messages=messages, tools=tools,
                                          add_generation_prompt=add_generation_prompt, **kwargs)


def normalize(name, messages):
    """The input normalisation libdflash applies before templating (documented in
    chat.h): `reasoning` is read as `reasoning_content`, a null reasoning (under
    either key) is absent, and for qwen3.5/3.6 JSON-string tool arguments are parsed
    (as vLLM does)."""
    out = []
    for m in messages:
        m = dict(m)
        rc = m.get("reasoning_content")
        if not isinstance(rc, str):
            m.pop("reasoning_content", None)
            if isinstance(m.get("reasoning"), str):
                m["reasoning_content"] = m["reasoning"]
        if not isinstance(m.get("reasoning"), str):
            m.pop("reasoning", None)  # K2.5/K2.6 read `reasoning` first: None would print
        if name in ("qwen3.5", "qwen3.6") and m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                tc = json.loads(json.dumps(tc))
                fn = tc.get("function", tc)
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                calls.append(tc)
            m["tool_calls"] = calls
        out.append(m)
    return out
