/* Kimi K2.5/K2.6 tool declarations in the TypeScript-like form
 * (`tools_ts_str`) that Moonshot's tokenizer computes with
 * encode_tools_to_typescript_style() (tool_declaration_ts.py), byte-exact.
 *
 * The reference is a small Python class tree: a schema is first parsed into
 * typed nodes (resolving $ref names against a registry of $defs filled while
 * parsing), then each node prints itself. This file keeps the same two
 * phases and the same order, because both decide whether the reference
 * raises: a $ref resolves only against the $defs registered before it is
 * parsed, an invalid additionalProperties raises only when printed, and a
 * description is checked only where one is printed. Where the reference
 * raises, the conversion fails with DFLASH_E_FORMAT (the tokenizer then falls
 * back to JSON); where it prints the Python repr of a list or dict (an enum
 * member, a constraint value, a type or function name), which is not
 * reproduced, with DFLASH_E_UNSUPPORTED. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

typedef enum { TS_SCALAR, TS_OBJECT, TS_ARRAY, TS_ENUM, TS_ANYOF, TS_UNION, TS_REF } ts_kind;
typedef enum { AP_NONE, AP_ANY, AP_NEVER, AP_NODE, AP_BAD } ts_ap;

typedef struct ts_node ts_node;

typedef struct ts_param {
  const char *name;
  ts_node *type;
  bool optional;
  const json_t *dflt; /* NULL or JSON null: no default */
} ts_param;

struct ts_node {
  ts_kind kind;
  const json_t *schema;           /* the schema object; NULL for implicit "any"/"null" */
  const char *const *constraints; /* constraint keys this type shows, sorted; NULL-ended */
  const char *name;               /* implicit scalar or $ref name */
  const json_t *value;            /* scalar "type", enum list, union list */
  ts_param *props;                /* object */
  size_t n_props;
  ts_ap ap;
  ts_node *ap_node;
  ts_node **items; /* array item (one) or anyOf members */
  size_t n_items;
  ts_node *next_alloc;
};

typedef struct ts_ctx {
  json_t *defs; /* the registry: $defs name -> schema, in registration order */
  bool has_self_ref;
  ts_node *allocs;
  dflash_status st;          /* first failure where the reference raises: stops everything */
  dflash_status unsupported; /* a Python repr was needed: reported at the end */
  char unsupported_msg[512];
  df_out *out;
  size_t tool;
  const char *fn_name;
  char path[256];
} ts_ctx;

static const char *const STRING_KEYS[] = {"maxLength", "minLength", "pattern", NULL};
static const char *const NUMBER_KEYS[] = {"maximum", "minimum", NULL};
static const char *const ARRAY_KEYS[] = {"maxItems", "minItems", NULL};

/* ---- failures ---------------------------------------------------------------- */

static void where(const ts_ctx *c, char *buf, size_t cap) {
  snprintf(buf, cap, "tools[%zu] (function %s), %s", c->tool, c->fn_name ? c->fn_name : "?",
           c->path[0] ? c->path : "function");
}

/* The reference raises here. */
static void ts_raise(ts_ctx *c, const char *what) {
  if (c->st) return;
  char at[384];
  where(c, at, sizeof at);
  c->st = df_error(DFLASH_E_FORMAT, "%s: %s (the reference tool_declaration_ts raises)", at, what);
}

static void nomem(ts_ctx *c) {
  if (!c->st) c->st = df_error_nomem("tool declarations");
}

/* The reference prints a Python repr here; keep going, a later raise wins. */
static void need_repr(ts_ctx *c, const char *what) {
  if (c->unsupported) return;
  char at[384];
  where(c, at, sizeof at);
  snprintf(c->unsupported_msg, sizeof c->unsupported_msg,
           "%s: %s is a list or object, which the TypeScript-like declaration prints as a "
           "Python repr (not reproduced)",
           at, what);
  c->unsupported = DFLASH_E_UNSUPPORTED;
}

/* Path of the schema being read, for messages: push returns the old length. */
static size_t path_push(ts_ctx *c, const char *seg) {
  size_t n = strlen(c->path);
  snprintf(c->path + n, sizeof c->path - n, "%s%s", n ? "." : "", seg);
  return n;
}

