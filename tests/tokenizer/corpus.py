"""Deterministic test corpus for tokenizer parity (shared by the oracles and bench/).

strings(): several thousand short, adversarial strings (one category each);
documents(mb): multi-KB documents mixing every category, about `mb` megabytes.
invalid_bytes(): byte strings that are not valid UTF-8.
"""
import random
import unicodedata

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|endofprompt|>",
            "[BOS]", "[EOS]", "<|im_user|>", "<|im_middle|>", "<|reserved_token_163700|>",
            "<think>", "</think>", "<|tool_call_begin|>"]

WORDS = ("the of and to in is you that it he was for on are as with his they I at be this have "
         "from or one had by word but not what all were we when your can said there use an each "
         "which she do how their if will up other about out many then them these so some her "
         "would make like him into time has look two more write go see number no way could people "
         "my than first water been call who oil its now find long down day did get come made may "
         "part tokenizer encoding Hello WORLD McDonald iPhone naïve café résumé Straße Ωmega "
         "HTTPServer getX camelCase snake_case SCREAMING_CASE x86_64 don't won't y'all").split()

CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Re", "'rE",
                "'VE", "'Ve", "'M", "'LL", "'Ll", "'lL", "'D", "\u2019s", "'\u017f", "'\u212a",
                "'", "''", "'x", "'\u0130", "'\u0131"]

WS = [" ", "  ", "   ", "\t", "\n", "\r\n", "\r", "\n\n", " \n", "\n ", " \r\n ", "\u00a0",
      "\u3000", "\u2028", "\u2029", "\u0085", "\u180e", "\u200b", "\u000b", "\u000c", "\u001c",
      "\u202f", "\u2009", "\t\t\n", "\r\r\n"]

CODE = ["def f(x):\n    return x ** 2  # square\n",
        "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
        "if __name__ == \"__main__\":\n    main()\n",
        "const re = /[a-z]+\\d{2,}/gi; // regex\n",
        "<div class=\"x\">&nbsp;<br/></div>\r\n",
        "SELECT * FROM t WHERE id IN (1, 2, 3);\n",
        "#include <stdio.h>\nint main(void){puts(\"hi\");}\n",
        "x = {'a': [1, 2.5e-3, None], \"b\": True}\n",
        "    \n        \n\t\n",
        "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }\n",
        "a/b//c///d/./e", "path/to/file.txt\n", "http://example.com/a?b=c&d=e#f\n"]


def _ranges(*pairs):
    out = []
    for lo, hi in pairs:
        out.extend(range(lo, hi + 1))
    return out


HAN = _ranges((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0xF900, 0xFAFF))
KANA = _ranges((0x3041, 0x3096), (0x30A1, 0x30FA), (0x30FC, 0x30FE), (0x31F0, 0x31FF))
HANGUL = _ranges((0xAC00, 0xD7A3), (0x1100, 0x11FF), (0x3131, 0x318E))
CJK_PUNCT = _ranges((0x3001, 0x3003), (0x3008, 0x3011), (0xFF01, 0xFF0F), (0x3005, 0x3007),
                    (0x303B, 0x303C), (0x30FB, 0x30FB), (0xFF10, 0xFF19))
ARABIC = _ranges((0x0621, 0x064A), (0x064B, 0x0652), (0x0660, 0x0669), (0x06F0, 0x06F9))
DEVANAGARI = _ranges((0x0904, 0x0939), (0x093E, 0x094D), (0x0966, 0x096F), (0x0958, 0x095F))
THAI = _ranges((0x0E01, 0x0E3A), (0x0E40, 0x0E4E), (0x0E50, 0x0E59))
COMBINING = _ranges((0x0300, 0x036F), (0x1AB0, 0x1ABE), (0x20D0, 0x20F0), (0xFE20, 0xFE2F))
EMOJI = _ranges((0x1F600, 0x1F64F), (0x1F300, 0x1F5FF), (0x1F900, 0x1F9FF), (0x2600, 0x26FF))
SKIN = _ranges((0x1F3FB, 0x1F3FF))
DIGITS_U = _ranges((0x0660, 0x0669), (0x0966, 0x096F), (0xFF10, 0xFF19), (0x00B2, 0x00B3),
                   (0x00BC, 0x00BE), (0x2160, 0x2188), (0x1D7CE, 0x1D7FF), (0x2070, 0x2079))


