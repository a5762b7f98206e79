"""libdflash.train_run, Trainer.evaluate / acceptance / from_checkpoint, drafter
config files, target head loading and the GPU memory plan, on the synthetic
world of test_train_cli (hidden states determine each sequence's future)."""
import json
import os
import subprocess

import numpy as np
import pytest

import libdflash
from libdflash import train
from test_train_cli import B, H, V, make_world


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    make_world(root, n_train=32, n_test=8)
    return root


def run(world, out, **kw):
    opts = dict(batch_size=4, num_anchors=16, seed=5, n_threads=2, lr=1e-2, epochs=40)
    opts.update(kw)
    return libdflash.train_run(json.loads((world / "drafter.json").read_text()), world / "target",
                            world / "train", world / "train-hidden", out, **opts)


def stable(path):
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        del r["tokens_per_s"], r["elapsed_s"]
    return rows


@pytest.fixture(scope="module")
def trained(world):
    out = world / "run"
    run(world, out, progress=world / "progress.log")
    return out


def test_train_run_writes_checkpoint_metrics_and_progress(world, trained):
    rows = stable(trained / "metrics.jsonl")
    assert len(rows) == 40 * 32 // 4
    assert [r["step"] for r in rows[:3]] in ([0, 1, 2], [1, 2, 3])
    assert rows[-1]["loss"] < 0.2 * rows[0]["loss"]
    cfg = train.load_config(trained / "config.json")
    assert (cfg.hidden_size, cfg.vocab_size, cfg.block_size) == (H, V, B)
    st = libdflash.SafeTensors(trained / "model.safetensors")
    with libdflash.Trainer.from_checkpoint(trained, world / "target") as t:
        assert sorted(st.keys()) == sorted(t.names())
        np.testing.assert_array_equal(t.parameters()["fc.weight"], st["fc.weight"])
    log = (world / "progress.log").read_text()
    assert log and "\r" not in log and str(len(rows)) in log.splitlines()[-1]


def test_evaluate_is_mean_acceptance_over_sampled_anchors(world, trained):
    with libdflash.Trainer.from_checkpoint(trained, world / "target") as t:
        got = t.evaluate(world / "test", world / "test-hidden", anchors_per_seq=8, seed=3)
        taus, hits = [], np.zeros(B - 1)
        with libdflash.SampleStream(world / "test", world / "test-hidden") as s:
            for index, _, ids, mask, hid in s.iterate():
                anchors = train.sample_anchors(mask, B, 8, seed=3, stream=index)
                accept, pred = t.acceptance(ids, hid, anchors), t.predict(ids, hid, anchors)
                truth = np.stack([ids[a + 1:a + B] for a in anchors])
                right = pred == truth
                # accept = leading run of correct predictions, recomputed here
                np.testing.assert_array_equal(accept, np.argmin(
                    np.concatenate([right, np.zeros((len(anchors), 1), bool)], 1), axis=1))
                taus += list(1 + accept)
                hits += right.sum(0)
    assert got["n_blocks"] == len(taus) > 0
    assert got["tau"] == pytest.approx(np.mean(taus), rel=1e-12)
    np.testing.assert_allclose(got["accuracy"], hits / len(taus), rtol=1e-12)
    assert 1 <= got["tau"] <= B


def test_training_raises_tau_above_an_untrained_drafter(world, trained, tmp_path):
    untrained = tmp_path / "untrained"
    run(world, untrained, max_steps=1, lr=0.0)
    taus = {}
    for name, ckpt in (("untrained", untrained), ("trained", trained)):
        with libdflash.Trainer.from_checkpoint(ckpt, world / "target") as t:
            taus[name] = t.evaluate(world / "test", world / "test-hidden", anchors_per_seq=8)["tau"]
    print("held-out tau:", taus)
    assert taus["untrained"] < 1.5 and taus["trained"] > taus["untrained"] + 1


