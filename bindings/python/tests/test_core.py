import ctypes
import logging
import os
import subprocess

import pytest

import libdflash
from libdflash import _lib


def test_version_matches_library():
    assert libdflash.version() == libdflash.__version__
    major, minor, _ = (int(x) for x in libdflash.version().split("."))
    assert (major, minor) == (_lib.ABI_MAJOR, _lib.ABI_MINOR)


def test_errors_carry_status_and_message():
    with pytest.raises(libdflash.Error) as info:
        _lib.bind("dflash_cuda_device_count", [ctypes.c_void_p])(None)
    assert info.value.status == "DFLASH_E_INVALID_ARG"
    assert "invalid argument" in info.value.message


def test_status_names():
    assert libdflash.status_name(0) == "DFLASH_OK"
    assert libdflash.status_name(3) == "DFLASH_E_IO"


def test_cli_version():
    cli = os.environ.get("DFLASH_CLI")
    if not cli:
        pytest.skip("DFLASH_CLI not set (run through meson test)")
    out = subprocess.run([cli, "--version"], capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"dflash {libdflash.version()}")


def test_last_error_and_clear_error():
    libdflash.clear_error()
    assert libdflash.last_error() == ""
    with pytest.raises(libdflash.Error) as info:
        libdflash.SafeTensors("/nonexistent/dir/x.safetensors")
    assert libdflash.last_error() == info.value.message
    assert "/nonexistent/dir/x.safetensors" in libdflash.last_error()
    libdflash.clear_error()
    assert libdflash.last_error() == ""


@pytest.fixture
def log_reset():
    yield
    libdflash.set_log_callback(None)


YARN = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 29,
        "num_target_layers": 12, "block_size": 4, "max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 1024},
        "dflash_config": {"mask_token_id": 28, "target_layer_ids": [2]}}


def test_log_callback_receives_library_messages(log_reset):
    from libdflash import train
    seen = []
    libdflash.set_log_callback(lambda level, msg: seen.append((level, msg)), max_level="debug")
    train.parse_config(YARN)  # no attention_factor: the library warns
    assert [lvl for lvl, _ in seen] == ["warn"] and "has no attention_factor" in seen[0][1]
    seen.clear()
    with pytest.raises(libdflash.Error):
        train.parse_config(dict(YARN, rope_scaling=None, num_key_value_heads=3))
    # Errors are logged at debug level with their status name and message.
    assert ("debug", "DFLASH_E_CONFIG: " + libdflash.last_error()) in seen
    seen.clear()
    libdflash.set_log_callback(lambda level, msg: seen.append((level, msg)), max_level="info")
    with pytest.raises(libdflash.Error):
        train.parse_config(dict(YARN, rope_scaling=None, num_key_value_heads=3))
    assert seen == []  # debug is above max_level: dropped in C
    libdflash.set_log_callback(None)
    train.parse_config(YARN)
    assert seen == []


def test_log_to_python_logging(log_reset, caplog):
    from libdflash import train
    log = libdflash.log_to_python("libdflash.test")
    assert log.name == "libdflash.test"
    with caplog.at_level(logging.WARNING, logger="libdflash.test"):
        libdflash.log_to_python("libdflash.test")  # max_level follows the logger: warn
        train.parse_config(YARN)  # no attention_factor: the library warns
    warnings = [r for r in caplog.records if r.name == "libdflash.test"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "has no attention_factor" in warnings[0].getMessage()
