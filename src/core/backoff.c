/* Retry pacing shared by every HTTP client in the library (fetcher, S3). */
#include "internal.h"

#include <curl/curl.h>
#include <stdlib.h>
#include <time.h>

double df_rand01(uint64_t *state) {
  uint64_t x = *state ? *state : 0x9e3779b97f4a7c15ull; /* xorshift64*, never zero */
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *state = x;
  return (double)((x * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}

double df_backoff_s(uint64_t *rng, unsigned attempt, double base_s, double max_s,
                    double retry_after_s, double retry_after_max_s) {
  double cap = base_s;
  for (unsigned i = 1; i < attempt && cap < max_s; i++) cap *= 2;
  if (cap > max_s) cap = max_s;
  double wait = df_rand01(rng) * cap; /* full jitter: uniform in [0, cap) */
  if (retry_after_s > 0) {
    double ra = retry_after_s < retry_after_max_s ? retry_after_s : retry_after_max_s;
    if (ra > wait) wait = ra;
  }
  return wait;
}

double df_parse_retry_after(const char *value, bool milliseconds) {
  while (*value == ' ' || *value == '\t') value++;
  char *end;
  double d = strtod(value, &end);
  if (end != value) return d >= 0 ? (milliseconds ? d / 1000.0 : d) : -1;
  if (milliseconds) return -1;
  time_t t = curl_getdate(value, NULL); /* Retry-After may be an HTTP date */
  return t > 0 ? difftime(t, time(NULL)) : -1;
}
