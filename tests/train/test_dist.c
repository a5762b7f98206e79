/* The host communicator of data-parallel runs (dist.h), ranks as threads:
 * rank-ordered sums, broadcast, and every way a peer can fail. */
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/internal.h"
#include "synth.h"
#include "testutil.h"
#include "train/cuda/dist.h"

enum { MAXW = 3, NBIG = 100003 }; /* NBIG floats: several of rank 0's receive chunks */

typedef struct peer {
  df_dist_env env;
  double timeout;
  int mode;
  float *big;
  double small[3];
  unsigned char blob[16];
  dflash_status st;
  char msg[1024];
} peer;

enum {
  M_SUMS,
  M_ABORT_RANK2,
  M_SILENT_RANK1,
  M_CLOSE_RANK1,
  M_DIVERGE,
  M_BCAST_LEN,
  M_STALLED_RANK0,
  M_BARRIER
};

/* M_STALLED_RANK0: more than loopback's socket buffers hold, and the flag
 * rank 1 raises when its send gave up (rank 0 stays connected till then). */
enum { NHUGE = 32 << 20 };
static int rank1_done;

static void keep(peer *p, dflash_status st) {
  p->st = st;
  snprintf(p->msg, sizeof p->msg, "%s", st ? dflash_last_error() : "");
}

static void *peer_main(void *arg) {
  peer *p = arg;
  df_comm *c;
  dflash_status st = df_comm_open(&p->env, p->timeout, &c);
  int r = p->env.rank;
  if (st) return keep(p, st), NULL;
  switch (p->mode) {
  case M_SUMS:
    st = df_comm_sum_f32(c, p->big, NBIG);
    if (!st) st = df_comm_sum_f64(c, p->small, 3);
    if (!st) st = df_comm_broadcast(c, p->blob, sizeof p->blob);
    if (!st) st = df_comm_broadcast(c, NULL, 0);
    break;
  case M_ABORT_RANK2:
    if (r == 2) {
      df_error(DFLASH_E_IO, "disk on fire");
      df_comm_abort(c, DFLASH_E_IO);
    } else {
      st = df_comm_sum_f64(c, p->small, 1);
    }
    break;
  case M_SILENT_RANK1:
    if (r == 1) usleep(1500 * 1000); /* alive, never in the collective */
    else st = df_comm_sum_f64(c, p->small, 1);
    break;
  case M_CLOSE_RANK1:
    if (r != 1) st = df_comm_sum_f64(c, p->small, 1);
    break;
  case M_DIVERGE: st = df_comm_sum_f64(c, p->small, r == 0 ? 2 : 3); break;
  case M_BCAST_LEN: st = df_comm_broadcast(c, p->blob, r == 0 ? 16 : 8); break;
  case M_STALLED_RANK0: /* rank 0 alive and connected, not reading */
    if (r == 1) {
      st = df_comm_sum_f32(c, p->big, NHUGE);
      __atomic_store_n(&rank1_done, 1, __ATOMIC_SEQ_CST);
    }
    for (int i = 0; r == 0 && i < 3000 && !__atomic_load_n(&rank1_done, __ATOMIC_SEQ_CST); i++)
      usleep(10 * 1000);
    break;
  case M_BARRIER: st = df_comm_broadcast(c, NULL, 0); break;
  }
  keep(p, st);
  df_comm_free(c);
  return NULL;
}

static void run_peers_at(peer *p, int world, int mode, double timeout, const char *addr) {
  pthread_t th[MAXW];
  int port = synth_free_port();
  for (int i = 0; i < world; i++) {
    p[i].env = (df_dist_env){.rank = i, .world = world, .master_port = port};
    strcpy(p[i].env.master_addr, addr);
    p[i].timeout = timeout;
    p[i].mode = mode;
  }
  for (int i = world - 1; i >= 0; i--) pthread_create(&th[i], NULL, peer_main, &p[i]);
  for (int i = 0; i < world; i++) pthread_join(th[i], NULL);
}

static void run_peers(peer *p, int world, int mode, double timeout) {
  run_peers_at(p, world, mode, timeout, "127.0.0.1");
}

START_TEST(comm_sums_in_rank_order_on_every_rank) {
  peer p[MAXW] = {0};
  /* Values where float addition order matters: 1e8 + 3 - 1e8. */
  for (int r = 0; r < MAXW; r++) {
    p[r].big = malloc(sizeof(float) * NBIG);
    for (int i = 0; i < NBIG; i++)
      p[r].big[i] = r == 0 ? 1e8f : r == 1 ? (float)(i % 7) + 0.25f : -1e8f + (float)i;
    p[r].small[0] = r == 1 ? 1e17 : 1.0;
    p[r].small[1] = 0.1 * (r + 1);
    p[r].small[2] = -(double)r;
    for (int k = 0; k < 16; k++) p[r].blob[k] = r == 0 ? (unsigned char)(3 * k + 1) : 0;
  }
  float *want = malloc(sizeof(float) * NBIG);
  for (int i = 0; i < NBIG; i++) want[i] = (p[0].big[i] + p[1].big[i]) + p[2].big[i];
  double want_small[3];
  for (int k = 0; k < 3; k++) want_small[k] = (p[0].small[k] + p[1].small[k]) + p[2].small[k];
  run_peers(p, MAXW, M_SUMS, 20);
  for (int r = 0; r < MAXW; r++) {
    ck_assert_msg(p[r].st == DFLASH_OK, "rank %d: %s", r, p[r].msg);
    ck_assert_mem_eq(p[r].big, want, sizeof(float) * NBIG);
    ck_assert_mem_eq(p[r].small, want_small, sizeof want_small);
    ck_assert_mem_eq(p[r].blob, p[0].blob, 16);
    free(p[r].big);
  }
  ck_assert_int_eq(p[2].blob[5], 16);
  /* The order is observable: (1e17 + 1) + 1 != 1e17 + (1 + 1) in double. */
  ck_assert(want_small[0] == 1e17 + 1.0 + 1.0);
  free(want);
}
END_TEST