static void path_pop(ts_ctx *c, size_t n) { c->path[n] = 0; }

/* ---- Python semantics --------------------------------------------------------- */

static bool truthy(const json_t *v) {
  if (!v) return false;
  switch (json_typeof(v)) {
  case JSON_OBJECT: return json_object_size(v) > 0;
  case JSON_ARRAY: return json_array_size(v) > 0;
  case JSON_STRING: return json_string_length(v) > 0;
  case JSON_INTEGER: return json_integer_value(v) != 0;
  case JSON_REAL: return json_real_value(v) != 0.0;
  case JSON_TRUE: return true;
  default: return false;
  }
}

static bool is_str(const json_t *v, const char *s) {
  return json_is_string(v) && strcmp(json_string_value(v), s) == 0 &&
         strlen(s) == json_string_length(v);
}

static void put(ts_ctx *c, const char *s) { df_out_cstr(c->out, s, DFLASH_CHAT_SPAN_TOOLS, -1); }

static void put_n(ts_ctx *c, const char *s, size_t n) {
  df_out_put(c->out, s, n, DFLASH_CHAT_SPAN_TOOLS, -1);
}

static void indent(ts_ctx *c, int depth) {
  for (int i = 0; i < depth; i++) put_n(c, "  ", 2);
}

/* str(v) as an f-string prints it. */
static void put_pystr(ts_ctx *c, const json_t *v, const char *what) {
  if (json_is_object(v) || json_is_array(v)) {
    need_repr(c, what);
    return put(c, "?");
  }
  df_pystr(c->out, v, DFLASH_CHAT_SPAN_TOOLS, -1);
}

/* _format_description(): "// " before every non-empty line. */
static void put_description(ts_ctx *c, const json_t *desc, int depth) {
  if (!json_is_string(desc)) return ts_raise(c, "a description that is not a string");
  const char *s = json_string_value(desc), *end = s + json_string_length(desc);
  for (;;) {
    const char *nl = memchr(s, '\n', (size_t)(end - s));
    const char *stop = nl ? nl : end;
    if (stop > s) {
      indent(c, depth);
      put(c, "// ");
      put_n(c, s, (size_t)(stop - s));
    }
    if (!nl) break;
    put(c, "\n");
    s = nl + 1;
  }
}

/* ---- nodes ------------------------------------------------------------------ */

static ts_node *node_new(ts_ctx *c, ts_kind kind, const json_t *schema) {
  ts_node *n = calloc(1, sizeof *n);
  if (!n) {
    nomem(c);
    return NULL;
  }
  n->kind = kind;
  n->schema = schema;
  n->next_alloc = c->allocs;
  c->allocs = n;
  return n;
}

static void nodes_free(ts_ctx *c) {
  while (c->allocs) {
    ts_node *n = c->allocs;
    c->allocs = n->next_alloc;
    free(n->props);
    free(n->items);
    free(n);
  }
}

static ts_node *implicit_scalar(ts_ctx *c, const char *name) {
  ts_node *n = node_new(c, TS_SCALAR, NULL);
  if (n) n->name = name;
  return n;
}

static ts_node *parse_type(ts_ctx *c, const json_t *s);

/* Iterating a JSON value as Python's `for x in value` would: a list gives
 * its items, a string its characters, a dict its keys. `fn` gets each item
 * (a borrowed or temporary value). Returns false when Python raises. */
typedef void (*each_fn)(ts_ctx *c, const json_t *item, void *arg);