def _assigned():
    """Every assigned, non-surrogate code point Python's Unicode tables know."""
    return [c for c in range(0x110000)
            if unicodedata.category(chr(c)) not in ("Cn", "Cs")]


_ASSIGNED = None


def _pick(rng, pool, n):
    return "".join(chr(rng.choice(pool)) for _ in range(n))


def _english(rng):
    n = rng.randint(1, 30)
    words = [rng.choice(WORDS) for _ in range(n)]
    if rng.random() < 0.3:
        words = [w.upper() if rng.random() < 0.2 else w.capitalize() for w in words]
    s = " ".join(words)
    return s + rng.choice([".", "!", "?", "", ",", "...", ";", ":"])


def _contractions(rng):
    parts = []
    for _ in range(rng.randint(1, 6)):
        w = rng.choice(WORDS + ["I", "YOU", "We", "they", "it", "", " "])
        parts.append(w + rng.choice(CONTRACTIONS) + rng.choice(["", " ", "s", "x", "\n", "'"]))
    return "".join(parts)


def _cjk(rng):
    out = []
    for _ in range(rng.randint(1, 12)):
        pool = rng.choice([HAN, HAN, KANA, HANGUL, CJK_PUNCT])
        out.append(_pick(rng, pool, rng.randint(1, 8)))
        if rng.random() < 0.3:
            out.append(rng.choice([" ", "abc", "ABC ", "123", "、", "。", "〃", "\n", "x、y"]))
    return "".join(out)


def _script(rng):
    pool = rng.choice([ARABIC, DEVANAGARI, THAI])
    words = []
    for _ in range(rng.randint(1, 10)):
        w = _pick(rng, pool, rng.randint(1, 7))
        if rng.random() < 0.3:
            w += _pick(rng, COMBINING, rng.randint(1, 3))
        words.append(w)
    return rng.choice([" ", "  ", "\n", "، ", "। "]).join(words)


def _combining(rng):
    base = rng.choice(["e", "a", "o", "E", "n", "u", "i", "A", "\u1100", "\u3131", " ", "1"])
    s = base + _pick(rng, COMBINING, rng.randint(1, 4))
    if rng.random() < 0.5:  # decomposed Hangul / Latin, NFC composes these
        s += unicodedata.normalize("NFD", rng.choice(["한국어", "café", "Ångström", "ñandú", "é"]))
    return s + rng.choice(["", " word", "x\u0301y", "\u0301"])


def _emoji(rng):
    out = []
    for _ in range(rng.randint(1, 6)):
        e = chr(rng.choice(EMOJI))
        r = rng.random()
        if r < 0.25:
            e += chr(rng.choice(SKIN))
        elif r < 0.45:
            e += "\u200d" + chr(rng.choice(EMOJI)) + ("\ufe0f" if rng.random() < 0.5 else "")
        elif r < 0.55:
            e = chr(0x1F1E6 + rng.randrange(26)) + chr(0x1F1E6 + rng.randrange(26))
        out.append(e)
        out.append(rng.choice(["", " ", "  ", "x", "\n", "!"]))
    return "".join(out)


def _whitespace(rng):
    parts = []
    for _ in range(rng.randint(1, 8)):
        parts.append(rng.choice(WS) * rng.randint(1, 6))
        parts.append(rng.choice(["", "a", "B", "1", ".", "word", "日本", "\u0301"]))
    return "".join(parts)


def _digits(rng):
    r = rng.random()
    if r < 0.5:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 40)))
    if r < 0.8:
        return rng.choice(["", "$", "-", "+", "v"]) + str(rng.randint(0, 10**12)) + \
            rng.choice(["", ".5", ",000", "%", "e10", "th", " 123", "/7"])
    return _pick(rng, DIGITS_U, rng.randint(1, 10)) + rng.choice(["", "1", " 2", "a"])


def _special(rng):
    parts = []
    for _ in range(rng.randint(1, 4)):
        sp = rng.choice(SPECIALS)
        r = rng.random()
        if r < 0.2:
            sp = sp[: rng.randint(1, len(sp) - 1)]  # a prefix only
        elif r < 0.3:
            sp = sp.upper()
        parts.append(sp)
        parts.append(rng.choice(["", " ", "\n", "text", " <|", "|>", "<", "[", "  "]))
    return "".join(parts)


def _random_unicode(rng):
    global _ASSIGNED
    if _ASSIGNED is None:
        _ASSIGNED = _assigned()
    return "".join(chr(rng.choice(_ASSIGNED)) if rng.random() < 0.8 else rng.choice(" \n.a1")
                   for _ in range(rng.randint(1, 25)))


