/* Status names, the per-thread error message and the log callback. */
#include "internal.h"

#include <stdio.h>
#include <string.h>

#define DF_ERR_CAP 2048

static _Thread_local char tls_error[DF_ERR_CAP];

static dflash_log_fn g_log_fn;
static void *g_log_user;
static dflash_log_level g_log_max = DFLASH_LOG_INFO;

DFLASH_API int dflash_version_number(void) { return DFLASH_VERSION_NUMBER; }
DFLASH_API const char *dflash_version_string(void) { return DFLASH_VERSION_STRING; }

DFLASH_API const char *dflash_status_str(dflash_status status) {
  static const char *const names[] = {
      [DFLASH_OK] = "DFLASH_OK",
      [DFLASH_E_INVALID_ARG] = "DFLASH_E_INVALID_ARG",
      [DFLASH_E_NOMEM] = "DFLASH_E_NOMEM",
      [DFLASH_E_IO] = "DFLASH_E_IO",
      [DFLASH_E_FORMAT] = "DFLASH_E_FORMAT",
      [DFLASH_E_TRUNCATED] = "DFLASH_E_TRUNCATED",
      [DFLASH_E_RANGE] = "DFLASH_E_RANGE",
      [DFLASH_E_OVERFLOW] = "DFLASH_E_OVERFLOW",
      [DFLASH_E_DTYPE] = "DFLASH_E_DTYPE",
      [DFLASH_E_UTF8] = "DFLASH_E_UTF8",
      [DFLASH_E_DUPLICATE] = "DFLASH_E_DUPLICATE",
      [DFLASH_E_NOT_FOUND] = "DFLASH_E_NOT_FOUND",
      [DFLASH_E_JSON] = "DFLASH_E_JSON",
      [DFLASH_E_BUFFER] = "DFLASH_E_BUFFER",
      [DFLASH_E_UNSUPPORTED] = "DFLASH_E_UNSUPPORTED",
      [DFLASH_E_STATE] = "DFLASH_E_STATE",
      [DFLASH_E_CONFIG] = "DFLASH_E_CONFIG",
      [DFLASH_E_MISMATCH] = "DFLASH_E_MISMATCH",
      [DFLASH_E_REGEX] = "DFLASH_E_REGEX",
      [DFLASH_E_TEMPLATE] = "DFLASH_E_TEMPLATE",
      [DFLASH_E_HTTP] = "DFLASH_E_HTTP",
      [DFLASH_E_NETWORK] = "DFLASH_E_NETWORK",
      [DFLASH_E_TIMEOUT] = "DFLASH_E_TIMEOUT",
      [DFLASH_E_CANCELLED] = "DFLASH_E_CANCELLED",
      [DFLASH_E_CUDA] = "DFLASH_E_CUDA",
      [DFLASH_E_NO_DEVICE] = "DFLASH_E_NO_DEVICE",
      [DFLASH_E_INTERNAL] = "DFLASH_E_INTERNAL",
      [DFLASH_E_AUTH] = "DFLASH_E_AUTH",
      [DFLASH_E_EXISTS] = "DFLASH_E_EXISTS",
  };
  if ((unsigned)status < DF_ARRAY_LEN(names) && names[status]) return names[status];
  return "DFLASH_E_UNKNOWN";
}

DFLASH_API const char *dflash_last_error(void) { return tls_error; }
DFLASH_API void dflash_clear_error(void) { tls_error[0] = '\0'; }

static void set_error_v(const char *fmt, va_list ap) {
  vsnprintf(tls_error, sizeof tls_error, fmt, ap);
}

dflash_status df_error(dflash_status status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_error_v(fmt, ap);
  va_end(ap);
  df_log(DFLASH_LOG_DEBUG, "%s: %s", dflash_status_str(status), tls_error);
  return status;
}

dflash_status df_error_errno(dflash_status status, int errnum, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_error_v(fmt, ap);
  va_end(ap);
  size_t n = strlen(tls_error);
  char buf[256];
  /* strerror_r (GNU flavour returns a pointer that may or may not be buf). */
  const char *msg = strerror_r(errnum, buf, sizeof buf);
  snprintf(tls_error + n, sizeof tls_error - n, ": %s", msg);
  return status;
}

dflash_status df_error_wrap(dflash_status status, const char *fmt, ...) {
  char prefix[DF_ERR_CAP];
  char old[DF_ERR_CAP];
  memcpy(old, tls_error, sizeof old);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  /* Truncation of over-long messages is intended: keep the prefix whole. */
  size_t n = strlen(prefix);
  if (n > sizeof tls_error - 3) n = sizeof tls_error - 3;
  memcpy(tls_error, prefix, n);
  memcpy(tls_error + n, ": ", 2);
  size_t rest = sizeof tls_error - n - 3, old_len = strlen(old);
  if (old_len > rest) old_len = rest;
  memcpy(tls_error + n + 2, old, old_len);
  tls_error[n + 2 + old_len] = '\0';
  return status;
}

dflash_status df_error_nomem(const char *what) {
  return df_error(DFLASH_E_NOMEM, "out of memory while allocating %s", what);
}

DFLASH_API void dflash_set_log_callback(dflash_log_fn fn, void *user, dflash_log_level max_level) {
  g_log_fn = fn;
  g_log_user = user;
  g_log_max = max_level;
}

void df_log(dflash_log_level level, const char *fmt, ...) {
  dflash_log_fn fn = g_log_fn;
  if (!fn || level > g_log_max) return;
  char msg[DF_ERR_CAP];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fn(level, msg, g_log_user);
}
