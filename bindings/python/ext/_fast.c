/*
 * libdflash._fast: Tokenizer.encode as one CPython call (libdflash/tokenizer.py uses it when it
 * imports, its ctypes path otherwise). Through ctypes a short text costs about 2 us, most of it
 * ctypes' own argument conversion; here the call is the argument check, the library's encode
 * into a stack buffer and one numpy array.
 *
 * The library's functions come as addresses from the ctypes library the package already loaded
 * (init()), so the module links to no libdflash of its own: it can never call into a second copy
 * that a tokenizer handle does not belong to, and it needs no rpath. Only the public API
 * (dflash/tokenizer.h) is called.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <dflash/tokenizer.h>

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

typedef __typeof__(dflash_tokenizer_encode) encode_fn;
typedef __typeof__(dflash_tokenizer_encode_batch) encode_batch_fn;
typedef __typeof__(dflash_last_error) last_error_fn;

/* Set once by init(); the module is unusable (encode raises) until then. */
static encode_fn *lib_encode;
static encode_batch_fn *lib_encode_batch;
static last_error_fn *lib_last_error;
static PyObject *make_error; /* (status, message) -> the libdflash.Error subclass instance */
static PyObject *to_utf8;    /* tokenizer._utf8: what str and bytes-likes become, as today */
static PyObject *str_all, *str_none;

/* Texts up to GIL_BYTES bytes are encoded holding the GIL (a few microseconds at most: releasing
 * and taking it back costs more), first into a stack buffer of STACK_IDS ids (one per byte,
 * see ids_bound); longer ones release it and get an array of their own. */
enum { GIL_BYTES = 2048, STACK_IDS = GIL_BYTES + 16 };

/* The libdflash.Error for a failed status, raised (returns NULL). */
static PyObject *raise_status(dflash_status st) {
  const char *msg = lib_last_error();
  PyObject *text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");
  if (!text) return NULL;
  PyObject *exc = PyObject_CallFunction(make_error, "iO", (int)st, text);
  Py_DECREF(text);
  if (!exc) return NULL;
  PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
  Py_DECREF(exc);
  return NULL;
}

/* 0 for "all", 1 for "none", -1 with ValueError otherwise (the message tokenizer._mode gives). */
static int special_mode(PyObject *special) {
  if (special == str_all) return DFLASH_SPECIAL_ALL;
  if (special == str_none) return DFLASH_SPECIAL_NONE;
  if (PyUnicode_Check(special)) {
    if (PyUnicode_Compare(special, str_all) == 0) return DFLASH_SPECIAL_ALL;
    if (PyUnicode_Compare(special, str_none) == 0) return DFLASH_SPECIAL_NONE;
  }
  PyErr_Format(PyExc_ValueError, "special must be 'all' or 'none', not %R", special);
  return -1;
}

/* The UTF-8 bytes of a text, alive as long as `keep` (a new reference, or NULL). */
typedef struct utf8_text {
  const char *data;
  size_t len;
  PyObject *keep;
} utf8_text;

/* The characters of kind `kind` from d[i..n) written to *o as ASCII while they are: 16 at a
 * time for one- and two-byte kinds (SSE2: the bench's English and mix, 8 at a time, were 5.5 %
 * of a warm Python encode loop's samples in perf; 16 made that loop 3-7 % faster), else 8 (one
 * test a block: CPython's own encoder, which str.encode and the PyO3 tokenizers use, takes one
 * character at a time). Returns where the first block with another character, or the tail of
 * fewer than 8, starts: the caller encodes it a character at a time. */
static Py_ssize_t ascii_blocks(int kind, const void *d, Py_ssize_t i, Py_ssize_t n,
                               unsigned char **o) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  const unsigned char *b = d;
  unsigned char *out = *o;
