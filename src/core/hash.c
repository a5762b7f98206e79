/* SHA-256 through OpenSSL's libcrypto (already linked by libcurl on Debian):
 * content-hash ids, S3 payload hashes, tokenizer fingerprints. */
#include "internal.h"

#include <openssl/evp.h>

void df_sha256(const void *data, size_t len, uint8_t out[32]) {
  unsigned int n = 32;
  EVP_Digest(data, len, out, &n, EVP_sha256(), NULL);
}

void df_sha256_hex(const void *data, size_t len, char out[65]) {
  static const char digits[] = "0123456789abcdef";
  uint8_t h[32];
  df_sha256(data, len, h);
  for (int i = 0; i < 32; i++) {
    out[2 * i] = digits[h[i] >> 4];
    out[2 * i + 1] = digits[h[i] & 15];
  }
  out[64] = '\0';
}
