"""Chat templates: render conversations, spans and loss masks (see dflash/chat.h)."""
import ctypes
import json

import numpy as np

from ._lib import INDEX, KEY, Handle, bind, cstr, lib

SPAN_KINDS = ["scaffold", "system", "user", "tool_result", "tools", "gen_prompt",
              "think_markup", "reasoning", "content", "tool_call", "end_of_turn"]


class _Options(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("add_generation_prompt", ctypes.c_int32),
                ("thinking", ctypes.c_int32), ("preserve_thinking", ctypes.c_int32),
                ("reasoning", ctypes.c_int32)]


class _Span(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("begin", ctypes.c_size_t), ("end", ctypes.c_size_t), ("kind", ctypes.c_int32),
                ("message", ctypes.c_int32), ("generated", ctypes.c_int32)]


_vp = ctypes.c_void_p
bind("dflash_chat_options_init", [ctypes.POINTER(_Options), ctypes.c_size_t], None)
bind("dflash_chat_template_name_at", [ctypes.c_size_t], ctypes.c_char_p)
_create = bind("dflash_chat_template_create", [ctypes.c_char_p, ctypes.POINTER(_vp)], errors=KEY)
bind("dflash_chat_template_free", [_vp], None)
bind("dflash_chat_template_end_of_turn", [_vp], ctypes.c_char_p)
bind("dflash_chat_template_name", [_vp], ctypes.c_char_p)
_render_json = bind("dflash_chat_render_json", [_vp, ctypes.c_char_p, ctypes.c_size_t,
                                                ctypes.POINTER(_Options), ctypes.POINTER(_vp)])
_parse = bind("dflash_chat_conversation_parse", [ctypes.c_char_p, ctypes.c_size_t,
                                               ctypes.POINTER(_vp)])
bind("dflash_chat_conversation_free", [_vp], None)
bind("dflash_chat_conversation_message_count", [_vp], ctypes.c_size_t)
bind("dflash_chat_conversation_outcome", [_vp], ctypes.c_char_p)
bind("dflash_chat_conversation_unfinished", [_vp], ctypes.c_int32, status=False)
_tok_nfc = bind("dflash_chat_tokenizer_nfc", [_vp, ctypes.POINTER(ctypes.c_int)])
_check_tok = bind("dflash_chat_template_check_tokenizer", [_vp, _vp])
_encode = bind("dflash_chat_encode", [_vp, _vp, ctypes.c_int, ctypes.POINTER(ctypes.c_int32),
                                      ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t,
                                      ctypes.POINTER(ctypes.c_size_t),
                                      ctypes.POINTER(ctypes.c_size_t)])
_nfc = bind("dflash_chat_conversation_normalize_nfc", [_vp])
_render = bind("dflash_chat_render", [_vp, _vp, ctypes.POINTER(_Options), ctypes.POINTER(_vp)])
bind("dflash_chat_rendered_free", [_vp], None)
bind("dflash_chat_rendered_text", [_vp, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_void_p)
bind("dflash_chat_rendered_span_count", [_vp], ctypes.c_size_t)
_span = bind("dflash_chat_rendered_span", [_vp, ctypes.c_size_t, ctypes.POINTER(_Span)],
             errors=INDEX)
bind("dflash_chat_rendered_last_assistant", [_vp], ctypes.c_int32, status=False)
_u32p = ctypes.POINTER(ctypes.c_uint32)
_mask = bind("dflash_chat_loss_mask", [_vp, _u32p, _u32p, ctypes.c_size_t, ctypes.c_int,
                                       ctypes.POINTER(ctypes.c_uint8),
                                       ctypes.POINTER(ctypes.c_size_t)])


bind("dflash_chat_reasoning_name", [ctypes.c_int], ctypes.c_char_p)
_reasoning_from_name = bind("dflash_chat_reasoning_from_name",
                            [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)], errors=KEY)


def _reasoning_names():
    """name -> value of every reasoning mode, from the library (chat.h's one copy)."""
    names, i = {}, 0
    while (name := lib.dflash_chat_reasoning_name(i)) is not None:
        names[name.decode()] = i
        i += 1
    return names


REASONING = _reasoning_names()