#ifdef __SSE2__
  /* 16 characters a test where the kind has them in one or two vectors */
  if (kind == PyUnicode_1BYTE_KIND)
    for (; i + 16 <= n; i += 16, out += 16) {
      __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(b + i));
      if (_mm_movemask_epi8(v)) break;
      _mm_storeu_si128((__m128i *)(void *)out, v);
    }
  else if (kind == PyUnicode_2BYTE_KIND)
    for (; i + 16 <= n; i += 16, out += 16) {
      __m128i lo = _mm_loadu_si128((const __m128i *)(const void *)(b + 2 * i));
      __m128i hi = _mm_loadu_si128((const __m128i *)(const void *)(b + 2 * i + 16));
      __m128i big = _mm_and_si128(_mm_or_si128(lo, hi), _mm_set1_epi16((short)0xFF80));
      if (_mm_movemask_epi8(_mm_cmpeq_epi16(big, _mm_setzero_si128())) != 0xFFFF) break;
      _mm_storeu_si128((__m128i *)(void *)out, _mm_packus_epi16(lo, hi)); /* all below 0x80 */
    }
#endif
  for (; i + 8 <= n; i += 8, out += 8) {
    uint64_t w[4], word = 0;
    memcpy(w, b + i * kind, 8 * (size_t)kind);
    if (kind == PyUnicode_1BYTE_KIND) {
      if (w[0] & 0x8080808080808080ull) break;
      word = w[0];
    } else if (kind == PyUnicode_2BYTE_KIND) { /* 4 characters a word, their low bytes kept */
      if ((w[0] | w[1]) & 0xFF80FF80FF80FF80ull) break;
      for (int k = 0; k < 2; k++) {
        uint64_t x = (w[k] | w[k] >> 8) & 0x0000FFFF0000FFFFull;
        word |= ((x | x >> 16) & 0xFFFFFFFFull) << 32 * k;
      }
    } else { /* 2 characters a word */
      if ((w[0] | w[1] | w[2] | w[3]) & 0xFFFFFF80FFFFFF80ull) break;
      for (int k = 0; k < 4; k++) word |= ((w[k] | w[k] >> 24) & 0xFFFFull) << 16 * k;
    }
    memcpy(out, &word, 8);
  }
  *o = out;
#else
  (void)kind, (void)d, (void)n, (void)o;
#endif
  return i;
}

/* Writes the UTF-8 of str `s` to `dst` (room for utf8_bound(s) bytes) and returns its length,
 * or -1 at a surrogate code point (which str.encode refuses: tokenizer._utf8 handles those).
 * ASCII 16 or 8 characters at a time (ascii_blocks), the rest one at a time. 40 % of the bench's
 * English documents hold a dash or a quote beyond ASCII; encoding them (o200k, warm, three runs)
 * took 6-11 % longer from a str than from its bytes through CPython's encoder, 3-6 % now. */
static Py_ssize_t utf8_put(PyObject *s, char *dst) {
  int kind = PyUnicode_KIND(s);
  const void *d = PyUnicode_DATA(s);
  Py_ssize_t n = PyUnicode_GET_LENGTH(s);
  unsigned char *o = (unsigned char *)dst;
  for (Py_ssize_t i = 0; i < n;) {
    i = ascii_blocks(kind, d, i, n, &o);
    for (Py_ssize_t end = i + 8 < n ? i + 8 : n; i < end; i++) { /* a block, or the tail */
      Py_UCS4 c = PyUnicode_READ(kind, d, i);
      if (c < 0x80) {
        *o++ = (unsigned char)c;
      } else if (c < 0x800) {
        *o++ = (unsigned char)(0xC0 | c >> 6);
        *o++ = (unsigned char)(0x80 | (c & 0x3F));
      } else if (c < 0x10000) {
        if (c >= 0xD800 && c <= 0xDFFF) return -1;
        *o++ = (unsigned char)(0xE0 | c >> 12);
        *o++ = (unsigned char)(0x80 | (c >> 6 & 0x3F));
        *o++ = (unsigned char)(0x80 | (c & 0x3F));
      } else {
        *o++ = (unsigned char)(0xF0 | c >> 18);
        *o++ = (unsigned char)(0x80 | (c >> 12 & 0x3F));
        *o++ = (unsigned char)(0x80 | (c >> 6 & 0x3F));
        *o++ = (unsigned char)(0x80 | (c & 0x3F));
      }
    }
  }
  return (Py_ssize_t)(o - (unsigned char *)dst);
}

