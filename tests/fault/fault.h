/*
 * Fault injection by link-time interposition (ld --wrap): the test program links the
 * library's objects (dflash_internal) with -Wl,--wrap=malloc,... so that every call the
 * library makes to these functions comes here first. While a kind is armed at N, its Nth call
 * fails (only that one: the code under test then carries on with a working allocator, the
 * harder case for cleanup paths); counting runs only between fault_start() and fault_stop(),
 * so the harness's own set-up and checks are never counted nor failed. jansson's allocations
 * are routed here too (json_set_alloc_funcs), so a JSON value the library builds can fail;
 * inside jansson's parser and json_dumps they are not (fault.c says why).
 */
#ifndef DFLASH_TESTS_FAULT_H
#define DFLASH_TESTS_FAULT_H

#include <stdbool.h>
#include <stdint.h>

typedef enum fault_kind {
  FAULT_ALLOC,  /* malloc, calloc, realloc, strdup, strndup, aligned_alloc, posix_memalign */
  FAULT_WRITE,  /* write */
  FAULT_FSYNC,  /* fsync, fdatasync */
  FAULT_RENAME, /* rename */
  FAULT_KINDS
} fault_kind;

/* Route jansson's allocator through the counting malloc; call once, first. */
void fault_init(void);
/* Start counting from zero with the Nth call of `kind` failing (n 0: nothing fails). */
void fault_start(fault_kind kind, uint64_t n);
/* Stop counting and failing. */
void fault_stop(void);
/* Calls of `kind` counted since fault_start. */
uint64_t fault_count(fault_kind kind);
/* Whether the armed call was reached (the fault was injected). */
bool fault_fired(void);
const char *fault_kind_name(fault_kind kind);

#endif