START_TEST(comm_abort_reaches_every_rank_naming_it) {
  peer p[MAXW] = {0};
  run_peers(p, MAXW, M_ABORT_RANK2, 20);
  for (int r = 0; r < 2; r++) {
    ck_assert_msg(p[r].st == DFLASH_E_CANCELLED, "rank %d: %s", r, p[r].msg);
    ck_assert_msg(strstr(p[r].msg, "rank 2 failed (DFLASH_E_IO)") &&
                      strstr(p[r].msg, "disk on fire"),
                  "rank %d: %s", r, p[r].msg);
  }
}
END_TEST

START_TEST(comm_timeout_names_the_silent_rank) {
  peer p[2] = {0};
  run_peers(p, 2, M_SILENT_RANK1, 0.3);
  ck_assert_int_eq(p[0].st, DFLASH_E_TIMEOUT);
  ck_assert_msg(strstr(p[0].msg, "rank 1 sent nothing") && strstr(p[0].msg, "dist_timeout_s"), "%s",
                p[0].msg);
}
END_TEST

START_TEST(comm_closed_peer_is_named_and_passed_on) {
  peer p[MAXW] = {0};
  run_peers(p, MAXW, M_CLOSE_RANK1, 20);
  ck_assert_int_eq(p[0].st, DFLASH_E_NETWORK);
  ck_assert_msg(strstr(p[0].msg, "rank 1 closed its connection"), "%s", p[0].msg);
  /* Rank 2 hears it from rank 0 instead of waiting for its own timeout. */
  ck_assert_int_eq(p[2].st, DFLASH_E_CANCELLED);
  ck_assert_msg(strstr(p[2].msg, "rank 1 failed (DFLASH_E_NETWORK)"), "%s", p[2].msg);
}
END_TEST

START_TEST(comm_diverged_ranks_are_caught) {
  peer p[2] = {0};
  run_peers(p, 2, M_DIVERGE, 20);
  ck_assert_int_eq(p[0].st, DFLASH_E_INTERNAL);
  ck_assert_msg(strstr(p[0].msg, "diverged"), "%s", p[0].msg);
  ck_assert_int_eq(p[1].st, DFLASH_E_CANCELLED);
}
END_TEST

/* Rank 0 sends its length first: it must catch the mismatch too, not send
 * 16 bytes to a rank that expects 8 and carry on. */
START_TEST(comm_broadcast_lengths_must_agree) {
  peer p[2] = {0};
  run_peers(p, 2, M_BCAST_LEN, 20);
  ck_assert_msg(p[0].st == DFLASH_E_INTERNAL && strstr(p[0].msg, "diverged"), "rank 0: %s",
                p[0].msg);
  ck_assert_msg(p[1].st == DFLASH_E_CANCELLED, "rank 1: %s", p[1].msg);
}
END_TEST

/* A send larger than the socket buffers to a rank that does not read must
 * still end at the deadline (a blocking send waited until rank 0 closed). */
START_TEST(comm_send_to_a_stalled_rank_times_out) {
  peer p[2] = {0};
  p[1].big = calloc(NHUGE, sizeof(float));
  ck_assert_ptr_nonnull(p[1].big);
  run_peers(p, 2, M_STALLED_RANK0, 0.2);
  ck_assert_msg(p[1].st == DFLASH_E_TIMEOUT && strstr(p[1].msg, "rank 0 took no data"),
                "rank 1: %s", p[1].msg);
  free(p[1].big);
}
END_TEST

/* dist_timeout_s accepts up to 1e9 s; poll's int milliseconds end at
 * ~2.1e6 s (the rendezvous used to time out at once). */
START_TEST(comm_timeout_beyond_int_milliseconds) {
  peer p[2] = {0};
  run_peers(p, 2, M_BARRIER, 1e7);
  for (int r = 0; r < 2; r++) ck_assert_msg(p[r].st == DFLASH_OK, "rank %d: %s", r, p[r].msg);
}
END_TEST

/* MASTER_ADDR resolving to IPv6 (localhost is ::1 on many hosts) reaches
 * rank 0, which listened on IPv4 only. */
START_TEST(comm_rendezvous_over_ipv6) {
  int fd = socket(AF_INET6, SOCK_STREAM, 0);
  struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
  bool v6 = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
  if (fd >= 0) close(fd);
  if (!v6) {
    fprintf(stderr, "SKIP comm_rendezvous_over_ipv6: no IPv6 loopback here\n");
    return;
  }
  peer p[2] = {0};
  run_peers_at(p, 2, M_BARRIER, 3, "::1");
  for (int r = 0; r < 2; r++) ck_assert_msg(p[r].st == DFLASH_OK, "rank %d: %s", r, p[r].msg);
}
END_TEST

TCase *tc_dist(void) {
  TCase *tc = tcase_create("dist");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, comm_sums_in_rank_order_on_every_rank);
  tcase_add_test(tc, comm_abort_reaches_every_rank_naming_it);
  tcase_add_test(tc, comm_timeout_names_the_silent_rank);
  tcase_add_test(tc, comm_closed_peer_is_named_and_passed_on);
  tcase_add_test(tc, comm_diverged_ranks_are_caught);
  tcase_add_test(tc, comm_broadcast_lengths_must_agree);
  tcase_add_test(tc, comm_send_to_a_stalled_rank_times_out);
  tcase_add_test(tc, comm_timeout_beyond_int_milliseconds);
  tcase_add_test(tc, comm_rendezvous_over_ipv6);
  return tc;
}