/* Most UTF-8 bytes str `s` can take: by its widest character's kind. */
static size_t utf8_bound(PyObject *s) {
  int kind = PyUnicode_KIND(s);
  return (size_t)PyUnicode_GET_LENGTH(s) * (kind == PyUnicode_1BYTE_KIND   ? 2
                                            : kind == PyUnicode_2BYTE_KIND ? 3
                                                                           : 4);
}

/*
 * The UTF-8 bytes of `text` (str or bytes), as tokenizer._utf8 gives them, into *out. An ASCII
 * str and bytes give their own buffer; another str is written (utf8_put) to `scratch` (`cap`
 * bytes) when it fits, and to a temporary bytes object otherwise: never str's cached UTF-8,
 * which would stay with the caller's string. Anything else (lone surrogates, bytearray,
 * memoryview, a wrong type) goes through tokenizer._utf8, which replaces or copies, or raises,
 * exactly as the ctypes path does.
 */
static int text_utf8(PyObject *text, char *scratch, size_t cap, utf8_text *out) {
  out->keep = NULL;
  if (PyUnicode_CheckExact(text)) {
#if PY_VERSION_HEX < 0x030C0000 /* a legacy string of the old C API, before 3.12 */
    if (PyUnicode_READY(text) < 0) return -1;
#endif
    if (PyUnicode_IS_COMPACT_ASCII(text)) {
      out->data = PyUnicode_DATA(text);
      out->len = (size_t)PyUnicode_GET_LENGTH(text);
      return 0;
    }
    size_t bound = utf8_bound(text);
    PyObject *b = NULL; /* the buffer of a text scratch cannot hold: bytes, filled in place */
    if ((!scratch || bound > cap) && !(b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)bound)))
      return -1;
    char *dst = b ? PyBytes_AS_STRING(b) : scratch;
    Py_ssize_t n = utf8_put(text, dst);
    if (n >= 0) {
      out->keep = b;
      out->data = dst;
      out->len = (size_t)n;
      return 0;
    }
    Py_XDECREF(b);
  } else if (PyBytes_CheckExact(text)) {
    out->data = PyBytes_AS_STRING(text);
    out->len = (size_t)PyBytes_GET_SIZE(text);
    return 0;
  }
  PyObject *b = PyObject_CallOneArg(to_utf8, text);
  if (!b) return -1;
  if (!PyBytes_Check(b)) {
    Py_DECREF(b);
    PyErr_SetString(PyExc_TypeError, "tokenizer._utf8 did not return bytes");
    return -1;
  }
  out->keep = b;
  out->data = PyBytes_AS_STRING(b);
  out->len = (size_t)PyBytes_GET_SIZE(b);
  return 0;
}

/* A new int32 array holding ids[0..n). */
static PyObject *array_of(const int32_t *ids, size_t n) {
  npy_intp dim = (npy_intp)n;
  PyObject *arr = PyArray_SimpleNew(1, &dim, NPY_INT32);
  if (arr && n) memcpy(PyArray_DATA((PyArrayObject *)arr), ids, n * sizeof *ids);
  return arr;
}

/* Room for the ids of len bytes of text: byte-level BPE gives at most one id per byte (only
 * repaired or NFC-expanded text can need more, and is encoded again at its size). Half a byte
 * each, as before, made every text with more ids than that (CJK runs, emoji, digits: 0.68 ids
 * per byte on the bench's CJK text) encode twice. */
static size_t ids_bound(size_t len) { return len + 16; }

/* Encode into an array of its own, of `cap` ids (0: sized as the ctypes path sizes it),
 * regrown on DFLASH_E_BUFFER, then shrunk to the ids written; without the GIL when the text
 * is long. */
