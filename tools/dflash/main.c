/* `dflash`: command-line front end. Dispatches to one function per subcommand. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "commands.h"

extern char **environ;

typedef struct {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *summary;
} command;

static const command commands[] = {
    {"inspect", cmd_inspect, "list the tensors of a safetensors file, shard set or index"},
    {"tokenize", cmd_tokenize, "render, tokenize and loss-mask conversations into a dataset"},
    {"fetch", cmd_fetch, "regenerate completions with OpenAI-compatible servers"},
    {"show", cmd_show, "one sample of a dataset, its supervised tokens highlighted"},
    {"cp", cmd_cp, "copy between local paths and s3:// URLs"},
    {"ls", cmd_ls, "list objects or files under a prefix"},
    {"init-config", cmd_init_config, "a drafter config.json for a target model's config"},
    {"train", cmd_train, "train a DFlash drafter (CPU reference backend)"},
    {"eval", cmd_eval, "acceptance length tau of a drafter checkpoint"},
    {"render", cmd_render, "render one conversation (stdin) with a chat template, or its mask"},
    {"encode", cmd_encode, "text on stdin -> token ids, one per line"},
    {"decode", cmd_decode, "token ids on stdin -> the bytes they stand for"},
    {NULL, NULL, NULL},
};

int cli_fail(const char *cmd, dflash_status st) {
  fprintf(stderr, "dflash %s: %s: %s\n", cmd, dflash_status_str(st), dflash_last_error());
  return 1;
}

long long cli_int(const char *opt, const char *v, long long lo, long long hi, bool *bad) {
  char *end = NULL;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno || end == v || *end || x < lo || x > hi) {
    fprintf(stderr, "dflash: %s wants an integer in [%lld, %lld], got '%s'\n", opt, lo, hi, v);
    *bad = true;
    return lo;
  }
  return x;
}

double cli_real(const char *opt, const char *v, double lo, double hi, bool *bad) {
  char *end = NULL;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || end == v || *end || !(x >= lo && x <= hi)) {
    fprintf(stderr, "dflash: %s wants a number in [%g, %g], got '%s'\n", opt, lo, hi, v);
    *bad = true;
    return lo;
  }
  return x;
}

static void usage(FILE *out) {
  fprintf(
      out,
      "usage: dflash <command> [options]\n       dflash --version\n\n"
      "The pipeline, in order:\n"
      "  1. dflash fetch --server URL --model NAME prompts.jsonl -o gen/\n"
      "       regenerate completions with the target's OpenAI-compatible servers\n"
      "  2. dflash tokenize --tokenizer TARGET_DIR --template NAME gen/completions.jsonl -o data/\n"
      "       render, tokenize and loss-mask them (check with dflash inspect/show data/)\n"
      "  3. dump the target's hidden states (Python: libdflash.HiddenWriter) into hidden/\n"
      "  4. dflash init-config --target TARGET_DIR -o drafter.json\n"
      "  5. dflash train --config drafter.json --target TARGET_DIR --data data/\n"
      "                  --hidden hidden/ -o drafter/\n"
      "  6. dflash eval --checkpoint drafter/ --target TARGET_DIR --data heldout/\n"
      "                 --hidden heldout-hidden/\n\n"
      "commands:\n");
  for (size_t i = 0; commands[i].name; i++)
    fprintf(out, "  %-11s %s\n", commands[i].name, commands[i].summary);
  fprintf(out, "\n`dflash <command> --help` describes each command: options, defaults, exit "
               "status\n(0 done, 1 an error named on stderr, 2 a usage error).\n");
}

/* environ plus `add`, in a new array; NULL when out of memory. The CLI never
 * changes its own environment: the library and its callers read one that holds still. */
static char **environ_plus(char *add) {
  size_t n = 0;
  while (environ[n]) n++;
  char **env = malloc((n + 2) * sizeof *env);
  if (!env) return NULL;
  memcpy(env, environ, n * sizeof *env);
  env[n] = add;
  env[n + 1] = NULL;
  return env;
}

/* OpenBLAS picks its kernels when the process loads it, from OPENBLAS_CORETYPE
 * or its own table of CPUs, which may predate this CPU (then it runs generic
 * kernels, at up to half the speed). Only a new process can choose again, so
 * the commands that train or evaluate re-execute themselves with the kernels
 * the library advises, unless the user chose already. Returns on failure:
 * the command then runs as it is, and the library warns. */
static void reexec_with_fitting_blas(char **argv) {
  const char *core = dflash_blas_coretype_advice();
  if (!core || getenv("OPENBLAS_CORETYPE")) return;
  char var[64];
  snprintf(var, sizeof var, "OPENBLAS_CORETYPE=%s", core);
  char **env = environ_plus(var);
  if (!env) return;
  fprintf(stderr, "dflash: OpenBLAS chose its %s kernels on this CPU; running again with %s\n",
          dflash_blas_corename(), var);
  execve("/proc/self/exe", argv, env);
  fprintf(stderr, "dflash: cannot re-execute (%s); going on with the %s kernels\n", strerror(errno),
          dflash_blas_corename());
  free(env);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
    int devices = 0;
    dflash_status st = dflash_cuda_device_count(&devices);
    printf("dflash %s (library %s)\n", DFLASH_VERSION_STRING, dflash_version_string());
    if (st == DFLASH_OK) printf("CUDA: %d device(s)\n", devices);
    else printf("CUDA: unavailable: %s\n", dflash_last_error());
    return 0;
  }
  if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
    usage(stdout);
    return 0;
  }
  if (!strcmp(argv[1], "train") || !strcmp(argv[1], "eval")) reexec_with_fitting_blas(argv);
  for (size_t i = 0; commands[i].name; i++)
    if (!strcmp(argv[1], commands[i].name)) return commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "dflash: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return 2;
}