def reasoning_mode(name):
    """The dflash_chat_reasoning value of a mode name ("official", "keep_all",
    "keep_after_last_user", "drop"); MissingKeyError (a KeyError) naming the known ones
    for another."""
    out = ctypes.c_int()
    _reasoning_from_name(cstr(name), ctypes.byref(out))
    return out.value


def template_names():
    """Names of the built-in templates."""
    names, i = [], 0
    while True:
        name = lib.dflash_chat_template_name_at(i)
        if name is None:
            return names
        names.append(name.decode())
        i += 1


def _conversation_json(messages, tools=None):
    if isinstance(messages, (str, bytes)):
        return messages.encode() if isinstance(messages, str) else messages
    obj = messages if isinstance(messages, dict) else {"messages": messages}
    if tools is not None:
        obj = dict(obj, tools=tools)
    return json.dumps(obj, ensure_ascii=False).encode()


class Conversation(Handle):
    """A parsed conversation: a list of message dicts, a conversation object
    (OpenAI "messages" or ShareGPT "conversations", optional "tools" and
    "completion") or its JSON text. len() is its message count (a fetch
    record's completion included)."""

    _free = "dflash_chat_conversation_free"

    def __init__(self, messages, tools=None):
        doc = _conversation_json(messages, tools)
        h = _vp()
        _parse(doc, len(doc), ctypes.byref(h))
        self._h = h

    def __len__(self):
        return lib.dflash_chat_conversation_message_count(self._handle())

    @property
    def outcome(self):
        """A fetch record's outcome ("ok", "length", "empty", ...), None without one."""
        v = lib.dflash_chat_conversation_outcome(self._handle())
        return v.decode() if v is not None else None

    @property
    def unfinished(self):
        """Index of the assistant message the target did not finish (cut by the length
        limit, or empty), None for none: its closing tokens are not supervised."""
        i = lib.dflash_chat_conversation_unfinished(self._handle())
        return None if i < 0 else i

    def normalize_nfc(self):
        """Normalise every string to Unicode NFC in place (for NFC tokenizers)."""
        _nfc(self._handle())
        return self


def tokenizer_nfc(tokenizer):
    """True when `tokenizer` (a libdflash.Tokenizer) normalises its input with NFC."""
    out = ctypes.c_int()
    _tok_nfc(tokenizer._handle(), ctypes.byref(out))
    return bool(out.value)


class Rendered(Handle):
    """A rendered conversation: `text` (str), `data` (its UTF-8 bytes), `spans`
    (list of dicts with byte ranges) and loss masks from token byte offsets."""

    _free = "dflash_chat_rendered_free"

    def __init__(self, handle):
        self._h = handle
        n = ctypes.c_size_t(0)
        ptr = lib.dflash_chat_rendered_text(handle, ctypes.byref(n))
        self.data = ctypes.string_at(ptr, n.value)
        self.text = self.data.decode("utf-8")
        self.last_assistant = lib.dflash_chat_rendered_last_assistant(handle)
        self.spans = []
        s = _Span(struct_size=ctypes.sizeof(_Span))
        for i in range(lib.dflash_chat_rendered_span_count(handle)):
            _span(handle, i, ctypes.byref(s))
            self.spans.append({"begin": s.begin, "end": s.end, "kind": SPAN_KINDS[s.kind],
                               "message": s.message, "generated": bool(s.generated)})

    def loss_mask(self, begin, end, last_turn_only=False):
        """uint8 mask for tokens covering bytes [begin[i], end[i]) of `data`."""
        b = np.ascontiguousarray(begin, dtype=np.uint32)
        e = np.ascontiguousarray(end, dtype=np.uint32)
        out = np.zeros(len(b), dtype=np.uint8)
        _mask(self._handle(), b.ctypes.data_as(_u32p), e.ctypes.data_as(_u32p), len(b),
              1 if last_turn_only else 0, out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), None)
        return out

    def encode(self, tokenizer, last_turn_only=False):
        """Tokenize the text with every special token recognised and build its
        loss mask in one call: (input_ids int32, loss_mask uint8, n_supervised).
        Raises Error DFLASH_E_MISMATCH when the tokens do not spell the text
        byte for byte (render with nfc=True for NFC tokenizers)."""
        cap = tokenizer.max_ids(len(self.data))
        ids = np.zeros(cap, dtype=np.int32)
        mask = np.zeros(cap, dtype=np.uint8)
        n, sup = ctypes.c_size_t(), ctypes.c_size_t()
        _encode(self._handle(), tokenizer._handle(), 1 if last_turn_only else 0,
                ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                mask.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), cap, ctypes.byref(n),
                ctypes.byref(sup))
        return ids[:n.value].copy(), mask[:n.value].copy(), sup.value