def _random_bytes_text(rng):
    b = bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
    return b.decode("utf-8", "replace")


def _punct(rng):
    return "".join(rng.choice("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \n/") for _ in range(rng.randint(1, 30)))


def _code(rng):
    return "".join(rng.choice(CODE) for _ in range(rng.randint(1, 3)))


GENERATORS = [_english, _contractions, _cjk, _script, _combining, _emoji, _whitespace, _digits,
              _special, _random_unicode, _random_bytes_text, _punct, _code]


def _long(rng):
    """Long single-class runs (whitespace, letters, digits, punctuation)."""
    unit = rng.choice([" ", "\n", "a", "ab", "1", "!", "日", "\t ", "\r\n", "x ", "é", "😀"])
    return rng.choice(["", "x", " "]) + unit * rng.randint(100, 3000) + rng.choice(["", "y", " ", "\n"])


def repeated_long(n=4000, seed=77):
    """Texts whose pieces of 17..80 UTF-8 bytes (words of Cyrillic, Devanagari, Arabic and
    Thai letters, runs of Han, long Latin names) recur across calls and within one: the
    second sight of a 25..64-byte piece is answered from the tokenizer's long-piece cache,
    and 4,000 distinct pieces make some of them share its direct-mapped slots."""
    rng = random.Random(seed)
    cyr = _ranges((0x0430, 0x044F))
    pools = [cyr, cyr, DEVANAGARI, ARABIC, THAI, HAN, list(range(97, 123))]
    words = []
    for _ in range(n):
        pool = rng.choice(pools)
        width = len(chr(pool[0]).encode())
        w = _pick(rng, pool, rng.randint(17 // width, 80 // width))
        words.append(w.capitalize() if rng.random() < 0.2 else w)
    texts = []
    for _ in range(2 * n // 3):
        picked = [rng.choice(words) for _ in range(rng.randint(1, 6))]
        texts.append(" ".join(picked + picked[: rng.randint(0, 2)]))
    return texts


def strings(n=6000, seed=1234):
    rng = random.Random(seed)
    out = [""]
    for i in range(n):
        out.append(GENERATORS[i % len(GENERATORS)](rng))
    for _ in range(40):
        out.append(_long(rng))
    # mixtures of two categories glued together
    for _ in range(n // 4):
        out.append(rng.choice(GENERATORS)(rng) + rng.choice(["", " ", "\n"]) +
                   rng.choice(GENERATORS)(rng))
    # U+11A7 after an LV syllable: NFC keeps it (utf8proc 2.8 drops it), composed or not
    out += ["\uac8c\u11a7", "\u1100\u1161\u11a7\u11a8", "x\uac00\u11a7\u0301 \uac8c\u11a7\u11a7"]
    return out


def documents(mb=2.0, seed=99, doc_kb=16, only=None):
    """About `mb` megabytes of UTF-8 in documents of about doc_kb KiB each; `only`: one
    generator of GENERATORS instead of the weighted mix (bench/tokenizer_bench.py
    --by-category)."""
    rng = random.Random(seed)
    target = int(mb * 1024 * 1024)
    docs, total = [], 0
    weights = [8, 2, 3, 2, 1, 1, 2, 2, 1, 1, 1, 1, 4]
    while total < target:
        parts, size = [], 0
        while size < doc_kb * 1024:
            g = only or rng.choices(GENERATORS, weights)[0]
            s = g(rng) + rng.choice([" ", "\n", "\n\n", " ", ". "])
            parts.append(s)
            size += len(s.encode())
        d = "".join(parts)
        docs.append(d)
        total += len(d.encode())
    return docs


def invalid_bytes(n=500, seed=7):
    rng = random.Random(seed)
    out = [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"abc\xe2\x82", b"\xe2\x82abc",
           b"\xf0\x9f\x98", b"caf\xc3", b"\x80\x80 x", "日本".encode()[:-1] + b" tail"]
    for _ in range(n):
        good = rng.choice(GENERATORS)(rng).encode()
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randint(0, len(b))
            b[pos:pos] = bytes(rng.randrange(128, 256) for _ in range(rng.randint(1, 3)))
        if b and rng.random() < 0.3:  # cut in the middle of a character
            b = b[: rng.randint(0, len(b))]
        out.append(bytes(b))
    return out