static bool py_iterate(ts_ctx *c, const json_t *v, each_fn fn, void *arg) {
  if (json_is_array(v)) {
    for (size_t i = 0; i < json_array_size(v) && !c->st; i++) fn(c, json_array_get(v, i), arg);
    return true;
  }
  if (json_is_string(v) || json_is_object(v)) {
    const char *s = json_is_string(v) ? json_string_value(v) : NULL;
    size_t n = s ? json_string_length(v) : 0;
    const char *key;
    json_t *val;
    if (s) {
      for (size_t i = 0; i < n && !c->st;) {
        size_t k = 1;
        while (i + k < n && (((unsigned char)s[i + k]) & 0xc0) == 0x80) k++;
        json_t *ch = json_stringn(s + i, k);
        if (!ch) return nomem(c), true;
        fn(c, ch, arg);
        json_decref(ch);
        i += k;
      }
      return true;
    }
    json_object_foreach((json_t *)v, key, val) {
      json_t *k = json_string(key);
      if (!k) return nomem(c), true;
      fn(c, k, arg);
      json_decref(k);
      if (c->st) break;
    }
    return true;
  }
  return false;
}

static void object_parse_defs(ts_ctx *c, const json_t *s) {
  const json_t *defs = json_object_get(s, "$defs");
  if (!defs || !truthy(defs)) return;
  if (!json_is_object(defs)) return ts_raise(c, "\"$defs\" is not an object");
  const char *key;
  json_t *val;
  json_object_foreach((json_t *)defs, key, val) {
    /* A name registered again keeps its place with the new schema (a dict). */
    if (json_object_set(c->defs, key, val)) return nomem(c);
  }
}

/* `name in set(required)` for the JSON value `required` (absent: []). */
static bool is_required(ts_ctx *c, const json_t *required, const char *name) {
  if (!required) return false;
  if (json_is_array(required)) {
    for (size_t i = 0; i < json_array_size(required); i++)
      if (is_str(json_array_get(required, i), name)) return true;
    return false;
  }
  if (json_is_object(required)) return json_object_get(required, name) != NULL;
  if (json_is_string(required)) { /* set(str): its characters */
    size_t n = strlen(name), k = 1;
    while (k < n && (((unsigned char)name[k]) & 0xc0) == 0x80) k++;
    return n && k == n &&
           memmem(json_string_value(required), json_string_length(required), name, n) != NULL;
  }
  (void)c;
  return false;
}

/* set(required) raises for scalars and for unhashable (list, dict) items. */
static void check_required(ts_ctx *c, const json_t *required) {
  if (!required || json_is_string(required) || json_is_object(required)) return;
  if (!json_is_array(required)) return ts_raise(c, "\"required\" is not a list");
  for (size_t i = 0; i < json_array_size(required); i++) {
    const json_t *r = json_array_get(required, i);
    if (json_is_array(r) || json_is_object(r))
      return ts_raise(c, "\"required\" holds a list or object");
  }
}

static void object_parse_props(ts_ctx *c, ts_node *n, const json_t *props, const json_t *required) {
  n->props = calloc(json_object_size(props) ? json_object_size(props) : 1, sizeof *n->props);
  if (!n->props) return nomem(c);
  const char *key;
  json_t *val;
  size_t saved = path_push(c, "properties");
  json_object_foreach((json_t *)props, key, val) {
    size_t at = path_push(c, key);
    ts_param *p = &n->props[n->n_props++];
    p->name = key;
    p->type = parse_type(c, val);
    p->optional = !is_required(c, required, key);
    p->dflt = json_is_object(val) ? json_object_get(val, "default") : NULL;
    path_pop(c, at);
    if (c->st) break;
  }
  path_pop(c, saved);
}

/* _ParameterTypeObject.__init__: $defs first, then additionalProperties,
 * then the properties in their order. */
static ts_node *parse_object(ts_ctx *c, const json_t *s) {
  ts_node *n = node_new(c, TS_OBJECT, s);
  if (!n || json_object_size(s) == 0) return n;
  object_parse_defs(c, s);
  if (c->st) return n;
  const json_t *ap = json_object_get(s, "additionalProperties");
  if (!ap || json_is_null(ap)) n->ap = AP_NONE;
  else if (json_is_true(ap)) n->ap = AP_ANY;
  else if (json_is_false(ap)) n->ap = AP_NEVER;
  else if (json_is_object(ap)) {
    size_t at = path_push(c, "additionalProperties");
    n->ap = AP_NODE;
    n->ap_node = parse_type(c, ap);
    path_pop(c, at);
  } else n->ap = AP_BAD; /* raises when printed */
  const json_t *props = json_object_get(s, "properties");
  if (c->st || !props) return n;
  if (!json_is_object(props)) return ts_raise(c, "\"properties\" is not an object"), n;
  const json_t *required = json_object_get(s, "required");
  check_required(c, required);
  if (!c->st) object_parse_props(c, n, props, required);
  return n;
}