class ChatTemplate(Handle):
    """A built-in chat template by name ("qwen3", "kimi-k2-thinking", ...)."""

    _free = "dflash_chat_template_free"

    def __init__(self, name):
        h = _vp()
        _create(cstr(name), ctypes.byref(h))
        self._h = h
        self.name = lib.dflash_chat_template_name(h).decode()
        self.end_of_turn = lib.dflash_chat_template_end_of_turn(h).decode()

    def check_tokenizer(self, tokenizer):
        """Raise Error DFLASH_E_MISMATCH, naming them, when `tokenizer` splits any of the
        template's control tokens (turn markers, think and tool tags): another family's
        tokenizer, not the target's own."""
        _check_tok(self._handle(), tokenizer._handle())

    def _thinking(self, thinking, enable_thinking):
        """thinking=, or Hugging Face's enable_thinking= for the Qwen templates (the name
        their chat template reads); None: on, the templates' default."""
        if enable_thinking is not None:
            if not self.name.startswith("qwen"):
                raise TypeError(f"enable_thinking= is the Qwen templates' switch; the "
                                f"{self.name} template takes thinking=")
            if thinking is not None and bool(thinking) != bool(enable_thinking):
                raise ValueError(f"thinking={thinking!r} and enable_thinking="
                                 f"{enable_thinking!r} disagree (they are one switch)")
            return enable_thinking
        return True if thinking is None else thinking

    @staticmethod
    def _options(add_generation_prompt, thinking, preserve_thinking, reasoning):
        o = _Options()
        lib.dflash_chat_options_init(ctypes.byref(o), ctypes.sizeof(o))
        o.add_generation_prompt = int(bool(add_generation_prompt))
        o.thinking = int(bool(thinking))
        o.preserve_thinking = int(bool(preserve_thinking))
        o.reasoning = reasoning_mode(reasoning)
        return o

    def render_full(self, messages, tools=None, add_generation_prompt=False, thinking=None,
                    preserve_thinking=False, reasoning="official", nfc=False,
                    enable_thinking=None):
        """Render and return a Rendered (text, spans, masks). `messages` may be a list of
        dicts, a conversation object (dict), its JSON text or a Conversation. nfc=True
        first normalises every string to Unicode NFC (for tokenizers that normalise,
        e.g. Qwen's; see tokenizer_nfc); a Conversation is normalised in place.
        thinking (None: on): the thinking switch; the Qwen templates also take it under
        Hugging Face's name, enable_thinking= (ValueError when both are given and
        disagree; TypeError for a template that is not Qwen's)."""
        thinking = self._thinking(thinking, enable_thinking)
        opts = self._options(add_generation_prompt, thinking, preserve_thinking, reasoning)
        out = _vp()
        if isinstance(messages, Conversation):
            if nfc:
                messages.normalize_nfc()
            _render(self._handle(), messages._handle(), ctypes.byref(opts), ctypes.byref(out))
            return Rendered(out)
        if not nfc:
            doc = _conversation_json(messages, tools)
            _render_json(self._handle(), doc, len(doc), ctypes.byref(opts), ctypes.byref(out))
            return Rendered(out)
        with Conversation(messages, tools) as conv:
            return self.render_full(conv, add_generation_prompt=add_generation_prompt,
                                    thinking=thinking, preserve_thinking=preserve_thinking,
                                    reasoning=reasoning, nfc=True)

    def render(self, messages, **kwargs):
        """The rendered text (str); keywords as render_full (enable_thinking= included)."""
        r = self.render_full(messages, **kwargs)
        try:
            return r.text
        finally:
            r.close()


