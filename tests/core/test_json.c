#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "testutil.h"

START_TEST(parse_reports_position_and_kind) {
  json_t *j;
  ck_assert_status(df_json_parse("{\"a\": 1,\n \"a\": 2}", 18, "cfg.json", &j), DFLASH_E_DUPLICATE,
                   "cfg.json");
  ck_assert_status(df_json_parse("{\"a\": \n[1,}", 11, "x.json", &j), DFLASH_E_JSON, "line 2");
  ck_assert_status(df_json_parse("\"\xff\"", 3, "u.json", &j), DFLASH_E_UTF8, "u.json");
  ck_assert_ok(df_json_parse("{\"k\": [1, 2]}", 13, "ok", &j));
  char *s;
  ck_assert_ok(df_json_dump(j, 0, &s));
  ck_assert_str_eq(s, "{\"k\":[1,2]}");
  free(s);
  json_decref(j);
}
END_TEST

TCase *tc_json(void) {
  TCase *tc = tcase_create("json");
  tcase_add_test(tc, parse_reports_position_and_kind);
  return tc;
}