static PyObject *encode_to_array(const dflash_tokenizer *tok, const char *data, size_t len,
                                 int mode, size_t cap) {
  if (!cap) cap = ids_bound(len);
  for (;;) {
    npy_intp dim = (npy_intp)cap;
    PyArrayObject *arr = (PyArrayObject *)PyArray_SimpleNew(1, &dim, NPY_INT32);
    if (!arr) return NULL;
    size_t n = 0;
    dflash_status st;
    int32_t *ids = PyArray_DATA(arr);
    if (len > GIL_BYTES) { /* other Python threads run meanwhile */
      PyThreadState *ts = PyEval_SaveThread();
      st = lib_encode(tok, data, len, (dflash_special_mode)mode, ids, cap, &n);
      PyEval_RestoreThread(ts);
    } else {
      st = lib_encode(tok, data, len, (dflash_special_mode)mode, ids, cap, &n);
    }
    if (st == DFLASH_OK) {
      if (n < cap) {
        npy_intp new_dim = (npy_intp)n;
        PyArray_Dims shape = {&new_dim, 1};
        PyObject *r = PyArray_Resize(arr, &shape, 0, NPY_CORDER);
        if (!r) {
          Py_DECREF(arr);
          return NULL;
        }
        Py_DECREF(r);
      }
      return (PyObject *)arr;
    }
    Py_DECREF(arr);
    if (st != DFLASH_E_BUFFER || n <= cap) return raise_status(st);
    cap = n;
  }
}

/* Whether an entry point may run: `want` arguments, and init() has given it its function
 * (`ready`); else false with TypeError / RuntimeError set. */
static bool callable(Py_ssize_t nargs, Py_ssize_t want, const char *usage, bool ready) {
  if (nargs != want) {
    PyErr_SetString(PyExc_TypeError, usage);
    return false;
  }
  if (!ready) PyErr_SetString(PyExc_RuntimeError, "libdflash._fast: init() was not called");
  return ready;
}

/* encode(handle, text, special) -> int32 ndarray: Tokenizer.encode of an open tokenizer.
 * `text` is held by the caller for the whole call, so its buffer may be borrowed. */
static PyObject *fast_encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (!callable(nargs, 3, "encode(handle, text, special)", lib_encode != NULL)) return NULL;
  char scratch[GIL_BYTES];
  utf8_text t;
  if (text_utf8(args[1], scratch, sizeof scratch, &t) < 0) return NULL;
  PyObject *out = NULL;
  int mode = special_mode(args[2]);
  const dflash_tokenizer *tok = PyLong_AsVoidPtr(args[0]);
  if (mode < 0 || (!tok && PyErr_Occurred())) goto done;
  size_t n = 0; /* after DFLASH_E_BUFFER: the ids the text needs */
  if (t.len <= GIL_BYTES) {
    int32_t ids[STACK_IDS];
    dflash_status st = lib_encode(tok, t.data, t.len, (dflash_special_mode)mode, ids, STACK_IDS,
                                  &n);
    if (st == DFLASH_OK) {
      out = array_of(ids, n);
      goto done;
    }
    if (st != DFLASH_E_BUFFER) {
      raise_status(st);
      goto done;
    }
  }
  out = encode_to_array(tok, t.data, t.len, mode, n);
done:
  Py_XDECREF(t.keep);
  return out;
}

/* What one encode_batch call holds: the texts' UTF-8 and what keeps it alive. */
typedef struct batch_texts {
  size_t n;
  const char **data;
  size_t *lens;
  PyObject **keep; /* a reference to each text (the list may change while the GIL is out) */
  size_t *offsets; /* n + 1 */
} batch_texts;

static void batch_free(batch_texts *b) {
  for (size_t i = 0; b->keep && i < b->n; i++) Py_XDECREF(b->keep[i]);
  PyMem_Free(b->data);
  PyMem_Free(b->lens);
  PyMem_Free(b->keep);
  PyMem_Free(b->offsets);
}

/* The UTF-8 of every text of `seq` (a list or tuple from PySequence_Fast), into *b. */
static int batch_collect(PyObject *seq, batch_texts *b, size_t *total) {
  size_t n = b->n = (size_t)PySequence_Fast_GET_SIZE(seq);
  b->data = PyMem_Calloc(n + 1, sizeof *b->data);
  b->lens = PyMem_Calloc(n + 1, sizeof *b->lens);
  b->keep = PyMem_Calloc(n + 1, sizeof *b->keep);
  b->offsets = PyMem_Calloc(n + 1, sizeof *b->offsets);
  if (!b->data || !b->lens || !b->keep || !b->offsets) {
    PyErr_NoMemory();
    return -1;
  }
  *total = 0;
  for (size_t i = 0; i < n; i++) {
    PyObject *item = PySequence_Fast_GET_ITEM(seq, (Py_ssize_t)i);
    utf8_text t;
    if (text_utf8(item, NULL, 0, &t) < 0) return -1;
    if (!t.keep) {
      Py_INCREF(item);
      t.keep = item;
    }
    b->data[i] = t.data;
    b->lens[i] = t.len;
    b->keep[i] = t.keep;
    *total += t.len;
  }
  return 0;
}

