"""A spool producer for the tests (tests/test_spool.py, tests/storage/test_spool_s3.py):
republishes an offline store's samples into a spool in a given order, epoch by
epoch, as a target-model prefill would, resuming where an earlier (killed) run
stopped.

usage: spool_producer.py SPOOL STORE ORDER SHARD_BYTES BUDGET DELAY_S EPOCHS STATUS_LOG
ORDER: lines "epoch sample_id". STATUS_LOG gets one JSON line per publish attempt.
"""
import json
import sys
import time

import libdflash


def main(spool, store, order_file, shard_bytes, budget, delay, epochs, log):
    order = {}
    for line in open(order_file):
        e, sid = line.split()
        order.setdefault(int(e), []).append(sid)
    src = libdflash.HiddenStore(store)
    # The target's final state travels with the sample when the store has it (DSpark).
    w = libdflash.HiddenWriter(spool, num_layers=src.num_layers, hidden_size=src.hidden_size,
                               shard_bytes=int(shard_bytes), spool_budget=int(budget),
                               spool_wait=None, final_state=src.final_state)
    with open(log, "a") as out:
        for epoch in range(w.spool_status()["epoch"], int(epochs)):
            for sid in order[epoch]:
                if sid in w:  # published before a crash
                    continue
                # The target's greedy tokens travel with the sample when the store has them.
                tids = src.target_ids(sid) if src.has_target_ids() == "stored" else None
                fin = src.read_final_state(sid) if src.final_state else None
                w.append(sid, src.read(sid), target_ids=tids, final_state=fin)
                out.write(json.dumps(w.spool_status()) + "\n")
                out.flush()
                time.sleep(float(delay))
            w.end_epoch()
            out.write(json.dumps(w.spool_status()) + "\n")
            out.flush()
    w.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
