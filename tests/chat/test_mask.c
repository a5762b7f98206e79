/* Loss masks from token byte offsets: the straddle rule, turn selection and
 * argument checks. */
#include <dflash/chat.h>
#include <string.h>

#include "testutil.h"

static const char conv[] = "[{\"role\": \"user\", \"content\": \"Q\"},"
                           " {\"role\": \"assistant\", \"content\": \"A1\"},"
                           " {\"role\": \"user\", \"content\": \"Q\"},"
                           " {\"role\": \"assistant\", \"content\": \"B2\"}]";

/* chatml text: "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n..." */
static dflash_chat_rendered *rendered(void) {
  dflash_chat_template *t;
  dflash_chat_rendered *r;
  ck_assert_ok(dflash_chat_template_create("chatml", &t));
  ck_assert_ok(dflash_chat_render_json(t, conv, strlen(conv), NULL, &r));
  dflash_chat_template_free(t);
  return r;
}

static uint32_t at(const dflash_chat_rendered *r, const char *needle, int nth) {
  const char *text = dflash_chat_rendered_text(r, NULL), *p = text;
  for (int k = 0; k <= nth; k++) p = strstr(k ? p + 1 : p, needle);
  ck_assert_ptr_nonnull(p);
  return (uint32_t)(p - text);
}

START_TEST(test_straddle_rule) {
  dflash_chat_rendered *r = rendered();
  uint32_t a1 = at(r, "A1", 0), end1 = at(r, "<|im_end|>", 1), b2 = at(r, "B2", 0);
  /* Tokens: "\nA" straddles the header's "\n" and the answer; "A" alone; "1";
   * "<|im_end|>"; "<|im_end|>\n" straddles end-of-turn and the scaffold "\n";
   * "B2" of the last turn; an empty token. */
  uint32_t begin[] = {a1 - 1, a1, a1 + 1, end1, end1, b2, b2};
  uint32_t end[] = {a1 + 1, a1 + 1, a1 + 2, end1 + 10, end1 + 11, b2 + 2, b2};
  uint8_t mask[7];
  size_t n;
  /* Offsets out of order are refused, so check pairs one at a time. */
  for (int i = 0; i < 7; i++)
    ck_assert_ok(
        dflash_chat_loss_mask(r, begin + i, end + i, 1, DFLASH_CHAT_TURNS_ALL, mask + i, &n));
  uint8_t want_all[] = {0, 1, 1, 1, 0, 1, 0};
  for (int i = 0; i < 7; i++) ck_assert_msg(mask[i] == want_all[i], "token %d: %d", i, mask[i]);
  for (int i = 0; i < 7; i++)
    ck_assert_ok(
        dflash_chat_loss_mask(r, begin + i, end + i, 1, DFLASH_CHAT_TURNS_LAST, mask + i, NULL));
  uint8_t want_last[] = {0, 0, 0, 0, 0, 1, 0};
  for (int i = 0; i < 7; i++) ck_assert_msg(mask[i] == want_last[i], "token %d: %d", i, mask[i]);
  dflash_chat_rendered_free(r);
}
END_TEST

START_TEST(test_whole_text) {
  /* One token per byte: supervised bytes are exactly "A1<|im_end|>B2<|im_end|>". */
  dflash_chat_rendered *r = rendered();
  size_t len;
  const char *text = dflash_chat_rendered_text(r, &len);
  uint32_t begin[256], end[256];
  uint8_t mask[256];
  ck_assert_uint_lt(len, 256);
  for (uint32_t i = 0; i < len; i++) begin[i] = i, end[i] = i + 1;
  size_t n;
  ck_assert_ok(dflash_chat_loss_mask(r, begin, end, len, DFLASH_CHAT_TURNS_ALL, mask, &n));
  char sup[256];
  size_t k = 0;
  for (size_t i = 0; i < len; i++)
    if (mask[i]) sup[k++] = text[i];
  sup[k] = 0;
  ck_assert_str_eq(sup, "A1<|im_end|>B2<|im_end|>");
  ck_assert_uint_eq(n, k);
  begin[1] = 0;
  ck_assert_status(dflash_chat_loss_mask(r, begin, end, len, DFLASH_CHAT_TURNS_ALL, mask, &n),
                   DFLASH_E_RANGE, "token 1");
  begin[1] = 1;
  end[len - 1] = (uint32_t)len + 1;
  ck_assert_status(dflash_chat_loss_mask(r, begin, end, len, DFLASH_CHAT_TURNS_ALL, mask, &n),
                   DFLASH_E_RANGE, "past the");
  dflash_chat_rendered_free(r);
}
END_TEST

TCase *tc_chat_mask(void) {
  TCase *tc = tcase_create("mask");
  tcase_add_test(tc, test_straddle_rule);
  tcase_add_test(tc, test_whole_text);
  return tc;
}
