/*
 * Pre-tokenization: a sequence of split steps (regex splits, Hugging Face's
 * Digits and ByteLevel prefix space), each applied to every piece the
 * previous step produced, as Hugging Face's PreTokenizedString does. The
 * named patterns get a hand-written scanner that agrees with the regex.
 */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

typedef struct named_pattern {
  const char *name;
  const char *regex; /* Rust syntax, verbatim from the reference */
  df_scanner scanner;
  bool nfc;
} named_pattern;

static const named_pattern NAMED[] = {
    {"cl100k",
     "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}++|\\p{N}{1,3}+| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*+"
     "|\\s++$|\\s*[\\r\\n]|\\s+(?!\\S)|\\s",
     DF_SCAN_CL100K, false},
    {"o200k",
     "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
     "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
     "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
     DF_SCAN_O200K, false},
    {"kimi-k2",
     "[\\p{Han}]+"
     "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*"
     "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
     "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+"
     "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
     "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
     DF_SCAN_KIMI, false},
    {"qwen2",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
     "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
     DF_SCAN_QWEN2, true},
    {"qwen3.5",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"
     "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
     DF_SCAN_QWEN35, true},
    {"gpt2", "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+",
     DF_SCAN_NONE, false},
};

static const named_pattern *find_named(const char *name) {
  for (size_t i = 0; i < DF_ARRAY_LEN(NAMED); i++)
    if (!strcmp(name, NAMED[i].name)) return &NAMED[i];
  /* aliases */
  if (!strcmp(name, "cl100k_base")) return &NAMED[0];
  if (!strcmp(name, "o200k_base")) return &NAMED[1];
  if (!strcmp(name, "kimi") || !strcmp(name, "kimi_k2")) return &NAMED[2];
  if (!strcmp(name, "qwen3") || !strcmp(name, "qwen2.5")) return &NAMED[3];
  if (!strcmp(name, "qwen3.6")) return &NAMED[4];
  return NULL;
}

bool df_pattern_is_named(const char *name) { return find_named(name) != NULL; }

/* A named pattern is also recognised when a tokenizer.json spells its regex. */
static const named_pattern *find_by_regex(const char *rx) {
  for (size_t i = 0; i < DF_ARRAY_LEN(NAMED); i++)
    if (!strcmp(rx, NAMED[i].regex)) return &NAMED[i];
  return NULL;
}

static bool env_disables_scanner(void) { return df_env_on(getenv("DFLASH_TOKENIZER_NO_SCANNER")); }

dflash_status df_pretok_add_step(df_pretok *p, df_pretok_step step) {
  df_pretok_step *s = realloc(p->steps, (p->n_steps + 1) * sizeof *s);
  if (!s) {
    pcre2_code_free(step.re);
    free(step.source);
    return df_error_nomem("pre-tokenizer");
  }
  p->steps = s;
  p->steps[p->n_steps++] = step;
  return DFLASH_OK;
}

static dflash_status compile(const char *pcre, bool literal, pcre2_code **out) {
  int err;
  PCRE2_SIZE off;
  uint32_t flags = literal ? PCRE2_UTF | PCRE2_LITERAL
                           : PCRE2_UTF | PCRE2_UCP | PCRE2_DOLLAR_ENDONLY;
  *out = pcre2_compile((PCRE2_SPTR)pcre, PCRE2_ZERO_TERMINATED, flags, &err, &off, NULL);
  if (!*out) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    return df_error(DFLASH_E_REGEX, "regex /%s/: %s at offset %zu", pcre, (const char *)msg,
                    (size_t)off);
  }
  /* JIT is an optimisation: without it (unsupported CPU) the interpreter runs. */
  pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE);
  return DFLASH_OK;
}

dflash_status df_pretok_add_regex(df_pretok *p, const char *pattern, bool literal,
                                  df_split_behavior behavior, bool invert, bool keep_gaps,
                                  bool *nfc) {
  const named_pattern *named = literal ? NULL : find_named(pattern);
  if (named && nfc) *nfc = named->nfc; /* only a name implies a normaliser */
  if (!named && !literal) named = find_by_regex(pattern);
  const char *rx = named ? named->regex : pattern;
  if (!df_utf8_valid(rx, strlen(rx))) return df_error(DFLASH_E_UTF8, "regex is not valid UTF-8");
  char *pcre = NULL;
  dflash_status st = literal ? DFLASH_OK : df_regex_translate(rx, &pcre);
  if (st) return df_error_wrap(st, "pattern /%s/", rx);
  df_pretok_step step = {.kind = DF_STEP_REGEX,
                         .behavior = behavior,
                         .invert = invert,
                         .keep_gaps = keep_gaps};
  st = compile(literal ? rx : pcre, literal, &step.re);
  free(pcre);
  if (st) return st;
  step.literal = literal;
  if (!(step.source = df_strdup(rx))) {
    pcre2_code_free(step.re);
    return df_error_nomem("pre-tokenizer");
  }
  if (named && named->scanner != DF_SCAN_NONE && !invert && !env_disables_scanner() &&
      df_scan_init() == DFLASH_OK)
    step.scanner = named->scanner;
  return df_pretok_add_step(p, step);
}

