/* S3 credentials from the shared AWS files, after the options and the environment: the
 * profile (AWS_PROFILE, else "default") in ~/.aws/credentials, else in ~/.aws/config, each
 * set of keys taken whole; with a temporary HOME, so the machine's own files are not read. */
#include <dflash/storage.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "storage/storage_internal.h"
#include "testutil.h"

static const char CREDENTIALS[] = "# aws configure wrote this\n"
                                  "[default]\n"
                                  "aws_access_key_id = AKIDDEFAULT\n"
                                  "aws_secret_access_key=secret-default\n"
                                  "\n"
                                  "[work]\n"
                                  "aws_access_key_id = AKIDWORK\n"
                                  "aws_secret_access_key = secret-work\n"
                                  "aws_session_token = token-work\r\n"
                                  "s3 =\n"
                                  "  aws_access_key_id = NESTED\n"
                                  "[role]\n"
                                  "role_arn = arn:aws:iam::1:role/x\n"
                                  "source_profile = default\n";

static const char CONFIG[] = "[default]\n"
                             "region = eu-west-1\n"
                             "[profile cfg]\n"
                             "aws_access_key_id = AKIDCFG\n"
                             "aws_secret_access_key = secret-cfg\n";

/* A fresh HOME with ~/.aws/{credentials,config}; the AWS variables cleared. */
static char *fresh_home(void) {
  char *home = df_test_tmpdir();
  char path[4096];
  snprintf(path, sizeof path, "%s/.aws", home);
  ck_assert_int_eq(mkdir(path, 0700), 0);
  snprintf(path, sizeof path, "%s/.aws/credentials", home);
  ck_assert(df_test_write(path, CREDENTIALS, strlen(CREDENTIALS)));
  snprintf(path, sizeof path, "%s/.aws/config", home);
  ck_assert(df_test_write(path, CONFIG, strlen(CONFIG)));
  setenv("HOME", home, 1);
  const char *vars[] = {"AWS_ACCESS_KEY_ID",          "AWS_SECRET_ACCESS_KEY",
                        "AWS_SESSION_TOKEN",          "AWS_PROFILE",
                        "AWS_DEFAULT_PROFILE",        "AWS_CONFIG_FILE",
                        "AWS_SHARED_CREDENTIALS_FILE"};
  for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) unsetenv(vars[i]);
  return home;
}

/* The keys a storage made now would sign with ("" for none). */
static void expect_keys(const char *key_id, const char *secret, const char *token) {
  dflash_storage *st = NULL;
  ck_assert_ok(dflash_storage_create(NULL, &st));
  const df_s3_config *c = &st->cfg;
  ck_assert_str_eq(c->key_id ? c->key_id : "", key_id);
  ck_assert_str_eq(c->secret ? c->secret : "", secret);
  ck_assert_str_eq(c->token ? c->token : "", token);
  dflash_storage_free(st);
}

START_TEST(profile_keys_after_the_environment) {
  char *home = fresh_home();
  expect_keys("AKIDDEFAULT", "secret-default", ""); /* [default] */
  setenv("AWS_PROFILE", "work", 1);
  expect_keys("AKIDWORK", "secret-work", "token-work"); /* nested s3 block not a key */
  setenv("AWS_PROFILE", "cfg", 1);
  expect_keys("AKIDCFG", "secret-cfg", ""); /* [profile cfg] of ~/.aws/config */
  unsetenv("AWS_PROFILE");
  setenv("AWS_DEFAULT_PROFILE", "work", 1);
  expect_keys("AKIDWORK", "secret-work", "token-work");
  /* The environment's pair comes first, whole: no token from the profile beside it. */
  setenv("AWS_ACCESS_KEY_ID", "AKIDENV", 1);
  setenv("AWS_SECRET_ACCESS_KEY", "secret-env", 1);
  expect_keys("AKIDENV", "secret-env", "");
  /* AWS_SHARED_CREDENTIALS_FILE moves the file. */
  unsetenv("AWS_ACCESS_KEY_ID");
  unsetenv("AWS_SECRET_ACCESS_KEY");
  unsetenv("AWS_DEFAULT_PROFILE");
  char moved[4096];
  snprintf(moved, sizeof moved, "%s/elsewhere", home);
  const char *text = "[default]\naws_access_key_id=A2\naws_secret_access_key=S2\n";
  ck_assert(df_test_write(moved, text, strlen(text)));
  setenv("AWS_SHARED_CREDENTIALS_FILE", moved, 1);
  expect_keys("A2", "S2", "");
  df_test_rmtree(home);
  free(home);
}
END_TEST

/* No keys: the request fails before connecting, and the message says why the profile gave
 * none. */
static void expect_refused(const char *needle) {
  setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9", 1);
  dflash_storage *st = NULL;
  ck_assert_ok(dflash_storage_create(NULL, &st));
  void *data;
  size_t len;
  ck_assert_status(dflash_storage_read(st, "s3://bkt/key", &data, &len), DFLASH_E_AUTH,
                   "no AWS credentials");
  ck_assert_msg(strstr(dflash_last_error(), needle), "%s", dflash_last_error());
  ck_assert_int_eq(st->n_requests, 0);
  dflash_storage_free(st);
}

START_TEST(profile_without_keys_is_named) {
  char *home = fresh_home();
  setenv("AWS_PROFILE", "nope", 1);
  expect_refused("AWS_PROFILE \"nope\" is in neither");
  setenv("AWS_PROFILE", "role", 1);
  expect_refused("profile \"role\" has no aws_access_key_id");
  unsetenv("AWS_PROFILE");
  setenv("HOME", "/nonexistent-home", 1);
  expect_refused("~/.aws/credentials (AWS_PROFILE)");
  df_test_rmtree(home);
  free(home);
}
END_TEST

TCase *tc_storage_profile(void);
TCase *tc_storage_profile(void) {
  TCase *tc = tcase_create("profile");
  tcase_add_test(tc, profile_keys_after_the_environment);
  tcase_add_test(tc, profile_without_keys_is_named);
  return tc;
}
