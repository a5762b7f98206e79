"""Which library the package loads (libdflash/_lib.py): the one inside the package (lib/,
where `pip install` puts it) first, then $DFLASH_LIBRARY, and only a library whose version
equals the package's. Each case imports a copy of the package's .py files in a fresh
interpreter, with the library the running package loaded (a real libdflash) placed or named."""
import os
import pathlib
import shutil
import subprocess
import sys

import libdflash
from libdflash import _lib

REAL = os.path.realpath(_lib.lib._name)  # the library this test process runs on
PRINT = ("import libdflash, os; from libdflash import _lib; "
         "print(os.path.realpath(_lib.lib._name))")


def package_copy(tmp_path, bundled=False, version=None):
    """tmp_path/pkg/libdflash: the package's .py files; lib/libdflash.so.1 a copy of REAL
    when `bundled`; _version.py saying `version` when given."""
    src = pathlib.Path(libdflash.__file__).parent
    dst = tmp_path / "pkg" / "libdflash"
    dst.mkdir(parents=True)
    for f in src.glob("*.py"):
        shutil.copy(f, dst / f.name)
    if bundled:
        (dst / "lib").mkdir()
        shutil.copy(REAL, dst / "lib" / f"libdflash.so.{_lib.SOVERSION}")
    if version:
        v = dst / "_version.py"
        v.write_text(v.read_text().replace(f'"{libdflash.__version__}"', f'"{version}"'))
    return dst


def run_import(tmp_path, library_env):
    env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_LIBRARY", "PYTHONPATH")}
    env["PYTHONPATH"] = str(tmp_path / "pkg")
    if library_env is not None:
        env["DFLASH_LIBRARY"] = library_env
    return subprocess.run([sys.executable, "-c", PRINT], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)


def test_the_library_inside_the_package_comes_before_dflash_library(tmp_path):
    pkg = package_copy(tmp_path, bundled=True)
    r = run_import(tmp_path, str(tmp_path / "nonexistent" / "libdflash.so"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(pkg / "lib" / "libdflash.so.1")


def test_dflash_library_when_the_package_holds_none(tmp_path):
    package_copy(tmp_path)
    r = run_import(tmp_path, REAL)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == REAL


def test_dflash_library_is_the_last_word_when_set(tmp_path):
    # A wrong DFLASH_LIBRARY fails naming it; no system library is tried behind it.
    package_copy(tmp_path)
    missing = str(tmp_path / "nonexistent" / "libdflash.so")
    r = run_import(tmp_path, missing)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and f"tried {missing}: " in r.stderr, r.stderr
    assert r.stderr.count("\n  tried ") == 1, r.stderr


def test_a_library_of_another_version_is_refused_naming_both(tmp_path):
    package_copy(tmp_path, bundled=True, version="0.0.9")
    r = run_import(tmp_path, REAL)
    assert r.returncode != 0
    err = r.stderr
    assert "the Python package libdflash 0.0.9 needs the library libdflash 0.0.9" in err, err
    lib_version = libdflash.version()
    assert f"lib/libdflash.so.1: libdflash {lib_version}" in err, err
    assert f"tried {REAL}: libdflash {lib_version}" in err, err