static ts_node *parse_array(ts_ctx *c, const json_t *s) {
  ts_node *n = node_new(c, TS_ARRAY, s);
  if (!n) return NULL;
  n->constraints = ARRAY_KEYS;
  n->items = calloc(1, sizeof *n->items);
  if (!n->items) return nomem(c), n;
  n->n_items = 1;
  const json_t *items = json_object_get(s, "items");
  size_t at = path_push(c, "items");
  n->items[0] = truthy(items) ? parse_type(c, items) : implicit_scalar(c, "any");
  path_pop(c, at);
  return n;
}

/* The enum's declared type, as the reference narrows ["T", "null"]; NULL
 * when there is no "type". */
static const json_t *enum_type(ts_ctx *c, const json_t *s) {
  const json_t *typ = json_object_get(s, "type");
  if (!typ || !json_is_array(typ)) return typ;
  size_t len = json_array_size(typ);
  if (len == 1) return json_array_get(typ, 0);
  const json_t *a = json_array_get(typ, 0), *b = json_array_get(typ, 1);
  if (len == 2 && (is_str(a, "null") || is_str(b, "null"))) return is_str(a, "null") ? b : a;
  ts_raise(c, "an enum whose \"type\" list is not [T] or [T, \"null\"]");
  return NULL;
}

static void enum_check(ts_ctx *c, const json_t *val, void *arg) {
  const json_t *typ = arg;
  bool num = json_is_integer(val) || json_is_real(val) || json_is_boolean(val);
  if (json_is_null(val)) return;
  if (is_str(typ, "string") && !json_is_string(val)) ts_raise(c, "an enum value is not a string");
  else if (is_str(typ, "number") && !num) ts_raise(c, "an enum value is not a number");
  else if (is_str(typ, "integer") && !(json_is_integer(val) || json_is_boolean(val)))
    ts_raise(c, "an enum value is not an integer");
  else if (is_str(typ, "boolean") && !json_is_boolean(val))
    ts_raise(c, "an enum value is not a boolean");
}

static ts_node *parse_enum(ts_ctx *c, const json_t *s) {
  ts_node *n = node_new(c, TS_ENUM, s);
  if (!n) return NULL;
  n->value = json_object_get(s, "enum");
  if (!json_object_get(s, "type")) return n;
  const json_t *typ = enum_type(c, s);
  if (!c->st && !py_iterate(c, n->value, enum_check, (void *)typ))
    ts_raise(c, "\"enum\" is not a list");
  return n;
}

static void anyof_member(ts_ctx *c, const json_t *item, void *arg) {
  ts_node *n = arg;
  char seg[32];
  snprintf(seg, sizeof seg, "anyOf[%zu]", n->n_items);
  size_t at = path_push(c, seg);
  ts_node **grown = realloc(n->items, (n->n_items + 1) * sizeof *grown);
  if (!grown) return nomem(c);
  n->items = grown;
  n->items[n->n_items++] = parse_type(c, item);
  path_pop(c, at);
}

static ts_node *parse_anyof(ts_ctx *c, const json_t *s) {
  ts_node *n = node_new(c, TS_ANYOF, s);
  if (n && !py_iterate(c, json_object_get(s, "anyOf"), anyof_member, n))
    ts_raise(c, "\"anyOf\" is not a list");
  return n;
}

static const char *union_name(const json_t *t) {
  static const char *const map[][2] = {{"string", "string"},   {"number", "number"},
                                       {"integer", "number"},  {"boolean", "boolean"},
                                       {"null", "null"},       {"object", "{}"},
                                       {"array", "Array<any>"}};
  for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
    if (is_str(t, map[i][0])) return map[i][1];
  return NULL;
}

