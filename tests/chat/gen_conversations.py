"""Random but reproducible conversations covering what the renderers must get
right: system or not (string, text parts, empty), multi-turn, reasoning under
either key or inside content (<think>...</think>), tool declarations, tool calls
with string or object arguments of every JSON type, tool results, names, unicode
and control characters, whitespace at the edges, literal special-token text,
empty and missing content, consecutive tool messages, conversations ending on
any role. reasoning_corpus(): multi-turn, tool-loop conversations where most
assistant turns carry reasoning (under either key, both, beside a null one), for
the Kimi history/suffix split and its thinking / preserve_thinking switches."""
import json
import random

WORDS = ["hello", "world", "the", "quick", "brown", "fox", "数据", "训练", "日本語",
         "naïve", "café", "🙂", "émoji 👩‍💻", "x", "42", "3.14", "if (a < b) { return; }",
         "<|im_end|>", "<|im_start|>", "<think>", "</think>", "<tool_call>", "<|im_middle|>",
         "\"quoted\"", "back\\slash", "tab\there", "line\nbreak", "\r\n", "  ", "\u2028",
         "\u00a0", "\u3000", "\x00nul", "\x1fctl", "</tool_response>", "<tool_response>",
         "## Return of", "None", "null", "{\"json\": 1}", "Ω≈ç√", "ｆｕｌｌ", "\u200b"]


def text(rng, lo=0, hi=12):
    n = rng.randint(lo, hi)
    s = " ".join(rng.choice(WORDS) for _ in range(n))
    r = rng.random()
    if r < 0.1:
        s = "\n" + s
    elif r < 0.2:
        s = s + "\n\n"
    elif r < 0.25:
        s = "  " + s + " \t"
    return s


