"""What a closed or collected object handed out stays readable: every array, bytes or str
taken from a binding object reads the same after the object is closed, deleted and
collected (zero-copy views keep the library object alive; everything else is a copy),
and calling the closed object raises ValueError. Never a crash: each check runs in its
own interpreter, so a segfault fails that test instead of killing the suite."""
import os
import subprocess
import sys
import textwrap

import pytest

FIXTURES = os.environ.get("DFLASH_FIXTURES") or os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "..", "shared", "fixtures")
CL100K = os.path.join(FIXTURES, "tokenizers", "openai", "cl100k_base.tiktoken.gz")

PRELUDE = """
import gc, sys
import numpy as np
import libdflash
tmp = sys.argv[1]

def closed_raises(fn, *args):
    try:
        fn(*args)
    except ValueError as e:
        assert "closed" in str(e), e
    else:
        raise AssertionError(f"{fn.__name__} on a closed object did not raise")
"""


def isolated(tmp_path, body, env=None):
    """Run PRELUDE + body in a fresh interpreter; fail with its output unless it exits 0.
    glibc's MALLOC_PERTURB_ fills freed memory, so reading it fails loudly."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint('ok')\n"
    env = dict(os.environ, **(env or {}), MALLOC_PERTURB_="165")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                       text=True, timeout=300, env=env)
    if r.returncode < 0:
        pytest.fail(f"crashed with signal {-r.returncode}\n{r.stdout}\n{r.stderr}")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_dataset_array_read_after_close(tmp_path):
    """An array taken from a Dataset and read after close() segfaulted."""
    isolated(tmp_path, """
    from libdflash.hidden import write_dataset
    write_dataset(tmp + "/d", [("a", np.arange(1000, dtype=np.int32), np.ones(1000, np.uint8))])
    ds = libdflash.Dataset(tmp + "/d")
    sid, ids, mask = ds[0]
    ds.close()
    assert int(ids.sum()) == 999 * 1000 // 2 and int(mask.sum()) == 1000
    """)


def test_dataset_views_outlive_close(tmp_path):
    """Dataset samples are zero-copy views of the mapped shards: they keep the
    mapping until the last one goes (the old views read unmapped memory)."""
    isolated(tmp_path, """
    from libdflash.hidden import write_dataset
    rng = np.random.default_rng(0)
    samples = [(f"s{i}", rng.integers(0, 1 << 30, 40000 + i, dtype=np.int32),
                rng.integers(0, 2, 40000 + i, dtype=np.uint8)) for i in range(40)]
    write_dataset(tmp + "/d", samples, shard_tokens=200000)
    ds = libdflash.Dataset(tmp + "/d")
    views = [ds[i] for i in range(len(ds))] + [ds[-1]]
    it_views = list(ds)
    ds.close()
    del ds
    gc.collect()
    for churn in ([], [np.ones(1 << 20, np.uint8) for _ in range(64)]):  # reuse address space
        for (sid, ids, mask), (rid, rids, rmask), other in zip(views, samples + [samples[-1]],
                                                              it_views + [it_views[-1]]):
            assert sid == rid and not ids.flags.writeable and not mask.flags.writeable
            np.testing.assert_array_equal(ids, rids)
            np.testing.assert_array_equal(mask, rmask)
            np.testing.assert_array_equal(other[1], rids)
    # Dropped without close(): a view alone keeps its shard mapped.
    one = libdflash.Dataset(tmp + "/d")[3][1]
    gc.collect()
    np.testing.assert_array_equal(one, samples[3][1])
    ds = libdflash.Dataset(tmp + "/d")
    ds.close()
    for fn, args in ((len, (ds,)), (ds.__getitem__, (0,)), (ds.length_histogram, ())):
        closed_raises(fn, *args)
    """)


def test_safetensors_views_outlive_close(tmp_path):
    isolated(tmp_path, """
    arrays = {"a": np.arange(300000, dtype=np.float32).reshape(600, 500),
              "b": np.arange(7, dtype=np.int64), "empty": np.zeros((0, 3), np.float16)}
    libdflash.write_safetensors(tmp + "/m.safetensors", arrays)
    st = libdflash.SafeTensors(tmp + "/m.safetensors")
    views = {k: st[k] for k in arrays}
    st.close()
    del st
    gc.collect()
    for churn in ([], [np.ones(1 << 20, np.uint8) for _ in range(64)]):
        for k, a in arrays.items():
            assert views[k].shape == a.shape and not views[k].flags.writeable
            np.testing.assert_array_equal(views[k], a)
    st = libdflash.SafeTensors(tmp + "/m.safetensors")
    st.close()
    for fn, args in ((len, (st,)), (st.__getitem__, ("a",)), (st.keys, ())):
        closed_raises(fn, *args)
    """)


def test_hidden_store_reads_are_copies(tmp_path):
    isolated(tmp_path, """
    rng = np.random.default_rng(1)
    x = rng.standard_normal((50, 2 * 64)).astype(np.float32)
    with libdflash.HiddenWriter(tmp + "/h", num_layers=2, hidden_size=64) as w:
        w.append("a", x)
        w.append("b", x[:9])
    store = libdflash.HiddenStore(tmp + "/h")
    got, ids = store.read("a"), store.ids()
    before = got.copy()
    store.close()
    del store
    gc.collect()
    assert ids == ["a", "b"] and got.flags.owndata
    np.testing.assert_array_equal(got, before)
    store = libdflash.HiddenStore(tmp + "/h")
    store.close()
    for fn, args in ((store.read, ("a",)), (store.ids, ()), (store.length, ("a",))):
        closed_raises(fn, *args)
    closed_raises(w.append, "c", x)  # the writer, closed by its `with`
    closed_raises(w.flush)
    """)


def test_sample_stream_items_are_copies(tmp_path):
    isolated(tmp_path, """
    from libdflash.hidden import write_dataset
    rng = np.random.default_rng(2)
    samples = [(f"s{i}", rng.integers(0, 100, 30 + i, dtype=np.int32),
                np.ones(30 + i, np.uint8)) for i in range(6)]
    write_dataset(tmp + "/d", samples)
    with libdflash.HiddenWriter(tmp + "/h", num_layers=1, hidden_size=8) as w:
        for sid, ids, _ in samples:
            w.append(sid, rng.standard_normal((ids.size, 8)).astype(np.float32))
    expect = libdflash.HiddenStore(tmp + "/h")
    stream = libdflash.SampleStream(tmp + "/d", tmp + "/h", prefetch=2)
    items = list(stream.iterate())
    stream.close()
    del stream
    gc.collect()
    assert len(items) == len(samples)
    for (index, sid, ids, mask, hidden), (rid, rids, rmask) in zip(items, samples):
        assert sid == rid
        np.testing.assert_array_equal(ids, rids)
        np.testing.assert_array_equal(mask, rmask)
        np.testing.assert_array_equal(hidden, expect.read(sid))
    stream = libdflash.SampleStream(tmp + "/d", tmp + "/h", prefetch=2)
    gen = stream.iterate()
    next(gen)
    stream.close()
    closed_raises(next, gen)  # closed between two items of an iteration
    for fn, args in ((len, (stream,)), (stream.check, ()), (stream.width, ())):
        closed_raises(fn, *args)
    """)


def test_tokenizer_outputs_are_copies(tmp_path):
    if not os.path.exists(CL100K):
        pytest.skip(f"fixture {CL100K} is absent")
    isolated(tmp_path, f"""
    tok = libdflash.Tokenizer({CL100K!r})
    ids = tok.encode("Hello, world! " * 200)
    batch = tok.encode_batch(["a b c", "<|endoftext|> x", ""])
    piece, text = tok.id_to_token(9906), tok.decode(ids)
    before = ids.copy(), [b.copy() for b in batch]
    tok.close()
    del tok
    gc.collect()
    np.testing.assert_array_equal(ids, before[0])
    for b, r in zip(batch, before[1]):
        np.testing.assert_array_equal(b, r)
    assert piece == b"Hello" and text == "Hello, world! " * 200
    tok = libdflash.Tokenizer({CL100K!r})
    tok.close()
    for fn, args in ((tok.encode, ("x",)), (tok.decode, (ids,)), (tok.decode_bytes, (ids,)),
                     (tok.id_to_token, (1,)), (tok.encode_batch, (["x"],)), (len, (tok,))):
        closed_raises(fn, *args)
    """)


def test_rendered_and_template_outputs_are_copies(tmp_path):
    tok_line = (f"tok = libdflash.Tokenizer({CL100K!r})" if os.path.exists(CL100K)
                else "tok = None")
    isolated(tmp_path, "\n    " + tok_line + """
    messages = [{"role": "user", "content": "hi " * 500},
                {"role": "assistant", "content": "hello " * 500}]
    tpl = libdflash.ChatTemplate("qwen3")
    conv = libdflash.Conversation(messages)
    r = tpl.render_full(conv)
    data, text, spans, name, eot = r.data, r.text, r.spans, tpl.name, tpl.end_of_turn
    begin = np.array([s["begin"] for s in spans], np.uint32)
    end = np.array([s["end"] for s in spans], np.uint32)
    mask = r.loss_mask(begin, end)
    enc = r.encode(tok) if tok is not None else None
    before = data, text, [dict(s) for s in spans], mask.copy()
    r.close()
    conv.close()
    tpl.close()
    del r, tpl, conv
    gc.collect()
    assert (data, text, spans) == before[:3] and name == "qwen3" and eot
    np.testing.assert_array_equal(mask, before[3])
    if enc is not None:
        ids, m, sup = enc
        assert ids.size == m.size and sup == int(m.sum()) and tok.decode_bytes(ids) == data
    tpl = libdflash.ChatTemplate("qwen3")
    conv = libdflash.Conversation(messages)
    r = tpl.render_full(conv)
    r.close()
    closed_raises(r.loss_mask, begin, end)
    if tok is not None:
        closed_raises(r.encode, tok)
    conv.close()
    closed_raises(len, conv)
    closed_raises(conv.normalize_nfc)
    closed_raises(tpl.render, conv)
    tpl.close()
    closed_raises(tpl.render, messages)
    """)


def test_storage_outputs_are_copies(tmp_path):
    isolated(tmp_path, """
    blob = bytes(range(256)) * 4000
    arrays = {"w": np.arange(100000, dtype=np.float32)}
    libdflash.write_safetensors(tmp + "/m.safetensors", arrays)
    s = libdflash.Storage()
    s.write(tmp + "/blob", blob)
    data, part, listing = s.read(tmp + "/blob"), s.read_range(tmp + "/blob", 10, 1000), \\
        s.list(tmp + "/")
    st = s.open_safetensors(tmp + "/m.safetensors")
    w, keys = st["w"], st.keys()
    st.close()
    s.close()
    del s, st
    gc.collect()
    assert data == blob and part == blob[10:1010] and keys == ["w"]
    assert [loc for loc, _ in listing] == [tmp + "/blob", tmp + "/m.safetensors"]
    np.testing.assert_array_equal(w, arrays["w"])
    # Objects made from a Storage borrow its client: closing the Storage first
    # leaves them working; the client goes with the last of them.
    s = libdflash.Storage()
    st = s.open_safetensors(tmp + "/m.safetensors")
    writer = s.open_writer(tmp + "/late")
    chunks = s.chunk_writer(tmp + "/chunks/", "c", max_records=2)
    s.close()
    closed_raises(s.read, tmp + "/blob")
    del s
    gc.collect()
    np.testing.assert_array_equal(st["w"], arrays["w"])
    writer.write(b"late data")
    writer.commit()
    for i in range(3):
        chunks.append({"i": i})
    chunks.close()
    del st, writer, chunks
    gc.collect()
    s = libdflash.Storage()
    assert s.read(tmp + "/late") == b"late data"
    assert len(s.list(tmp + "/chunks/")) == 2
    st = s.open_safetensors(tmp + "/m.safetensors")
    st.close()
    closed_raises(st.__getitem__, "w")
    """)


def test_trainer_outputs_are_copies(tmp_path):
    isolated(tmp_path, """
    cfg = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
           "vocab_size": 29, "num_target_layers": 12, "block_size": 4,
           "dflash_config": {"mask_token_id": 28, "target_layer_ids": [2, 6]}}
    rng = np.random.default_rng(0)
    e = rng.standard_normal((29, 16)).astype(np.float32)
    tr = libdflash.Trainer(cfg, e, e, seed=3)
    ids = rng.integers(0, 28, 20).astype(np.int32)
    hid = rng.standard_normal((20, 32)).astype(np.float32)
    tr.forward_backward(ids, np.ones(20, np.uint8), hid, [0, 5])
    params, grads, names = tr.parameters(), tr.gradients(), tr.names()
    pred = tr.predict(ids, hid, [0, 5])
    before = {k: v.copy() for k, v in params.items()}, {k: v.copy() for k, v in grads.items()}
    tr.close()
    del tr
    gc.collect()
    assert list(params) == names and pred.shape == (2, 3)
    for k in names:
        np.testing.assert_array_equal(params[k], before[0][k])
        np.testing.assert_array_equal(grads[k], before[1][k])
    tr = libdflash.Trainer(cfg, e, e, seed=3)
    tr.close()
    mask = np.ones(20, np.uint8)
    for fn, args in ((tr.parameters, ()), (tr.gradients, ()), (tr.predict, (ids, hid, [0])),
                     (tr.step, ()), (tr.forward_backward, (ids, mask, hid, [0])),
                     (tr.walk, (ids, mask, hid)), (tr.save, (tmp + "/ckpt",))):
        closed_raises(fn, *args)
    """)


def test_storage_objects_outlive_closed_client_s3(tmp_path):
    """Against S3 the borrowed client is used for every request (its curl handle):
    objects made from a Storage keep it alive after Storage.close()."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests",
                                    "storage"))
    import s3env
    if not s3env.moto_available():
        pytest.skip("moto[server] not installed (pip install -r scripts/requirements.txt)")
    env = s3env.S3Env()
    try:
        isolated(tmp_path, """
        import os
        base = "s3://" + os.environ["DFLASH_TEST_S3_BUCKET"] + "/outlive/"
        arrays = {"a": np.arange(50000, dtype=np.float32), "b": np.arange(9, dtype=np.int16)}
        libdflash.write_safetensors(tmp + "/m.safetensors", arrays)
        s = libdflash.Storage(backoff_base_s=0.005, backoff_max_s=0.05)
        s.copy(tmp + "/m.safetensors", base + "m.safetensors")
        st = s.open_safetensors(base + "m.safetensors", readahead=4096)
        writer = s.open_writer(base + "late")
        chunks = s.chunk_writer(base + "chunks/", "c", max_records=2)
        s.close()
        closed_raises(s.read, base + "late")
        del s
        gc.collect()
        churn = [bytearray(1 << 12) for _ in range(4096)]
        for k, a in arrays.items():
            np.testing.assert_array_equal(st[k], a)
        writer.write(b"late data")
        writer.commit()
        for i in range(3):
            chunks.append({"i": i})
        chunks.close()
        del st, writer, chunks
        gc.collect()
        s = libdflash.Storage(backoff_base_s=0.005, backoff_max_s=0.05)
        assert s.read(base + "late") == b"late data"
        assert len(s.list(base + "chunks/")) == 2
        """, env=env.env)
    finally:
        env.close()