static ts_node *parse_union(ts_ctx *c, const json_t *s) {
  ts_node *n = node_new(c, TS_UNION, s);
  if (!n) return NULL;
  n->value = json_object_get(s, "type");
  for (size_t i = 0; i < json_array_size(n->value); i++)
    if (!union_name(json_array_get(n->value, i)))
      return ts_raise(c, "a \"type\" list names an unknown type"), n;
  return n;
}

/* _SchemaRegistry.resolve_ref(): "#" (the parameters themselves) or
 * "#/$defs/NAME" registered before this point. */
static ts_node *parse_ref(ts_ctx *c, const json_t *s) {
  ts_node *n = node_new(c, TS_REF, s);
  if (!n) return NULL;
  const json_t *ref = json_object_get(s, "$ref");
  if (is_str(ref, "#")) {
    c->has_self_ref = true;
    n->name = "parameters";
    return n;
  }
  if (!json_is_string(ref) || strncmp(json_string_value(ref), "#/$defs/", 8) != 0 ||
      strlen(json_string_value(ref)) != json_string_length(ref)) /* NUL: no such name */
    return ts_raise(c, "unsupported \"$ref\" (only \"#\" and \"#/$defs/NAME\")"), n;
  const char *name = strrchr(json_string_value(ref), '/') + 1;
  const json_t *target = json_object_get(c->defs, name);
  if (!target) return ts_raise(c, "\"$ref\" names a definition not registered before it"), n;
  if (!json_is_object(target))
    return ts_raise(c, "\"$ref\" names a definition that is not an object"), n;
  n->name = truthy(json_object_get(target, "$self_ref")) ? "parameters" : name;
  return n;
}

static ts_node *parse_scalar(ts_ctx *c, const json_t *s, const json_t *typ) {
  ts_node *n = node_new(c, TS_SCALAR, s);
  if (!n) return NULL;
  n->value = typ;
  if (is_str(typ, "string")) n->constraints = STRING_KEYS;
  else if (is_str(typ, "number") || is_str(typ, "integer")) n->constraints = NUMBER_KEYS;
  return n;
}

/* _parse_parameter_type(): the first of $ref, anyOf, enum, type decides. */
static ts_node *parse_type(ts_ctx *c, const json_t *s) {
  if (c->st) return NULL;
  if (json_is_boolean(s)) return implicit_scalar(c, json_is_true(s) ? "any" : "null");
  if (!json_is_object(s)) return ts_raise(c, "a schema that is not an object"), NULL;
  if (json_object_get(s, "$ref")) return parse_ref(c, s);
  if (json_object_get(s, "anyOf")) return parse_anyof(c, s);
  if (json_object_get(s, "enum")) return parse_enum(c, s);
  const json_t *typ = json_object_get(s, "type");
  if (typ) {
    if (json_is_array(typ)) return parse_union(c, s);
    if (is_str(typ, "object")) return parse_object(c, s);
    if (is_str(typ, "array")) return parse_array(c, s);
    return parse_scalar(c, s, typ);
  }
  if (json_object_size(s) == 0) return implicit_scalar(c, "any");
  ts_raise(c, "a schema without $ref, anyOf, enum or type");
  return NULL;
}

/* ---- printing ----------------------------------------------------------------- */

static void emit(ts_ctx *c, const ts_node *n, int depth);

static const json_t *description_of(const ts_node *n) {
  return n->schema ? json_object_get(n->schema, "description") : NULL;
}

static bool has_constraints(const ts_node *n) {
  for (const char *const *k = n->constraints; k && *k; k++)
    if (json_object_get(n->schema, *k)) return true;
  return false;
}

static bool docstring_nonempty(const ts_node *n) {
  return truthy(description_of(n)) || has_constraints(n);
}

