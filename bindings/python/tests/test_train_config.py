"""Drafter configs the reference loaders read differently are refused;
partial_rotary_factor is a DrafterConfig field; Trainer.logits."""
import json

import numpy as np
import pytest

import libdflash
from libdflash import train

CFG = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
    "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 29,
    "num_target_layers": 12, "block_size": 4,
    "dflash_config": {"mask_token_id": 28, "target_layer_ids": [2, 6]},
}


def heads(rng):
    e = rng.standard_normal((29, 16)).astype(np.float32)
    h = rng.standard_normal((29, 16)).astype(np.float32)
    return e, h


def test_logits_are_the_blocks_argmax_and_include_position_0():
    rng = np.random.default_rng(1)
    e, h = heads(rng)
    with libdflash.Trainer(CFG, e, h, seed=2, init_std=0.3) as tr:
        ids = rng.integers(0, 28, 24).astype(np.int32)
        hid = rng.standard_normal((24, 32)).astype(np.float32)
        anchors = [0, 7, 20, 23]
        lg = tr.logits(ids, hid, anchors)
        assert lg.shape == (4, 4, 29) and lg.dtype == np.float32
        np.testing.assert_array_equal(lg[:, 1:].argmax(-1), tr.predict(ids, hid, anchors))
        one = tr.logits(ids, hid, [20])
        np.testing.assert_allclose(one[0], lg[2], rtol=0, atol=1e-5)
        with pytest.raises(libdflash.Error, match="anchor 0 = 24"):
            tr.logits(ids, hid, [24])


def test_partial_rotary_factor_round_trip(tmp_path):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(2)
    e, h = heads(rng)
    cfg = dict(CFG, partial_rotary_factor=0.5)
    c = train.parse_config(cfg)
    assert c.partial_rotary_factor == 0.5
    assert train.config_to_dict(c)["partial_rotary_factor"] == 0.5
    assert train.parse_config(CFG).partial_rotary_factor == 1.0
    ids = rng.integers(0, 28, 16).astype(np.int32)
    hid = rng.standard_normal((16, 32)).astype(np.float32)
    with libdflash.Trainer(cfg, e, h, seed=3, init_std=0.3) as tr, \
            libdflash.Trainer(CFG, e, h, seed=3, init_std=0.3) as full:
        assert tr.config.partial_rotary_factor == 0.5
        # Same weights, different rotation: different logits.
        assert not np.allclose(tr.logits(ids, hid, [9]), full.logits(ids, hid, [9]))
        tr.save(tmp_path / "drafter")
        want = tr.logits(ids, hid, [0, 9, 15])
    written = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert written["partial_rotary_factor"] == 0.5 and written["num_target_layers"] == 12
    save_file({"model.embed_tokens.weight": e, "lm_head.weight": h},
              str(tmp_path / "target.safetensors"))
    with train.Trainer.from_checkpoint(str(tmp_path / "drafter"),
                                       str(tmp_path / "target.safetensors")) as back:
        assert back.config.partial_rotary_factor == 0.5
        np.testing.assert_array_equal(back.logits(ids, hid, [0, 9, 15]), want)
    # save_config keeps it too.
    train.save_config(cfg, str(tmp_path / "c.json"))
    assert json.loads((tmp_path / "c.json").read_text())["partial_rotary_factor"] == 0.5
    assert train.load_config(str(tmp_path / "c.json")).partial_rotary_factor == 0.5


@pytest.mark.parametrize("change, status, needle", [
    ({"architectures": ["DFlash2DraftModel"]}, "DFLASH_E_CONFIG",
     'a DFlash2DraftModel needs "conv_kernel_size"'),
    ({"output_multiplier": 2.0}, "DFLASH_E_UNSUPPORTED", '"output_multiplier" = 2.0'),
    ({"dflash_config": dict(CFG["dflash_config"], selector_rank=16)}, "DFLASH_E_UNSUPPORTED",
     "dflash_config.\"selector_rank\""),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 1024},
      "max_position_embeddings": 2048}, "DFLASH_E_CONFIG", "rope_scaling.factor 4 differs"),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4},
     "DFLASH_E_CONFIG", "use_sliding_window"),
])
def test_refusals_name_the_key_and_file(tmp_path, change, status, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(CFG, **change)))
    with pytest.raises(libdflash.Error) as err:
        train.load_config(str(path))
    assert err.value.status == status
    assert needle in err.value.message and str(path) in err.value.message


def test_no_num_target_layers_is_not_saved(tmp_path):
    cfg = {k: v for k, v in CFG.items() if k != "num_target_layers"}
    c = train.parse_config(cfg)  # explicit target_layer_ids: enough to train
    with pytest.raises(libdflash.Error, match="num_target_layers") as err:
        train.save_config(c, str(tmp_path / "config.json"))
    assert err.value.status == "DFLASH_E_CONFIG"
    assert not (tmp_path / "config.json").exists()
    rng = np.random.default_rng(3)
    e, h = heads(rng)
    with libdflash.Trainer(c, e, h) as tr, pytest.raises(libdflash.Error, match="num_target_layers"):
        tr.save(tmp_path / "drafter")
    assert not (tmp_path / "drafter" / "model.safetensors").exists()
