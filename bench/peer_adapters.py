"""Adapters from a libdflash dataset + hidden-state store to the inputs of two peer
DFlash trainers, for bench/peer_trainers.py. Our own code: nothing of the peers' is
copied; the formats are what their readers take (SpecForge 0.2.0's offline DFlash
feature files, vLLM speculators 0.9.0's offline dataset).

- SpecForge: one ``.ckpt`` per sample (``torch.save`` of a dict): ``input_ids`` int64
  [S], ``loss_mask`` int64 [S], ``hidden_states`` float32 [S, K*H] (the K target layers
  side by side, as our store holds them). SpecForge reads ``*.ckpt`` under a folder in
  sorted order, so files are named ``data_{i:06d}.ckpt`` in the dataset's order.
- speculators: a Hugging Face dataset (``datasets.Dataset.save_to_disk``) with columns
  ``input_ids``, ``loss_mask``, ``seq_len``, and ``hidden_states/hs_{i}.safetensors`` for
  row i, as vLLM's extract_hidden_states connector writes them: ``hidden_states`` bf16
  [S, K+1, H] (the K drafter layers, then the target's final layer, whose logits
  speculators trains on) and ``token_ids`` int64 [S]. libdflash reads that folder as a
  hidden store too (src/hidden/vllm.c), so the same files train libdflash with
  ``--labels target``.

Both functions return the number of samples written. Samples are joined by id; a
dataset sample without hidden states is an error naming it.
"""
import json
import os
import struct

import numpy as np


def _samples(data_dir, hidden_dir, limit=0):
    """(sample_id, input_ids int64, loss_mask int64, rows float32 [S, K*H]) in the
    dataset's order; the store's width and layer count come along."""
    import libdflash
    ds, hs = libdflash.Dataset(data_dir), libdflash.HiddenStore(hidden_dir)
    have = set(hs.ids())
    for i, (sid, ids, mask) in enumerate(ds):
        if limit and i >= limit:
            break
        if sid not in have:
            raise KeyError(f"{hidden_dir}: no hidden states for sample {sid!r} of {data_dir}")
        rows = hs.read(sid)
        if rows.shape[0] != len(ids):
            raise ValueError(f"{hidden_dir}: sample {sid!r} has {rows.shape[0]} rows, "
                             f"the dataset {len(ids)} tokens")
        yield sid, np.asarray(ids, np.int64), np.asarray(mask, np.int64), rows, hs


def specforge_features(data_dir, hidden_dir, out_dir, limit=0):
    """Write SpecForge's offline DFlash feature files (see the module doc)."""
    import torch
    os.makedirs(out_dir, exist_ok=True)
    n = 0
    for n, (sid, ids, mask, rows, _hs) in enumerate(_samples(data_dir, hidden_dir, limit), 1):
        torch.save({"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask),
                    "hidden_states": torch.from_numpy(np.ascontiguousarray(rows))},
                   os.path.join(out_dir, f"data_{n - 1:06d}.ckpt"))
    return n


def bf16_bytes(a):
    """float32 array -> bfloat16 bytes, rounded to nearest even (exact for rows that
    came from a bf16 store)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16).tobytes()


def write_safetensors(path, tensors):
    """tensors: name -> (dtype string, shape, raw bytes). The safetensors layout: an
    8-byte little-endian header length, the JSON header, the data, 8-byte aligned."""
    header, off, blobs = {}, 0, []
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def speculators_dataset(data_dir, hidden_dir, out_dir, final_rows, limit=0):
    """Write speculators' offline dataset (see the module doc). final_rows(sample_id,
    input_ids) gives the target's final-layer rows float32 [S, H] (before its final
    norm, as vLLM captures them)."""
    hs_dir = os.path.join(out_dir, "hidden_states")
    os.makedirs(hs_dir, exist_ok=True)
    cols = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i, (sid, ids, mask, rows, hs) in enumerate(_samples(data_dir, hidden_dir, limit)):
        K, H, S = hs.num_layers, hs.hidden_size, len(ids)
        fin = np.asarray(final_rows(sid, ids), np.float32)
        if fin.shape != (S, H):
            raise ValueError(f"final-layer rows of {sid!r}: shape {fin.shape}, want {(S, H)}")
        stacked = np.concatenate([rows.reshape(S, K, H), fin[:, None, :]], axis=1)
        write_safetensors(os.path.join(hs_dir, f"hs_{i}.safetensors"), {
            "hidden_states": ("BF16", (S, K + 1, H), bf16_bytes(stacked)),
            "token_ids": ("I64", (S,), ids.astype("<i8").tobytes())})
        cols["input_ids"].append(ids.tolist())
        cols["loss_mask"].append(mask.tolist())
        cols["seq_len"].append(S)
    _save_hf_dataset(cols, out_dir)
    return len(cols["seq_len"])


def _save_hf_dataset(cols, out_dir):
    """The columns as a Hugging Face dataset on disk (needs the peers' `datasets`);
    without it, a JSON copy is left for a later save (the test suite's python has none)."""
    try:
        import datasets
    except ImportError:
        with open(os.path.join(out_dir, "columns.json"), "w") as f:
            json.dump(cols, f)
        return
    datasets.Dataset.from_dict(cols).save_to_disk(out_dir)


def read_safetensors_raw(path):
    """name -> (dtype string, shape, raw bytes) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}


def keep_tensors(src_files, dst, names):
    """The tensors of `names` from src_files into one safetensors file dst (a peer's
    checkpoint also holds the frozen verifier head and norm, which z-lab's layout
    leaves to the target); returns the names that were not found."""
    got = {}
    for f in src_files:
        got.update({k: v for k, v in read_safetensors_raw(f).items() if k in names})
    write_safetensors(dst, {k: got[k] for k in sorted(got)})
    return sorted(set(names) - set(got))


def add_validation_copy(out_dir):
    """speculators 0.9.0 insists on a validation split (train_data_ratio in (0, 1)): the
    first sample is appended once more as the last row, and the returned ratio keeps
    every original sample in the training split and the copy alone in validation
    (validation never steers its training here: no --save-best). The dataset is saved
    in torch format, as speculators compares its rows with tensors."""
    import datasets
    hs = os.path.join(out_dir, "hidden_states")
    marker = os.path.join(out_dir, "validation_copy")
    ds = datasets.load_from_disk(out_dir)
    if not os.path.exists(marker):
        n = len(ds)
        with open(os.path.join(hs, "hs_0.safetensors"), "rb") as f, \
                open(os.path.join(hs, f"hs_{n}.safetensors"), "wb") as g:
            g.write(f.read())
        ds = datasets.concatenate_datasets([ds, ds.select([0])])
    ds = ds.with_format("torch")
    tmp = out_dir.rstrip("/") + ".tmp"
    ds.save_to_disk(tmp)
    rows = len(ds)
    del ds
    for f in os.listdir(tmp):
        os.replace(os.path.join(tmp, f), os.path.join(out_dir, f))
    os.rmdir(tmp)
    open(marker, "w").close()
    return (rows - 0.5) / rows