/* format_docstring(): description lines, then "// key: value, ..." sorted. */
static void emit_docstring(ts_ctx *c, const ts_node *n, int depth) {
  const json_t *desc = description_of(n);
  if (truthy(desc)) {
    put_description(c, desc, depth);
    put(c, "\n");
  }
  if (!has_constraints(n)) return;
  indent(c, depth);
  put(c, "// ");
  bool first = true;
  for (const char *const *k = n->constraints; *k; k++) {
    const json_t *v = json_object_get(n->schema, *k);
    if (!v) continue;
    if (!first) put(c, ", ");
    first = false;
    put(c, *k);
    put(c, ": ");
    put_pystr(c, v, *k);
  }
  put(c, "\n");
}

static void emit_param(ts_ctx *c, const ts_param *p, int depth) {
  emit_docstring(c, p->type, depth);
  if (p->dflt && !json_is_null(p->dflt)) {
    indent(c, depth);
    put(c, "// Default: ");
    /* repr() of int, float and bool; json.dumps(ensure_ascii=False) of the rest. */
    if (json_is_number(p->dflt) || json_is_boolean(p->dflt))
      df_pystr(c->out, p->dflt, DFLASH_CHAT_SPAN_TOOLS, -1);
    else df_pyjson_dump(c->out, p->dflt, ", ", ": ", DFLASH_CHAT_SPAN_TOOLS, -1);
    put(c, "\n");
  }
  indent(c, depth);
  put(c, p->name);
  put(c, p->optional ? "?: " : ": ");
  emit(c, p->type, depth);
}

static int param_cmp(const void *a, const void *b) {
  const ts_param *x = *(const ts_param *const *)a, *y = *(const ts_param *const *)b;
  if (x->optional != y->optional) return x->optional ? 1 : -1;
  return strcmp(x->name, y->name); /* UTF-8 byte order is code point order */
}

/* Required fields by name, then optional ones by name, then [k: string]. */
static void emit_object(ts_ctx *c, const ts_node *n, int depth) {
  if (!n->n_props && n->ap == AP_NONE) return put(c, "{}");
  if (n->ap == AP_BAD) return ts_raise(c, "\"additionalProperties\" is not a bool or an object");
  const ts_param **order = malloc((n->n_props ? n->n_props : 1) * sizeof *order);
  if (!order) return nomem(c);
  for (size_t i = 0; i < n->n_props; i++) order[i] = &n->props[i];
  qsort(order, n->n_props, sizeof *order, param_cmp);
  put(c, "{\n");
  for (size_t i = 0; i < n->n_props && !c->st; i++) {
    if (i) put(c, ",\n");
    emit_param(c, order[i], depth + 1);
  }
  free(order);
  if (n->ap != AP_NONE) {
    if (n->n_props) put(c, ",\n");
    indent(c, depth + 1);
    put(c, "[k: string]: ");
    if (n->ap == AP_NODE) emit(c, n->ap_node, depth + 1);
    else put(c, n->ap == AP_ANY ? "any" : "never");
  }
  put(c, "\n");
  indent(c, depth);
  put(c, "}");
}

/* to_typescript_style() returns a str, except for a scalar whose "type" is
 * not one (5, null): f-strings print that, but `+` and " | ".join raise. */
static bool prints_str(const ts_node *n) {
  return !n || n->kind != TS_SCALAR || n->name || json_is_string(n->value);
}

static void emit_array(ts_ctx *c, const ts_node *n, int depth) {
  const ts_node *item = n->items[0];
  if (docstring_nonempty(item) && !prints_str(item))
    return ts_raise(c, "array items whose \"type\" is not a string");
  if (!docstring_nonempty(item)) {
    put(c, "Array<");
    emit(c, item, depth);
    return put(c, ">");
  }
  put(c, "Array<\n");
  emit_docstring(c, item, depth + 1);
  indent(c, depth + 1);
  emit(c, item, depth + 1);
  put(c, "\n");
  indent(c, depth);
  put(c, ">");
}

typedef struct {
  bool first;
} enum_state;

static void enum_member(ts_ctx *c, const json_t *v, void *arg) {
  enum_state *st = arg;
  if (!st->first) put(c, " | ");
  st->first = false;
  if (!json_is_string(v)) return put_pystr(c, v, "an enum value");
  put(c, "\"");
  put_n(c, json_string_value(v), json_string_length(v));
  put(c, "\"");
}