/* Ids of text i as a view of `ids` (which it keeps alive), as slicing would give. */
static PyObject *batch_view(PyArrayObject *ids, const size_t *offsets, size_t i) {
  npy_intp dim = (npy_intp)(offsets[i + 1] - offsets[i]);
  int32_t *at = (int32_t *)PyArray_DATA(ids) + offsets[i];
  PyObject *v = PyArray_New(&PyArray_Type, 1, &dim, NPY_INT32, NULL, at, 0, NPY_ARRAY_CARRAY, NULL);
  if (!v) return NULL;
  Py_INCREF(ids);
  if (PyArray_SetBaseObject((PyArrayObject *)v, (PyObject *)ids) < 0) {
    Py_DECREF(v);
    return NULL;
  }
  return v;
}

/* Runs the library's batch encode without the GIL into one array (regrown on
 * DFLASH_E_BUFFER, then shrunk to the ids written). */
static PyArrayObject *batch_run(const dflash_tokenizer *tok, batch_texts *b, size_t total, int mode,
                                int32_t n_threads) {
  size_t cap = ids_bound(total) + 16 * b->n;
  for (;;) {
    npy_intp dim = (npy_intp)cap;
    PyArrayObject *ids = (PyArrayObject *)PyArray_SimpleNew(1, &dim, NPY_INT32);
    if (!ids) return NULL;
    int32_t *out = PyArray_DATA(ids);
    PyThreadState *ts = PyEval_SaveThread();
    dflash_status st = lib_encode_batch(tok, b->data, b->lens, b->n, (dflash_special_mode)mode,
                                        n_threads, out, cap, b->offsets);
    PyEval_RestoreThread(ts);
    if (st == DFLASH_OK) {
      npy_intp used = (npy_intp)b->offsets[b->n];
      PyArray_Dims shape = {&used, 1};
      PyObject *r = used < dim ? PyArray_Resize(ids, &shape, 0, NPY_CORDER) : Py_NewRef(Py_None);
      if (!r) {
        Py_DECREF(ids);
        return NULL;
      }
      Py_DECREF(r);
      return ids;
    }
    Py_DECREF(ids);
    if (st != DFLASH_E_BUFFER || b->offsets[b->n] <= cap) {
      raise_status(st);
      return NULL;
    }
    cap = b->offsets[b->n];
  }
}

/* encode_batch(handle, texts, special, n_threads) -> list of int32 arrays (views of one). */
static PyObject *fast_encode_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (!callable(nargs, 4, "encode_batch(handle, texts, special, n_threads)",
                lib_encode_batch != NULL))
    return NULL;
  PyObject *seq = PySequence_Fast(args[1], "encode_batch: texts must be iterable");
  if (!seq) return NULL;
  batch_texts b = {0};
  PyObject *list = NULL;
  PyArrayObject *ids = NULL;
  size_t total;
  if (batch_collect(seq, &b, &total) < 0) goto done;
  int mode = special_mode(args[2]);
  if (mode < 0) goto done;
  const dflash_tokenizer *tok = PyLong_AsVoidPtr(args[0]);
  long threads = PyLong_AsLong(args[3]);
  if ((!tok || threads == -1) && PyErr_Occurred()) goto done;
  if (threads < INT32_MIN || threads > INT32_MAX) {
    PyErr_SetString(PyExc_OverflowError, "n_threads does not fit in int32");
    goto done;
  }
  ids = batch_run(tok, &b, total, mode, (int32_t)threads);
  if (!ids || !(list = PyList_New((Py_ssize_t)b.n))) goto done;
  for (size_t i = 0; i < b.n; i++) {
    PyObject *v = batch_view(ids, b.offsets, i);
    if (!v) {
      Py_CLEAR(list);
      goto done;
    }
    PyList_SET_ITEM(list, (Py_ssize_t)i, v);
  }