def test_resumed_run_reproduces_the_uninterrupted_one(world, tmp_path):
    # The part run stops at 12 on purpose: its schedule is the full run's 20 steps.
    run(world, tmp_path / "full", epochs=3, save_every=4, max_steps=20)
    run(world, tmp_path / "part", epochs=3, save_every=4, max_steps=12, schedule_steps=20)
    run(world, tmp_path / "part", epochs=3, save_every=4, max_steps=20, resume=True)
    assert stable(tmp_path / "part" / "metrics.jsonl") == stable(tmp_path / "full" / "metrics.jsonl")
    assert (tmp_path / "part" / "model.safetensors").read_bytes() == \
        (tmp_path / "full" / "model.safetensors").read_bytes()


def test_train_run_never_replaces_a_run_by_accident(world, tmp_path):
    """As `dflash train`: a non-empty out_dir is refused unless resume or overwrite."""
    out = tmp_path / "o"
    run(world, out, max_steps=1)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(libdflash.ExistsError) as e:
        run(world, out, max_steps=2)
    assert "overwrite=True" in str(e.value) and "resume=True" in str(e.value)
    assert (out / "model.safetensors").read_bytes() == before
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    run(world, out, max_steps=2, overwrite=True)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    with pytest.raises(ValueError):
        run(world, out, resume=True, overwrite=True)


def test_train_run_returns_the_runs_summary(world, tmp_path):
    """train_run returns dflash train's summary from the run's stats (the metrics' last line)
    and how the run ended; a resume that trains no step reports the saved run's last step."""
    out = tmp_path / "s"
    got = run(world, out, max_steps=3)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert got.pop("final_loss") == pytest.approx(last["loss"], rel=1e-8)
    assert got.pop("elapsed_s") == pytest.approx(last["elapsed_s"], abs=1e-3)
    assert got == {"steps": 3, "epoch": last["epoch"], "tokens": last["tokens"],
                   "checkpoint": str(out), "checkpoint_step": 3, "stop_reason": "max_steps"}
    again = run(world, out, max_steps=3, resume=True)
    assert again.pop("final_loss") == pytest.approx(last["loss"], rel=1e-8)
    assert again.pop("elapsed_s") == pytest.approx(last["elapsed_s"], abs=1e-3)
    assert again == {"steps": 3, "epoch": last["epoch"], "tokens": last["tokens"],
                     "checkpoint": str(out), "checkpoint_step": 0, "stop_reason": "max_steps"}
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


CTRL_C = """
import json, os, signal, sys, threading, time
import libdflash
world, out = sys.argv[1], sys.argv[2]
def interrupt():  # Ctrl-C once 20 steps are written
    m = os.path.join(out, "metrics.jsonl")
    while not (os.path.exists(m) and open(m).read().count("\\n") >= 20):
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
try:
    libdflash.train_run(json.load(open(os.path.join(world, "drafter.json"))),
                        os.path.join(world, "target"), os.path.join(world, "train"),
                        os.path.join(world, "train-hidden"), out, batch_size=4, num_anchors=16,
                        seed=5, n_threads=2, lr=1e-2, epochs=100)
except KeyboardInterrupt as e:
    print("interrupted:", e)
    sys.exit(42)
"""


