"""The CUDA backend is a module that libdflash loads on the first CUDA call
(src/train/cuda/cuda_module.c). So importing the package and using its CPU paths maps no CUDA
library, and a later `import torch` gets its own CUDA runtime and NCCL rather than the ones
libdflash was linked with. (Before, the system libnccl.so.2 took the soname first, and a
PyTorch that needs a newer NCCL failed: libtorch_cuda.so: undefined symbol ncclCommResume.
That failure itself needs such a PyTorch and shows on no machine CI has; what it comes from,
the libraries mapped before torch and the ones torch ends up with, is checked here.)

Each check runs in a fresh interpreter: this process may have loaded CUDA already."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

PKG = "libdflash" if importlib.util.find_spec("libdflash") else "dflash"
HAVE_TORCH = importlib.util.find_spec("torch") is not None

PROBE = r"""
import json, sys
CUDA = ("libcudart", "libcublas", "libnccl", "libdflash-cuda")
def mapped():
    return sorted({l.split()[-1] for l in open("/proc/self/maps")
                   if any(k in l.rsplit("/", 1)[-1] for k in CUDA)})
out = {}
if "pkg" in sys.argv[1:]:
    import PKG as pkg
    out["version"] = pkg.version()
    out["status"] = pkg.status_name(25)
    out["before_torch"] = mapped()
if "count" in sys.argv[1:]:
    try:
        out["count"] = pkg.cuda_device_count()
    except pkg.Error as e:
        out["error"] = [e.status, e.message]
    out["after_count"] = mapped()
if "torch" in sys.argv[1:]:
    import torch
    out["torch"] = torch.__version__
    out["after_torch"] = mapped()
print(json.dumps(out))
""".replace("PKG", PKG)


def probe(*steps, env=None):
    run_env = dict(os.environ)
    run_env.pop("DFLASH_CUDA_MODULE", None)  # meson's test setup points it at the build
    run_env.update(env or {})
    res = subprocess.run([sys.executable, "-c", PROBE, *steps], capture_output=True,
                         text=True, env=run_env, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_import_maps_no_cuda_library():
    out = probe("pkg")
    assert out["status"] == "DFLASH_E_NO_DEVICE"
    assert out["before_torch"] == [], out


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_torch_after_the_package_loads_its_own_libraries():
    alone = probe("torch")
    after = probe("pkg", "torch")
    assert after["before_torch"] == [], after
    # The CUDA libraries torch maps (none for a CPU build) are the same with or without the
    # package imported first.
    assert after["after_torch"] == alone["after_torch"], (after, alone)


def cuda_outcome(env=None):
    out = probe("pkg", "count", env=env)
    if out.get("error", [""])[0] == "DFLASH_E_UNSUPPORTED":
        pytest.skip("library built without CUDA")
    return out


def test_cuda_call_loads_the_module_beside_the_library():
    out = cuda_outcome()
    if "error" in out:  # no GPU here: the driver's reason, from a module that loaded
        status, message = out["error"]
        assert status == "DFLASH_E_NO_DEVICE", out
        assert "module" not in message, out
    else:
        assert out["count"] > 0
    assert any(p.endswith("/libdflash-cuda.so") for p in out["after_count"]), out


def test_missing_module_is_named(tmp_path):
    path = str(tmp_path / "nowhere" / "libdflash-cuda.so")
    out = cuda_outcome({"DFLASH_CUDA_MODULE": path})
    status, message = out["error"]
    assert status == "DFLASH_E_NO_DEVICE"
    assert path in message and "not found" in message, message
    assert out["after_count"] == [], out