done:
  Py_XDECREF(ids);
  batch_free(&b);
  Py_DECREF(seq);
  return list;
}

/* A function address from init(), or -1. */
static int function_at(PyObject *address, void *fn, size_t size) {
  void *p = PyLong_AsVoidPtr(address);
  if (!p) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "init: a NULL function address");
    return -1;
  }
  /* Object and function pointers share a representation on every platform CPython runs on
   * (POSIX requires it for dlsym); the conversion goes through memcpy to say so. */
  memcpy(fn, &p, size);
  return 0;
}

/* init(encode, encode_batch, last_error, make_error, utf8): the addresses of the ctypes
 * library's dflash_tokenizer_encode, dflash_tokenizer_encode_batch and dflash_last_error,
 * the package's error factory and its str/bytes conversion. */
static PyObject *fast_init(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *enc, *batch, *last, *err, *utf8;
  if (!PyArg_ParseTuple(args, "OOOOO", &enc, &batch, &last, &err, &utf8)) return NULL;
  if (!PyCallable_Check(err) || !PyCallable_Check(utf8)) {
    PyErr_SetString(PyExc_TypeError, "init: make_error and utf8 must be callable");
    return NULL;
  }
  encode_fn *e;
  encode_batch_fn *b;
  last_error_fn *l;
  if (function_at(enc, &e, sizeof e) < 0 || function_at(batch, &b, sizeof b) < 0 ||
      function_at(last, &l, sizeof l) < 0)
    return NULL;
  lib_encode = e;
  lib_encode_batch = b;
  lib_last_error = l;
  Py_INCREF(err);
  Py_XSETREF(make_error, err);
  Py_INCREF(utf8);
  Py_XSETREF(to_utf8, utf8);
  Py_RETURN_NONE;
}

static PyMethodDef fast_methods[] = {
    {"encode", (PyCFunction)(void (*)(void))fast_encode, METH_FASTCALL,
     "encode(handle, text, special) -> int32 ndarray (Tokenizer.encode)"},
    {"encode_batch", (PyCFunction)(void (*)(void))fast_encode_batch, METH_FASTCALL,
     "encode_batch(handle, texts, special, n_threads) -> list of int32 arrays"},
    {"init", fast_init, METH_VARARGS, "init(encode, encode_batch, last_error, make_error, utf8)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fast_module = {
    PyModuleDef_HEAD_INIT,
    "_fast",
    "libdflash's compiled Tokenizer.encode and encode_batch (optional)",
    -1,
    fast_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

#if NPY_ABI_VERSION < 0x02000000
/* The major version of the numpy that runs, or -1 with an exception set. */
static long numpy_major(void) {
  PyObject *np = PyImport_ImportModule("numpy");
  if (!np) return -1;
  PyObject *v = PyObject_GetAttrString(np, "__version__");
  Py_DECREF(np);
  const char *s = v && PyUnicode_Check(v) ? PyUnicode_AsUTF8(v) : NULL;
  long major = s ? strtol(s, NULL, 10) : -1;
  Py_XDECREF(v);
  if (major < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_ImportError, "numpy.__version__?");
  return major;
}
#endif

PyMODINIT_FUNC PyInit__fast(void) {
#if NPY_ABI_VERSION < 0x02000000
  /* Built with numpy 1.x headers: numpy 2 refuses the module, and prints a page saying so
   * before it does. The package takes its ctypes path instead, quietly. */
  long major = numpy_major();
  if (major < 0) return NULL;
  if (major >= 2) {
    PyErr_Format(PyExc_ImportError, "libdflash._fast was built for numpy 1.x, numpy %ld runs",
                 major);
    return NULL;
  }
#endif
  /* Not import_array(), which prints: a numpy whose ABI this build cannot use is an
   * ImportError, after which the package takes its ctypes path without a word. */
  if (_import_array() < 0) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_Format(PyExc_ImportError, "libdflash._fast: numpy: %S", value ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return NULL;
  }
  str_all = PyUnicode_InternFromString("all");
  str_none = PyUnicode_InternFromString("none");
  if (!str_all || !str_none) return NULL;
  return PyModule_Create(&fast_module);
}
