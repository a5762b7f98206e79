import ctypes
import os
import subprocess

import pytest

import dflash
from dflash import _lib


def test_version_matches_library():
    assert dflash.version() == dflash.__version__
    major, minor, _ = (int(x) for x in dflash.version().split("."))
    assert (major, minor) == (_lib.ABI_MAJOR, _lib.ABI_MINOR)


def test_errors_carry_status_and_message():
    with pytest.raises(dflash.Error) as info:
        _lib.bind("dflash_cuda_device_count", [ctypes.c_void_p])(None)
    assert info.value.status == "DFLASH_E_INVALID_ARG"
    assert "invalid argument" in info.value.message


def test_status_names():
    assert dflash.status_name(0) == "DFLASH_OK"
    assert dflash.status_name(3) == "DFLASH_E_IO"


def test_cli_version():
    cli = os.environ.get("DFLASH_CLI")
    if not cli:
        pytest.skip("DFLASH_CLI not set (run through meson test)")
    out = subprocess.run([cli, "--version"], capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"dflash {dflash.version()}")