def test_ctrl_c_stops_train_run_with_its_state_saved(world, tmp_path):
    """Ctrl-C during train_run: the run stops after the step in flight with its state saved,
    KeyboardInterrupt is raised, and resume=True ends where the uninterrupted run does."""
    out = tmp_path / "part"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in __import__("sys").path if p))
    r = subprocess.run([__import__("sys").executable, "-c", CTRL_C, str(world), str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 42, (r.stdout, r.stderr)
    assert "state saved" in r.stdout and "--resume" in r.stdout, r.stdout
    n = len((out / "metrics.jsonl").read_text().splitlines())
    assert 20 <= n < 800 and (out / "train_state" / "state.safetensors").exists()
    run(world, out, epochs=100, resume=True)
    run(world, tmp_path / "full", epochs=100)
    assert stable(out / "metrics.jsonl") == stable(tmp_path / "full" / "metrics.jsonl")
    assert (out / "model.safetensors").read_bytes() == \
        (tmp_path / "full" / "model.safetensors").read_bytes()


def test_train_run_errors(world, tmp_path):
    with pytest.raises(libdflash.Error) as e:
        libdflash.train_run(world / "drafter.json", world / "target", world / "nope",
                         world / "train-hidden", tmp_path / "o")
    assert "nope" in e.value.message
    with pytest.raises(TypeError):
        run(world, tmp_path / "o", colour=1)


def test_config_files_round_trip(world, tmp_path):
    cfg = train.parse_config(world / "drafter.json")
    train.save_config(cfg, tmp_path / "config.json")
    written = json.loads((tmp_path / "config.json").read_text())
    assert written == train.config_to_dict(cfg)
    assert written["dflash_config"]["target_layer_ids"] == [3]
    assert written["block_size"] == written["dflash_config"]["block_size"] == B
    again = train.load_config(tmp_path / "config.json")
    assert train.config_to_dict(again) == written
    train.validate_config(again)
    again.num_key_value_heads = 3  # 4 heads are not a multiple of 3
    with pytest.raises(libdflash.Error) as e:
        train.validate_config(again)
    assert e.value.status == "DFLASH_E_CONFIG" and "num_key_value_heads" in e.value.message
    with pytest.raises(libdflash.Error) as e:
        train.load_config(tmp_path / "missing.json")
    assert "missing.json" in e.value.message


def test_train_plan_terms(world):
    cfg = json.loads((world / "drafter.json").read_text())
    with libdflash.Trainer(cfg, np.zeros((V, H), np.float32), np.zeros((V, H), np.float32)) as t:
        n_params = sum(p.size for p in t.parameters().values())
    plan = train.train_plan(cfg, world_size=1, seq_len=64, num_anchors=8)
    assert plan["fits"] and plan["n_params"] == n_params
    assert plan["weights"] == 2 * n_params and plan["grads"] == 4 * n_params
    assert plan["masters"] == 4 * n_params and plan["moments"] == 8 * n_params
    assert plan["frozen"] == 2 * 2 * V * H
    terms = ("weights", "masters", "moments", "grads", "activations", "frozen", "reserve")
    assert plan["total"] == sum(plan[k] for k in terms)
    # ZeRO-1 over 4 ranks shards masters and moments (buffer padded to a multiple of 4).
    sharded = train.train_plan(cfg, world_size=4, seq_len=64, num_anchors=8)
    padded = -(-n_params // 4)
    assert sharded["masters"] == 4 * padded and sharded["moments"] == 8 * padded
    tight = train.train_plan(cfg, gpu_bytes=1000, reserve_bytes=0)
    assert not tight["fits"] and tight["total"] > 1000 and tight["reason"]
    with pytest.raises(TypeError):
        train.train_plan(cfg, colour=1)


def test_target_head_loading(tmp_path):
    rng = np.random.default_rng(2)
    e = rng.standard_normal((V, H)).astype(np.float32)
    h = rng.standard_normal((V, H)).astype(np.float32)
    libdflash.write_safetensors(tmp_path / "a.safetensors",
                             {"model.embed_tokens.weight": e, "lm_head.weight": h})
    got_e, got_h = train.load_target_head(tmp_path / "a.safetensors", V, H)
    np.testing.assert_array_equal(got_e, e)
    np.testing.assert_array_equal(got_h, h)
    (tmp_path / "tied").mkdir()
    libdflash.write_safetensors(tmp_path / "tied" / "model.safetensors", {"emb": e})
    got_e, got_h = train.load_target_head(tmp_path / "tied", V, H, embed_name="emb")
    np.testing.assert_array_equal(got_e, e)
    np.testing.assert_array_equal(got_h, e)  # no LM head tensor: tied embeddings
    with pytest.raises(libdflash.Error) as err:
        train.load_target_head(tmp_path / "a.safetensors", V + 1, H)
    assert err.value.status in ("DFLASH_E_MISMATCH", "DFLASH_E_FORMAT")


def test_dflash2_loss_is_reported_by_component(world, tmp_path):
    """A DFlash 2 run's metrics give the block CE and the selector's weighted loss apart
    (their sum is `loss`), and the selector's part is its own: 0 with selector_loss_weight 0,
    the block CE then being the whole loss."""
    cfg = json.loads((world / "drafter.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=8, selector_top_k=4,
                                selector_rank=8)
    rows = {}
    for w in (1.0, 0.0):
        out = tmp_path / f"w{w}"
        libdflash.train_run(cfg, world / "target", world / "train", world / "train-hidden", out,
                            batch_size=4, num_anchors=16, seed=5, n_threads=2, lr=1e-2,
                            epochs=2, selector_loss_weight=w)
        rows[w] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows[1.0]:
        assert r["selector_loss"] > 0 and r["block_loss"] > 0, r
        assert abs(r["block_loss"] + r["selector_loss"] - r["loss"]) <= 1e-6 * r["loss"], r
    for r in rows[0.0]:
        assert r["selector_loss"] == 0 and r["block_loss"] == r["loss"], r
    plain = [json.loads(x) for x in (world / "run" / "metrics.jsonl").read_text().splitlines()
             ] if (world / "run").exists() else []
    assert all("selector_loss" not in r for r in plain)  # DFlash 1: one loss


def test_cli_plan_counts_dflash2_tensors(world, tmp_path):
    """`dflash train --plan` reads a DFlash 2 config (the _ext parser) and
    counts its convolutions and selector, as the trainer allocates them."""
    cli = os.environ.get("DFLASH_CLI")
    if not cli:
        pytest.skip("DFLASH_CLI not set (run through meson test)")
    cfg = json.loads((world / "drafter.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=8, selector_top_k=4,
                                selector_rank=8)
    (tmp_path / "d2.json").write_text(json.dumps(cfg))
    with libdflash.Trainer(cfg, np.zeros((V, H), np.float32), np.zeros((V, H), np.float32)) as t:
        n2 = sum(p.size for p in t.parameters().values())
    out = subprocess.run([cli, "train", "--plan", "--config", str(tmp_path / "d2.json")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f": {n2} trainable parameters" in out.stdout, out.stdout
    plain = subprocess.run([cli, "train", "--plan", "--config", str(world / "drafter.json")],
                           capture_output=True, text=True, check=True).stdout
    assert f": {n2} trainable parameters" not in plain  # the DFlash 2 tensors are counted


def _gpu_model():
    """bench/gpu_model.py, the performance model, whose smem_layout / pick_n mirror
    cuda/attention.cu's in Python (test_gpu_model checks it against the kernel's header)."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench", "gpu_model.py")
    spec = importlib.util.spec_from_file_location("gpu_model", path)
    gm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gm)
    return gm


@pytest.mark.parametrize("heads,d", [((64, 8), 128), ((32, 8), 128), ((64, 8), 256)])
def test_train_plan_attention_tiles(world, heads, d):
    """The plan's attention tiles at the Kimi (64/8 heads of 128, block 16: 128 rows per CTA)
    and Qwen3-8B (32/8: 64 rows) packings and at head_dim 256, on sm_120's 99 KB per block and
    sm_90's 227 KB: the key tile and bytes the performance model's mirror of the kernel picks,
    and a refusal naming the kernel where nothing fits."""
    gm = _gpu_model()
    cfg = json.loads((world / "drafter.json").read_text())
    cfg.update(num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=d,
               block_size=16)
    cfg["dflash_config"]["block_size"] = 16
    rows = 16 * heads[0] // heads[1]
    for limit in (101376, 232448):
        plan = train.train_plan(cfg, smem_per_block=limit, batch_size=3)
        tiles = {k: gm.pick_n(k, rows, d, limit) for k in ("fwd", "bwd_q", "bwd_kv")}
        assert plan["attention_rows"] == rows and plan["sequences_per_step"] == 3
        if all(tiles.values()):
            assert plan["fits"], plan.get("reason")
            assert plan["attention_key_tile"] == min(tiles.values())
            assert plan["attention_smem"] == max(gm.smem_layout(k, rows, n, d)
                                                 for k, n in tiles.items())
            assert plan["attention_smem"] <= limit
        else:
            assert not plan["fits"] and plan["attention_key_tile"] == 0
            assert "shared memory" in plan["reason"] and str(limit) in plan["reason"]
    # Kimi's and Qwen3-8B's packings fit sm_120; head_dim 256 at 128 rows does not.
    small = train.train_plan(cfg, smem_per_block=101376)
    assert small["fits"] == (d == 128)


def test_train_plan_sequences_per_step(world):
    """batch_size 0 (the default) is the trainer's pick: 4 sequences per step with several
    ranks on PCIe GPUs (pcie 1), else 1; a batch_size given is taken as it is; a negative one
    is refused."""
    cfg = json.loads((world / "drafter.json").read_text())
    pick = lambda **o: train.train_plan(cfg, **o)["sequences_per_step"]
    assert pick(world_size=8, pcie=1) == 4
    assert pick(world_size=1, pcie=1) == 1
    assert pick(world_size=8) == 1
    assert pick(world_size=8, pcie=1, batch_size=2) == 2
    with pytest.raises(train.Error) as e:
        train.train_plan(cfg, batch_size=-1)
    assert "batch -1 not negative" in str(e.value)
    # device >= 0 reads the GPU; without CUDA in the library (this build) it says so.
    plan = train.train_plan(cfg, device=0)
    if not plan["fits"]:
        assert "CUDA device 0" in plan["reason"], plan["reason"]
    assert plan["device_name"] == "" or "(sm_" in plan["device_name"]


def test_cli_plan_gpu(world, tmp_path):
    """`dflash train --plan --gpu NAME` takes the GPU's memory and shared memory per block."""
    cli = os.environ.get("DFLASH_CLI")
    if not cli:
        pytest.skip("DFLASH_CLI not set (run through meson test)")
    cfg = json.loads((world / "drafter.json").read_text())
    cfg.update(num_attention_heads=64, num_key_value_heads=8, head_dim=128, block_size=16)
    cfg["dflash_config"]["block_size"] = 16
    (tmp_path / "k.json").write_text(json.dumps(cfg))
    run = lambda *a: subprocess.run([cli, "train", "--plan", "--config", str(tmp_path / "k.json"),
                                     *a], capture_output=True, text=True)
    out = run("--gpu", "rtx-pro-6000", "--world", "8")
    assert out.returncode == 0, out.stderr
    assert "128 rows per CTA, 64 keys per tile" in out.stdout and "of 101376" in out.stdout
    assert "89.41 GiB" in out.stdout  # 96e9 bytes of GPU memory
    # Without --batch the trainer's pick: 4 sequences per step on 8 PCIe GPUs, no note.
    assert "sequences per GPU per step: 4 (the trainer's pick for PCIe GPUs" in out.stdout
    assert "note:" not in out.stdout
    one = run("--gpu", "rtx-pro-6000", "--world", "8", "--batch", "1").stdout
    assert "sequences per GPU per step: 1 (--batch" in one and "4 or more spread" in one
    assert "sequences per GPU per step: 1 (the trainer's pick;" in run(
        "--gpu", "h200", "--world", "8").stdout
    assert "of 232448" in run("--gpu", "h200").stdout
    small = run("--gpu", "rtx-pro-6000", "--smem-kb", "48")
    assert small.returncode == 1 and "shared memory" in small.stderr, small.stderr
    bad = run("--gpu", "a100")
    assert bad.returncode == 2 and "unknown --gpu 'a100'" in bad.stderr
