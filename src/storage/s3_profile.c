/* S3 credentials from the shared files every AWS tool reads, when neither the options nor the
 * environment give a key pair: a user who ran `aws configure` (or set AWS_PROFILE) expects
 * libdflash to use those keys as the AWS CLI and boto3 do.
 *
 * The profile is AWS_PROFILE, else AWS_DEFAULT_PROFILE, else "default". Its keys
 * (aws_access_key_id, aws_secret_access_key, aws_session_token) are read from section
 * [PROFILE] of AWS_SHARED_CREDENTIALS_FILE (default ~/.aws/credentials), else from
 * [profile PROFILE] ([default] for the default profile) of AWS_CONFIG_FILE (default
 * ~/.aws/config). Not read: instance roles (IMDS), SSO, credential_process, role_arn. */
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "storage_internal.h"

/* Keys of a profile, as one set: never one from the environment and one from a file. */
typedef struct {
  char *key_id, *secret, *token;
  bool has_section;
  bool nomem;
} profile_keys;

static const char *env_or(const char *name, const char *dflt) {
  const char *v = getenv(name);
  return v && *v ? v : dflt;
}

static char *trimmed(const char *b, const char *e) {
  while (b < e && (*b == ' ' || *b == '\t')) b++;
  while (e > b && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r')) e--;
  return strndup(b, (size_t)(e - b));
}

/* One line of an INI text: a section header switches *in, a key of the wanted section is
 * kept. Indented lines continue a nested value (`s3 =` blocks) and are not keys. */
static void ini_line(const char *b, const char *e, const char *section, bool *in, profile_keys *k) {
  if (b == e || *b == ' ' || *b == '\t' || *b == '#' || *b == ';') return;
  if (*b == '[') {
    const char *close = memchr(b, ']', (size_t)(e - b));
    char *name = close ? trimmed(b + 1, close) : NULL;
    k->nomem |= close && !name;
    *in = name && !strcmp(name, section);
    k->has_section |= *in;
    free(name);
    return;
  }
  const char *eq = memchr(b, '=', (size_t)(e - b));
  if (!*in || !eq) return;
  char *key = trimmed(b, eq);
  k->nomem |= !key;
  char **slot = !key                                        ? NULL
                : !strcasecmp(key, "aws_access_key_id")     ? &k->key_id
                : !strcasecmp(key, "aws_secret_access_key") ? &k->secret
                : !strcasecmp(key, "aws_session_token")     ? &k->token
                                                            : NULL;
  free(key);
  if (slot && !*slot) k->nomem |= !(*slot = trimmed(eq + 1, e));
}

/* The keys of `section` in the file at `path` (absent file: none). */
static void read_section(const char *path, const char *section, profile_keys *k) {
  char *text = NULL;
  size_t len = 0;
  dflash_status st = path ? df_read_file(path, &text, &len) : DFLASH_E_NOT_FOUND;
  k->nomem |= st == DFLASH_E_NOMEM;
  if (st) { /* a missing or unreadable file holds no keys, as for the AWS CLI */
    dflash_clear_error();
    return;
  }
  bool in = false;
  for (const char *b = text, *end = text + len; b < end;) {
    const char *e = memchr(b, '\n', (size_t)(end - b));
    if (!e) e = end;
    ini_line(b, e, section, &in, k);
    b = e + 1;
  }
  free(text);
}

static void keys_free(profile_keys *k) {
  free(k->key_id);
  free(k->secret);
  free(k->token);
  memset(k, 0, sizeof *k);
}

/* The file at the environment variable `env`, else ~/.aws/`name` (NULL without a home). */
static char *aws_file(const char *env, const char *name) {
  const char *set = env_or(env, NULL);
  if (set) return df_strdup(set);
  const char *home = env_or("HOME", NULL);
  return home ? df_asprintf("%s/.aws/%s", home, name) : NULL;
}

/* Why no keys were found, for the "no AWS credentials" message; NULL when nothing to say. */
static char *note(const char *profile, bool named, const profile_keys *k, const char *cred,
                  const char *conf) {
  if (k->has_section)
    return df_asprintf("profile \"%s\" has no aws_access_key_id and aws_secret_access_key "
                       "(roles, SSO and credential_process are not supported)",
                       profile);
  if (named)
    return df_asprintf("AWS_PROFILE \"%s\" is in neither %s nor %s", profile,
                       cred ? cred : "~/.aws/credentials", conf ? conf : "~/.aws/config");
  return NULL;
}

dflash_status df_s3_profile_credentials(df_s3_config *c) {
  if (c->key_id && *c->key_id && c->secret && *c->secret) return DFLASH_OK;
  const char *named = env_or("AWS_PROFILE", env_or("AWS_DEFAULT_PROFILE", NULL));
  const char *profile = named ? named : "default";
  char *cred = aws_file("AWS_SHARED_CREDENTIALS_FILE", "credentials");
  char *conf = aws_file("AWS_CONFIG_FILE", "config");
  char *conf_section = strcmp(profile, "default") ? df_asprintf("profile %s", profile)
                                                  : df_strdup("default");
  profile_keys k = {0};
  if (conf_section) read_section(cred, profile, &k);
  if (conf_section && !(k.key_id && k.secret)) {
    bool seen = k.has_section, nomem = k.nomem;
    keys_free(&k); /* one file's set, never a mix */
    k.has_section = seen, k.nomem = nomem;
    read_section(conf, conf_section, &k);
  }
  dflash_status st = conf_section && !k.nomem ? DFLASH_OK : df_error_nomem("AWS profile");
  if (!st && k.key_id && k.secret) {
    free(c->key_id), free(c->secret), free(c->token);
    c->key_id = k.key_id, c->secret = k.secret, c->token = k.token;
    memset(&k, 0, sizeof k);
  } else if (!st) {
    c->cred_note = note(profile, named != NULL, &k, cred, conf);
  }
  keys_free(&k);
  free(cred), free(conf), free(conf_section);
  return st;
}