static void emit(ts_ctx *c, const ts_node *n, int depth) {
  if (c->st || !n) return;
  switch (n->kind) {
  case TS_SCALAR:
    if (n->name) return put(c, n->name);
    if (is_str(n->value, "integer")) return put(c, "number");
    return put_pystr(c, n->value, "a \"type\"");
  case TS_OBJECT: return emit_object(c, n, depth);
  case TS_ARRAY: return emit_array(c, n, depth);
  case TS_ENUM: {
    enum_state st = {true};
    if (!py_iterate(c, n->value, enum_member, &st)) ts_raise(c, "\"enum\" is not a list");
    return;
  }
  case TS_ANYOF:
    for (size_t i = 0; i < n->n_items; i++)
      if (!prints_str(n->items[i]))
        return ts_raise(c, "an anyOf member whose \"type\" is not a string");
    for (size_t i = 0; i < n->n_items; i++) {
      if (i) put(c, " | ");
      emit(c, n->items[i], depth);
    }
    return;
  case TS_UNION:
    for (size_t i = 0; i < json_array_size(n->value); i++) {
      if (i) put(c, " | ");
      put(c, union_name(json_array_get(n->value, i)));
    }
    return;
  case TS_REF: return put(c, n->name);
  }
}

/* ---- functions and tools -------------------------------------------------------- */

/* "interface parameters {...}" when something refers to "#": the root
 * properties in their given order, without additionalProperties. */
static void emit_root_interface(ts_ctx *c, const ts_node *root) {
  put(c, "interface parameters {");
  if (root->n_props) put(c, "\n");
  for (size_t i = 0; i < root->n_props && !c->st; i++) {
    if (i) put(c, ",\n");
    emit_param(c, &root->props[i], 1);
  }
  if (root->n_props) put(c, "\n");
  put(c, "}");
}

/* One interface per $defs entry registered while parsing the parameters
 * (entries registered while parsing these are not printed). */
static bool emit_def_interfaces(ts_ctx *c, bool any_before) {
  json_t *snapshot = json_copy(c->defs);
  if (!snapshot) return nomem(c), any_before;
  const char *key;
  json_t *schema;
  json_object_foreach(snapshot, key, schema) {
    size_t at = path_push(c, "$defs");
    path_push(c, key);
    ts_node *n = parse_type(c, schema);
    if (any_before) put(c, "\n");
    any_before = true;
    if (!json_is_object(schema) && !c->st) ts_raise(c, "a definition that is not an object");
    const json_t *desc = json_object_get(schema, "description");
    if (truthy(desc)) {
      put_description(c, desc, 0);
      put(c, "\n");
    }
    put(c, "interface ");
    put(c, key);
    put(c, " ");
    emit(c, n, 0);
    path_pop(c, at);
    if (c->st) break;
  }
  json_decref(snapshot);
  return any_before;
}

/* _openai_function_to_typescript_style(). */
static void emit_function(ts_ctx *c, const json_t *fn) {
  json_object_clear(c->defs);
  c->has_self_ref = false;
  const json_t *params = json_object_get(fn, "parameters");
  json_t *empty = NULL;
  if (!truthy(params)) params = empty = json_object();
  if (!params) return nomem(c);
  size_t at = path_push(c, "parameters");
  ts_node *root = json_is_object(params) ? parse_object(c, params) : NULL;
  if (!root && !c->st) ts_raise(c, "\"parameters\" is not an object");
  bool self_ref = c->has_self_ref, any = false;
  if (!c->st && self_ref) {
    emit_root_interface(c, root);
    any = true;
  }
  if (!c->st) any = emit_def_interfaces(c, any);
  path_pop(c, at);
  const json_t *desc = json_object_get(fn, "description");
  if (!c->st && truthy(desc)) {
    if (any) put(c, "\n");
    put_description(c, desc, 0);
    any = true;
  }
  if (any) put(c, "\n");
  put(c, "type ");
  const json_t *name = json_object_get(fn, "name");
  if (name) put_pystr(c, name, "the function name");
  else put(c, "function");
  put(c, " = (_: ");
  path_push(c, "parameters");
  if (self_ref) put(c, "parameters");
  else emit(c, root, 0);
  path_pop(c, at);
  put(c, ") => any;");
  json_decref(empty);
}