void df_pretok_free(df_pretok *p) {
  for (size_t i = 0; i < p->n_steps; i++) {
    pcre2_code_free(p->steps[i].re);
    free(p->steps[i].source);
  }
  free(p->steps);
  memset(p, 0, sizeof *p);
}

/* Double the capacity of r (256 at first). */
static dflash_status ranges_grow(df_ranges *r) {
  size_t cap = r->cap ? r->cap * 2 : 256;
  df_range *v = realloc(r->v, cap * sizeof *v);
  if (!v) return df_error_nomem("pre-tokenizer pieces");
  r->v = v;
  r->cap = cap;
  return DFLASH_OK;
}

dflash_status df_ranges_push(df_ranges *r, size_t b, size_t e) {
  if (r->len == r->cap) {
    dflash_status st = ranges_grow(r);
    if (st) return st;
  }
  r->v[r->len++] = (df_range){b, e};
  return DFLASH_OK;
}

void df_pretok_scratch_free(df_pretok_scratch *s) {
  pcre2_match_data_free(s->md);
  pcre2_match_context_free(s->mctx);
  pcre2_jit_stack_free(s->jit_stack);
  free(s->a.v);
  free(s->b.v);
  df_buf_free(&s->prefixed);
  memset(s, 0, sizeof *s);
}

static dflash_status scratch_ready(df_pretok_scratch *s) {
  if (s->md) return DFLASH_OK;
  s->md = pcre2_match_data_create(16, NULL);
  s->mctx = pcre2_match_context_create(NULL);
  if (!s->md || !s->mctx) return df_error_nomem("regex match data");
  return DFLASH_OK;
}

/* The JIT's default 32 KiB stack suffices for real text; a pathological piece
 * gets a large one on demand. */
static bool grow_jit_stack(df_pretok_scratch *s) {
  if (s->jit_stack) return false;
  s->jit_stack = pcre2_jit_stack_create(256 * 1024, 64 * 1024 * 1024, NULL);
  if (!s->jit_stack) return false;
  pcre2_jit_stack_assign(s->mctx, NULL, s->jit_stack);
  return true;
}

/* Next match in text[b..e) at or after `pos` (offsets relative to text). */
static dflash_status next_match(const df_pretok_step *st, const char *text, size_t b, size_t e,
                                size_t pos, df_pretok_scratch *s, size_t *mb, size_t *me) {
  if (st->scanner != DF_SCAN_NONE) {
    size_t n = df_scan_next(st->scanner, (const uint8_t *)text + b, e - b, pos - b);
    if (n) { /* else nothing matches here: let the regex find the next match */
      *mb = pos;
      *me = pos + n;
      return DFLASH_OK;
    }
  }
  for (;;) {
    int rc = pcre2_match(st->re, (PCRE2_SPTR)text + b, e - b, pos - b, PCRE2_NO_UTF_CHECK, s->md,
                         s->mctx);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT && grow_jit_stack(s)) continue;
    if (rc == PCRE2_ERROR_NOMATCH) {
      *mb = *me = e;
      return DFLASH_OK;
    }
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      return df_error(DFLASH_E_REGEX, "pre-tokenizer regex failed at byte %zu: %s", pos,
                      (const char *)msg);
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(s->md);
    if (ov[1] > ov[0]) {
      *mb = b + ov[0];
      *me = b + ov[1];
      return DFLASH_OK;
    }
    /* An empty match splits nothing: look again one character further. */
    pos = b + ov[0];
    if (pos >= e) {
      *mb = *me = e;
      return DFLASH_OK;
    }
    do pos++;
    while (pos < e && ((uint8_t)text[pos] & 0xC0) == 0x80);
  }
}

/* Hugging Face's split behaviours over the alternating gap/match list. */
typedef struct split_state {
  df_ranges *out;
  df_split_behavior behavior;
  bool prev_match;
  bool pending_next; /* MergedWithNext: the last pushed piece waits for the next */
} split_state;

