#include "build_testutil.h"

dflash_dataset_build_options build_test_options(const char *tokenizer) {
  dflash_dataset_build_options o;
  dflash_dataset_build_options_default(&o);
  o.tokenizer_path = tokenizer;
  o.template_name = "qwen3";
  o.allow_split_control_tokens = 1;
  o.max_reject_ratio = 1;
  return o;
}