static void emit_tool(ts_ctx *c, const json_t *tool, bool *any) {
  if (!json_is_object(tool)) return ts_raise(c, "a tool that is not an object");
  if (!is_str(json_object_get(tool, "type"), "function")) return; /* skipped, as "_plugin" */
  const json_t *fn = json_object_get(tool, "function");
  if (!truthy(fn)) return;
  if (!json_is_object(fn)) return ts_raise(c, "\"function\" is not an object");
  const json_t *name = json_object_get(fn, "name");
  c->fn_name = json_is_string(name) ? json_string_value(name) : NULL;
  put(c, *any ? "\n" : "# Tools\n\n## functions\nnamespace functions {\n");
  *any = true;
  emit_function(c, fn);
}

dflash_status df_tools_typescript(const json_t *tools, df_out *out) {
  ts_ctx c = {.out = out, .defs = json_object()};
  if (!c.defs) return df_error_nomem("tool declarations");
  bool any = false;
  for (size_t i = 0; i < json_array_size(tools) && !c.st && !out->st; i++) {
    c.tool = i;
    c.fn_name = NULL;
    c.path[0] = 0;
    emit_tool(&c, json_array_get(tools, i), &any);
  }
  if (any) put(&c, "\n}\n");
  nodes_free(&c);
  json_decref(c.defs);
  if (c.st) return c.st;
  if (out->st) return out->st;
  if (c.unsupported) return df_error(c.unsupported, "%s", c.unsupported_msg);
  return DFLASH_OK;
}

static int key_cmp(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

json_t *df_json_deep_sorted(const json_t *v) {
  if (json_is_array(v)) {
    json_t *a = json_array();
    for (size_t i = 0; a && i < json_array_size(v); i++)
      if (json_array_append_new(a, df_json_deep_sorted(json_array_get(v, i))))
        json_decref(a), a = NULL;
    return a;
  }
  if (!json_is_object(v)) return json_incref((json_t *)v);
  size_t n = json_object_size(v), k = 0;
  const char **keys = malloc((n ? n : 1) * sizeof *keys);
  json_t *o = keys ? json_object() : NULL;
  const char *key;
  json_t *val;
  if (o) {
    json_object_foreach((json_t *)v, key, val) keys[k++] = key;
    qsort(keys, n, sizeof *keys, key_cmp);
    for (k = 0; k < n; k++)
      if (json_object_set_new(o, keys[k], df_json_deep_sorted(json_object_get(v, keys[k]))))
        json_decref(o), o = NULL, k = n;
  }
  free(keys);
  return o;
}

dflash_status dflash_chat_tools_typescript(const char *tools_json, size_t len, int32_t sort_keys,
                                           char *buf, size_t cap, size_t *out_len) {
  DF_CHECK_ARG(tools_json && out_len && (buf || !cap));
  *out_len = 0;
  json_t *tools = NULL, *sorted = NULL;
  dflash_status st = df_json_parse(tools_json, len, "tools", &tools);
  if (st) return st;
  if (!json_is_array(tools)) {
    json_decref(tools);
    return df_error(DFLASH_E_FORMAT, "tools: not a JSON list of tool declarations");
  }
  if (sort_keys && !(sorted = df_json_deep_sorted(tools))) st = df_error_nomem("tools");
  df_out ts = {0};
  if (!st) st = df_tools_typescript(sorted ? sorted : tools, &ts);
  if (!st) {
    *out_len = ts.text.len;
    if (ts.text.len > cap)
      st = df_error(DFLASH_E_BUFFER, "tools: the declaration takes %zu bytes, the buffer %zu",
                    ts.text.len, cap);
    else if (ts.text.len) memcpy(buf, ts.text.data, ts.text.len);
  }
  df_buf_free(&ts.text);
  free(ts.spans);
  json_decref(sorted);
  json_decref(tools);
  return st;
}
