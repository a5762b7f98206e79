/* The tokenizer hash of dataset manifests: dflash_tokenizer_hash of the loaded tokenizer
 * (what decides the ids). The hash of the files' bytes that manifests recorded before is kept
 * here, SHA-256 through OpenSSL's libcrypto (EVP), so that their datasets still match the
 * files they were made with (dflash_dataset_tokenizer_matches). */
#include <dflash/dataset.h>
#include <dflash/tokenizer.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/internal.h"

/* The files a tokenizer directory is loaded from (src/tokenizer), in hash order. */
static const char *const tokenizer_files[] = {
    "tokenizer.json",    "tokenizer_config.json",   "vocab.json",     "merges.txt",
    "added_tokens.json", "special_tokens_map.json", "tiktoken.model",
};

static dflash_status digest_fd(EVP_MD_CTX *md, int fd, const char *path) {
  char buf[1 << 16];
  for (;;) {
    ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return df_error_errno(DFLASH_E_IO, errno, "%s: read", path);
    if (n == 0) return DFLASH_OK;
    if (!EVP_DigestUpdate(md, buf, (size_t)n))
      return df_error(DFLASH_E_IO, "%s: SHA-256 update failed", path);
  }
}

/* Digest one file; `framed` prefixes name, NUL and the 8-byte little-endian size. */
static dflash_status digest_file(EVP_MD_CTX *md, const char *path, const char *name, bool framed) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return df_error_errno(DFLASH_E_IO, errno, "%s: cannot open", path);
  struct stat sb;
  dflash_status st = fstat(fd, &sb) == 0 ? DFLASH_OK
                                         : df_error_errno(DFLASH_E_IO, errno, "%s: stat", path);
  if (!st && framed) {
    uint8_t size[8];
    for (int i = 0; i < 8; i++) size[i] = (uint8_t)((uint64_t)sb.st_size >> (8 * i));
    if (!EVP_DigestUpdate(md, name, strlen(name) + 1) || !EVP_DigestUpdate(md, size, 8))
      st = df_error(DFLASH_E_IO, "%s: SHA-256 update failed", path);
  }
  if (!st) st = digest_fd(md, fd, path);
  close(fd);
  return st;
}

/* Every tokenizer file present in `dir`, framed; DFLASH_E_NOT_FOUND when none is. */
static dflash_status digest_dir(EVP_MD_CTX *md, const char *dir) {
  size_t found = 0;
  for (size_t i = 0; i < DF_ARRAY_LEN(tokenizer_files); i++) {
    char *p = df_path_join(dir, tokenizer_files[i]);
    if (!p) return df_error_nomem("path");
    struct stat sb;
    dflash_status st = DFLASH_OK;
    if (stat(p, &sb) == 0 && S_ISREG(sb.st_mode)) {
      st = digest_file(md, p, tokenizer_files[i], true);
      found++;
    }
    free(p);
    if (st) return st;
  }
  return found ? DFLASH_OK
               : df_error(DFLASH_E_NOT_FOUND,
                          "%s: no tokenizer files (tokenizer.json, "
                          "vocab.json, tiktoken.model...)",
                          dir);
}

static dflash_status digest_path(EVP_MD_CTX *md, const char *path) {
  struct stat sb;
  if (stat(path, &sb) != 0) return df_error_errno(DFLASH_E_IO, errno, "%s", path);
  if (S_ISDIR(sb.st_mode)) return digest_dir(md, path);
  /* A vocab.json is loaded with the files beside it (merges, added tokens). */
  if (df_str_ends_with(path, "vocab.json")) {
    char *dir = df_path_dirname(path);
    dflash_status st = dir ? digest_dir(md, dir) : df_error_nomem("path");
    free(dir);
    return st;
  }
  return digest_file(md, path, NULL, false);
}

/* The hash manifests recorded before the tokenizer's identity: the files' bytes. */
static dflash_status files_hash(const char *path, char *out, size_t cap) {
  DF_CHECK_ARG(path && out);
  if (cap < DFLASH_TOKENIZER_HASH_LEN)
    return df_error(DFLASH_E_BUFFER, "tokenizer hash needs %d bytes, got %zu",
                    DFLASH_TOKENIZER_HASH_LEN, cap);
  EVP_MD_CTX *md = EVP_MD_CTX_new();
  if (!md) return df_error_nomem("SHA-256 context");
  unsigned char d[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  dflash_status st = EVP_DigestInit_ex(md, EVP_sha256(), NULL)
                         ? DFLASH_OK
                         : df_error(DFLASH_E_IO, "SHA-256 unavailable in libcrypto");
  if (!st) st = digest_path(md, path);
  if (!st && (!EVP_DigestFinal_ex(md, d, &n) || n != 32))
    st = df_error(DFLASH_E_IO, "%s: SHA-256 final failed", path);
  EVP_MD_CTX_free(md);
  if (st) return st;
  memcpy(out, "sha256:", 7);
  for (unsigned i = 0; i < n; i++) snprintf(out + 7 + 2 * i, 3, "%02x", d[i]);
  return DFLASH_OK;
}

/* A directory without any tokenizer file: DFLASH_E_NOT_FOUND before the loader runs (a
 * caller probing folders, `dflash train --target`, tells it from a broken tokenizer). */
static dflash_status check_dir(const char *path) {
  struct stat sb;
  if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) return DFLASH_OK; /* the loader says */
  for (size_t i = 0; i < DF_ARRAY_LEN(tokenizer_files); i++) {
    char *p = df_path_join(path, tokenizer_files[i]);
    if (!p) return df_error_nomem("path");
    bool there = stat(p, &sb) == 0 && S_ISREG(sb.st_mode);
    free(p);
    if (there) return DFLASH_OK;
  }
  return df_error(DFLASH_E_NOT_FOUND,
                  "%s: no tokenizer files (tokenizer.json, vocab.json, tiktoken.model...)", path);
}

dflash_status dflash_dataset_tokenizer_hash(const char *path, char *out, size_t cap) {
  DF_CHECK_ARG(path && out);
  if (cap < DFLASH_TOKENIZER_HASH_LEN)
    return df_error(DFLASH_E_BUFFER, "tokenizer hash needs %d bytes, got %zu",
                    DFLASH_TOKENIZER_HASH_LEN, cap);
  dflash_tokenizer *tok = NULL;
  dflash_status st = check_dir(path);
  if (!st) st = dflash_tokenizer_load(path, NULL, &tok);
  if (!st) st = dflash_tokenizer_hash(tok, out, cap);
  dflash_tokenizer_free(tok);
  return st;
}

dflash_status dflash_dataset_tokenizer_matches(const char *path, const char *recorded) {
  DF_CHECK_ARG(path && recorded);
  char now[DFLASH_TOKENIZER_HASH_LEN], files[DFLASH_TOKENIZER_HASH_LEN];
  dflash_status st = dflash_dataset_tokenizer_hash(path, now, sizeof now);
  if (st || !strcmp(now, recorded)) return st;
  /* An older manifest: the files' bytes. */
  st = files_hash(path, files, sizeof files);
  if (st || !strcmp(files, recorded)) return st;
  return df_error(DFLASH_E_MISMATCH,
                  "the tokenizer at %s is %s, not %s: the dataset's ids would mean other tokens",
                  path, now, recorded);
}