static dflash_status split_emit(split_state *ss, size_t b, size_t e, bool is_match) {
  df_ranges *o = ss->out;
  dflash_status st = DFLASH_OK;
  switch (ss->behavior) {
  case DF_SPLIT_ISOLATED: st = df_ranges_push(o, b, e); break;
  case DF_SPLIT_REMOVED:
    if (!is_match) st = df_ranges_push(o, b, e);
    break;
  case DF_SPLIT_CONTIGUOUS:
    if (o->len && is_match == ss->prev_match && ss->pending_next) o->v[o->len - 1].end = e;
    else st = df_ranges_push(o, b, e);
    ss->pending_next = true;
    break;
  case DF_SPLIT_MERGED_PREV:
    if (is_match && !ss->prev_match && o->len && ss->pending_next) o->v[o->len - 1].end = e;
    else st = df_ranges_push(o, b, e);
    ss->pending_next = true;
    break;
  case DF_SPLIT_MERGED_NEXT:
    /* A match joins the piece that follows it; consecutive matches stay apart. */
    if (ss->pending_next && !is_match) o->v[o->len - 1].end = e;
    else st = df_ranges_push(o, b, e);
    ss->pending_next = is_match;
    break;
  }
  ss->prev_match = is_match;
  return st;
}

/* The common case, a scanner splitting into isolated pieces: the scanner writes what it
 * matches straight into the list, without the per-piece dispatch of the general loop.
 * Returns where it stopped (a place where the scanner matches nothing, or e). */
static size_t scan_isolated(const df_pretok_step *st, const char *text, size_t b, size_t e,
                            df_ranges *out, dflash_status *rc) {
  size_t pos = b;
  while (pos < e) {
    if (out->len == out->cap && (*rc = ranges_grow(out))) break;
    size_t stop, n = df_scan_pieces(st->scanner, (const uint8_t *)text + b, e - b, pos - b, b,
                                    out->v + out->len, out->cap - out->len, &stop);
    out->len += n;
    pos = b + stop;
    if (!n) break;
  }
  return pos;
}

dflash_status df_regex_split(const df_pretok_step *st, const char *text, size_t b, size_t e,
                             df_pretok_scratch *s, df_ranges *out) {
  dflash_status rc = scratch_ready(s);
  split_state ss = {.out = out, .behavior = st->behavior};
  size_t pos = b;
  if (!rc && st->scanner != DF_SCAN_NONE && st->behavior == DF_SPLIT_ISOLATED && !st->invert)
    pos = scan_isolated(st, text, b, e, out, &rc);
  while (!rc && pos < e) {
    size_t mb = e, me = e;
    if ((rc = next_match(st, text, b, e, pos, s, &mb, &me))) break;
    if (mb > pos && st->keep_gaps) rc = split_emit(&ss, pos, mb, st->invert);
    if (!rc && me > mb) rc = split_emit(&ss, mb, me, !st->invert);
    pos = me > mb ? me : e;
  }
  return rc;
}

/* Give every piece a leading space unless it has one (HF ByteLevel add_prefix_space). */
static dflash_status prefix_spaces(const char *text, const df_ranges *in, df_buf *dst,
                                   df_ranges *out) {
  dst->len = 0;
  out->len = 0;
  for (size_t k = 0; k < in->len; k++) {
    size_t b = in->v[k].begin, e = in->v[k].end, start = dst->len;
    if ((b == e || text[b] != ' ') && df_buf_append(dst, " ", 1)) return DFLASH_E_NOMEM;
    if (df_buf_append(dst, text + b, e - b) || df_ranges_push(out, start, dst->len))
      return DFLASH_E_NOMEM;
  }
  return DFLASH_OK;
}

dflash_status df_pretok_run(const df_pretok *p, const char *text, size_t len, df_pretok_scratch *s,
                            const char **text_out, df_ranges **out) {
  df_ranges *cur = &s->a, *next = &s->b;
  cur->len = 0;
  dflash_status st = df_ranges_push(cur, 0, len);
  df_buf spare = {0};
  for (size_t k = 0; k < p->n_steps && !st; k++) {
    const df_pretok_step *step = &p->steps[k];
    next->len = 0;
    if (step->kind == DF_STEP_PREFIX_SPACE) {
      /* Write into whichever buffer `text` is not. */
      df_buf *dst = text == s->prefixed.data ? &spare : &s->prefixed;
      st = prefix_spaces(text, cur, dst, next);
      if (dst == &spare) { /* swap so the live text stays in s->prefixed */
        df_buf old = s->prefixed;
        s->prefixed = spare;
        spare = old;
      }
      text = s->prefixed.data ? s->prefixed.data : "";
    } else {
      for (size_t i = 0; i < cur->len && !st; i++)
        st = df_regex_split(step, text, cur->v[i].begin, cur->v[i].end, s, next);
    }
    df_ranges *t = cur;
    cur = next;
    next = t;
  }
  df_buf_free(&spare);
  *text_out = text;
  *out = cur;
  return st;
}
