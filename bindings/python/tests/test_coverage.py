"""Every public C function is bound by the Python package, and the package's
version agrees with the C library's.

The headers come from $DFLASH_INCLUDE_DIR (a folder holding dflash/*.h, e.g.
an installed PREFIX/include) or the source tree next to this file."""
import importlib
import os
import pathlib
import pkgutil
import re

import pytest

import libdflash
from libdflash import _lib

ROOT = pathlib.Path(__file__).resolve().parents[3]

# Public functions the package deliberately leaves unbound, each with the reason.
# Empty: callbacks (progress's write callback among them) are bound through ctypes
# CFUNCTYPE objects; no public function takes a FILE *.
ALLOWED_UNBOUND = {}


def header_dir():
    env = os.environ.get("DFLASH_INCLUDE_DIR")
    folder = pathlib.Path(env) / "dflash" if env else ROOT / "include" / "dflash"
    if not folder.is_dir():
        pytest.skip(f"no public headers at {folder} (set DFLASH_INCLUDE_DIR)")
    return folder


def public_functions(folder):
    """Names declared DFLASH_API in the headers (comments stripped: they mention names)."""
    names = set()
    for header in sorted(folder.glob("*.h")):
        text = re.sub(r"/\*.*?\*/", " ", header.read_text(), flags=re.S)
        for m in re.finditer(r"\bDFLASH_API\b([^;{]*)", text):
            f = re.search(r"\b(dflash_\w+)\s*\(", m.group(1))
            if f:
                names.add(f.group(1))
    return names


def bound_functions():
    for mod in pkgutil.iter_modules(libdflash.__path__):  # every module's bind() calls run
        importlib.import_module(f"libdflash.{mod.name}")
    return set(_lib.BOUND)


def test_parser_reads_every_header():
    names = public_functions(header_dir())
    headers = {p.stem for p in header_dir().glob("*.h")}
    assert {"dflash", "progress", "train", "fetch", "chat"} <= headers
    # One known function from each header, so a parser that finds nothing fails.
    for known in ("dflash_set_log_callback", "dflash_progress_create", "dflash_train_run",
                  "dflash_fetch_stop", "dflash_chat_encode", "dflash_dataset_open",
                  "dflash_hidden_open", "dflash_safetensors_open", "dflash_tokenizer_load",
                  "dflash_storage_read"):
        assert known in names
    assert len(names) > 150


def test_every_public_function_is_bound():
    declared = public_functions(header_dir())
    bound = bound_functions()
    missing = sorted(declared - bound - set(ALLOWED_UNBOUND))
    assert not missing, f"{len(missing)} of {len(declared)} public functions are not bound " \
                        f"by the Python package: {missing}"
    stale = sorted(bound - declared)
    assert not stale, f"bound but not declared DFLASH_API: {stale}"
    assert not set(ALLOWED_UNBOUND) & bound, "an allow-listed function is bound after all"


def test_bound_functions_exist_in_the_library():
    for name in bound_functions():
        assert hasattr(_lib.lib, name)


def test_package_version_matches_the_library():
    assert libdflash.__version__ == libdflash.version()
    major, minor = (int(x) for x in libdflash.version().split(".")[:2])
    assert (major, minor) == (_lib.ABI_MAJOR, _lib.ABI_MINOR)


def test_versions_agree_in_the_source_tree():
    meson = ROOT / "meson.build"
    if not meson.exists():
        pytest.skip("not run from a source tree")
    text = meson.read_text()
    assert re.search(r"version:\s*'([^']+)'", text).group(1) == libdflash.__version__
    assert re.search(r"dflash_soversion\s*=\s*'(\d+)'", text).group(1) == str(_lib.SOVERSION)
    header = (ROOT / "include" / "dflash" / "dflash.h").read_text()
    assert f'#define DFLASH_VERSION_STRING "{libdflash.__version__}"' in header
    pyproject = (ROOT / "pyproject.toml").read_text()
    # The wheel takes its version from meson.build (meson-python), which _version.py repeats.
    assert re.search(r'^dynamic\s*=\s*\["version"\]', pyproject, re.M)
    assert re.search(r'^build-backend\s*=\s*"mesonpy"', pyproject, re.M)


def test_installed_package_is_the_one_imported():
    expect = os.environ.get("DFLASH_EXPECT_PACKAGE_DIR")
    if not expect:
        pytest.skip("set by tests/install_check.sh only")
    assert libdflash.__file__.startswith(expect)
    assert "DFLASH_LIBRARY" not in os.environ


def test_public_api_has_docstrings():
    import ctypes
    import inspect
    missing = []
    for info in pkgutil.iter_modules(libdflash.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"libdflash.{info.name}")
        if not mod.__doc__:
            missing.append(mod.__name__)
        for name, obj in vars(mod).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if not obj.__doc__:
                missing.append(f"{info.name}.{name}")
            if not inspect.isclass(obj) or issubclass(obj, ctypes.Structure):
                continue
            for attr, value in vars(obj).items():
                fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                if not attr.startswith("_") and inspect.isfunction(fn) and not fn.__doc__:
                    missing.append(f"{info.name}.{name}.{attr}")
    assert not missing, f"public names without a docstring: {missing}"