def json_value(rng, depth=0):
    r = rng.random()
    if depth < 2 and r < 0.15:
        # jansson cannot hold NUL in object keys (such input is refused): none here.
        return {text(rng, 1, 2).strip().replace("\x00", "") or "k": json_value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    if depth < 2 and r < 0.25:
        return [json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    choices = [lambda: text(rng, 0, 4), lambda: rng.randint(-10**6, 10**6),
               lambda: rng.choice([0.5, -2.25, 1e-7, 1e16, 123456789.125, 0.1, 1e300, -0.0,
                                   3.0, 2.5e-5, 1e15, 0.0001]),
               lambda: rng.random() < 0.5, lambda: None]
    return rng.choice(choices)()


def tool_decl(rng, i):
    props = {f"p{k}": {"type": rng.choice(["string", "integer", "number", "object"]),
                       "description": text(rng, 0, 5)} for k in range(rng.randint(0, 3))}
    return {"type": "function",
            "function": {"name": f"tool_{i}_{rng.choice(['search', 'calc', '查询'])}",
                         "description": text(rng, 0, 8),
                         "parameters": {"type": "object", "properties": props,
                                        "required": list(props)[:1]}}}


def tool_call(rng, k, as_string):
    args = {rng.choice(["query", "n", "opts", "単語", "x y"]) + str(j): json_value(rng)
            for j in range(rng.randint(0, 3))}
    if as_string:
        args = json.dumps(args, ensure_ascii=rng.random() < 0.5)
    call = {"id": f"call_{k}_{rng.randint(0, 999)}", "type": "function",
            "function": {"name": rng.choice(["search", "calc", "get_weather", "查询"]),
                         "arguments": args}}
    return call


def content(rng, allow_parts=True, allow_none=False):
    r = rng.random()
    if allow_parts and r < 0.1:
        return [{"type": "text", "text": text(rng, 0, 5)} for _ in range(rng.randint(1, 3))]
    if r < 0.15:
        return ""
    if allow_none and r < 0.25:
        return None
    return text(rng, 1, 14)


def assistant(rng, ids, tools_on):
    m = {"role": "assistant"}
    r = rng.random()
    if r < 0.35:
        m["reasoning_content"] = text(rng, 0, 10)
    elif r < 0.55:
        m["reasoning"] = text(rng, 0, 10)
    calls = tools_on and rng.random() < 0.4
    m["content"] = content(rng, allow_parts=not calls, allow_none=calls)
    if calls and m["content"] is None and rng.random() < 0.3:
        del m["content"]
    if not calls and "reasoning_content" not in m and rng.random() < 0.15 and isinstance(
            m["content"], str):
        m["content"] = rng.choice(["<think>", "", "\n<think>\n"]) + text(rng, 0, 6) + \
            "</think>" + rng.choice(["", "\n", "\n\n"]) + m["content"]
    if rng.random() < 0.1:
        m["name"] = rng.choice(["bot", "Kimi", "", "助手"])
    if calls:
        m["tool_calls"] = [tool_call(rng, k, rng.random() < 0.6)
                           for k in range(rng.randint(1, 3))]
        ids.extend(tc["id"] for tc in m["tool_calls"])
    return m


def conversation(rng):
    msgs = []
    tools_on = rng.random() < 0.45
    r = rng.random()
    if r < 0.55:
        msgs.append({"role": "system", "content": content(rng, allow_parts=rng.random() < 0.3)})
    for turn in range(rng.randint(1, 4)):
        u = {"role": "user", "content": content(rng)}
        if rng.random() < 0.1:
            u["name"] = rng.choice(["alice", "bob", "用户"])
        msgs.append(u)
        for step in range(rng.randint(0, 3) if tools_on else 1):
            ids = []
            a = assistant(rng, ids, tools_on)
            msgs.append(a)
            if not a.get("tool_calls"):
                break
            for tid in ids:
                t = {"role": "tool", "tool_call_id": tid, "content": content(rng)}
                if rng.random() < 0.3:
                    t["name"] = rng.choice(["search", "calc"])
                msgs.append(t)
        if rng.random() < 0.1 and msgs[-1]["role"] == "assistant":
            msgs.append({"role": "user", "content": "<tool_response>\nok\n</tool_response>"})
    end = rng.random()
    if end < 0.25:
        msgs.append({"role": "user", "content": content(rng)})
    elif end < 0.35 and msgs[-1]["role"] == "assistant":
        msgs.pop()
    tools = [tool_decl(rng, i) for i in range(rng.randint(1, 3))] if tools_on else None
    return msgs, tools


def corpus(n, seed=1234):
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]


REASONING_KEYS = ("reasoning_content", "reasoning", "both", "null reasoning", "null content key",
                  "empty", "none")


def reasoned_assistant(rng, ids, tools_on, final):
    """An assistant turn with its reasoning under either key, both (equal, as servers
    that send both do), beside a null one, empty or absent; tool calls unless final."""
    m = {"role": "assistant"}
    how = rng.choice(REASONING_KEYS)
    r = text(rng, 1, 8)
    if how in ("reasoning_content", "both", "null reasoning"):
        m["reasoning_content"] = r
    if how in ("reasoning", "both", "null content key"):
        m["reasoning"] = r
    if how == "null reasoning":
        m["reasoning"] = None
    if how == "null content key":
        m["reasoning_content"] = None
    if how == "empty":
        m[rng.choice(("reasoning_content", "reasoning"))] = ""
    calls = tools_on and not final
    m["content"] = content(rng, allow_parts=not calls, allow_none=calls)
    if rng.random() < 0.05:
        m["name"] = rng.choice(["Kimi", "助手"])
    if calls:
        m["tool_calls"] = [tool_call(rng, k, rng.random() < 0.6)
                           for k in range(rng.randint(1, 2))]
        ids.extend(tc["id"] for tc in m["tool_calls"])
    return m


def reasoning_conversation(rng):
    """Multi-turn conversations where most assistant turns carry reasoning, with
    agentic tool loops (calls, results, a final answer), a system message or none,
    ending on a user, assistant or tool message: what the Kimi history/suffix split,
    thinking and preserve_thinking act on."""
    msgs = []
    tools_on = rng.random() < 0.5
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": content(rng, allow_parts=rng.random() < 0.2)})
    for turn in range(rng.randint(1, 4)):
        msgs.append({"role": "user", "content": content(rng)})
        for step in range(rng.randint(1, 3) if tools_on else 1):
            ids = []
            final = not tools_on or rng.random() < 0.4
            msgs.append(reasoned_assistant(rng, ids, tools_on, final))
            for tid in ids:
                msgs.append({"role": "tool", "tool_call_id": tid, "content": content(rng)})
            if final:
                break
    end = rng.random()
    if end < 0.3:
        msgs.append({"role": "user", "content": content(rng)})
    elif end < 0.4 and msgs[-1]["role"] == "assistant" and len(msgs) > 1:
        msgs.pop()
    tools = [tool_decl(rng, i) for i in range(rng.randint(1, 2))] if tools_on else None
    return msgs, tools


def reasoning_corpus(n, seed=2606):
    rng = random.Random(seed)
    return [reasoning_conversation(rng) for _ in range(n)]
