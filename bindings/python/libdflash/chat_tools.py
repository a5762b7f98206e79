"""Kimi K2.5/K2.6 tool declarations in the TypeScript-like form (`tools_ts_str`) that
the official tokenizer puts in the prompt (see dflash_chat_tools_typescript in
dflash/chat.h)."""
import ctypes
import json

from ._lib import Error, bind

_ts = bind("dflash_chat_tools_typescript",
           [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_size_t)])


def tools_typescript(tools, sort_keys=True):
    """The declaration of `tools` (a list of {"type": "function", "function": {...}}
    dicts, or its JSON text) as a str. sort_keys=True sorts every object's keys first,
    as the tokenizer does. Raises libdflash.Error: DFLASH_E_FORMAT where Moonshot's
    converter raises (the tokenizer then declares JSON), DFLASH_E_UNSUPPORTED where it
    would print a Python repr."""
    if not isinstance(tools, (bytes, str)):
        tools = json.dumps(tools, ensure_ascii=False)
    data = tools.encode() if isinstance(tools, str) else tools
    n = ctypes.c_size_t()
    buf = ctypes.create_string_buffer(4 * len(data) + 4096)
    try:
        _ts(data, len(data), int(bool(sort_keys)), buf, len(buf), ctypes.byref(n))
    except Error as e:
        if e.status != "DFLASH_E_BUFFER":
            raise
        buf = ctypes.create_string_buffer(n.value)
        _ts(data, len(data), int(bool(sort_keys)), buf, len(buf), ctypes.byref(n))
    return buf.raw[:n.value].decode()
