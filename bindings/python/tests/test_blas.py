"""The BLAS as a Trainer sets it up: one OpenBLAS thread (the trainer's pool splits the products), and the
advice on its kernel set logged once (OPENBLAS_CORETYPE=Prescott forces the
generic set that Debian 12's OpenBLAS falls back to on CPUs it does not know)."""
import ctypes
import os
import subprocess
import sys
import textwrap

import libdflash
from libdflash import _lib
from test_train import make

CHILD = textwrap.dedent("""
    import logging, sys, warnings
    sys.path.insert(0, {tests!r})
    import libdflash
    from test_train import make
    seen = []
    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.levelno, record.getMessage()))
    log = logging.getLogger("blas-test")
    log.addHandler(Keep())
    log.setLevel(logging.WARNING)
    libdflash.log_to_python(log)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make(n_threads=1)
        make(n_threads=1)
    core, advice = libdflash.blas_kernels()
    hits = [m for level, m in seen if level == logging.WARNING and "OPENBLAS_CORETYPE" in m]
    py = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
          and "OPENBLAS_CORETYPE" in str(w.message)]
    print(core, advice, len(hits), len(py), (hits + [""])[0])
""")


def test_blas_kernels_names_the_chosen_set():
    core, advice = libdflash.blas_kernels()
    assert isinstance(core, str) and core
    assert advice in (None, "Haswell", "SkylakeX")


def test_trainer_caps_the_blas_threads():
    # dlsym on libdflash's handle finds the OpenBLAS it links, not numpy's own copy.
    openblas = _lib.lib
    # One OpenBLAS thread whatever n_threads is: the trainer's own pool splits each product
    # (issue 43), and OpenBLAS's threads would spin beside it.
    openblas.openblas_set_num_threads(4)
    make(n_threads=1)
    assert openblas.openblas_get_num_threads() == 1
    openblas.openblas_set_num_threads(4)
    make(n_threads=2)
    assert openblas.openblas_get_num_threads() == 1


def test_generic_kernels_are_reported_once_through_the_log():
    env = dict(os.environ, OPENBLAS_CORETYPE="Prescott")
    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", CHILD.format(tests=tests)], env=env,
                         capture_output=True, text=True, check=True).stdout.split(maxsplit=4)
    core, advice, hits, py = out[0], out[1], int(out[2]), int(out[3])
    assert core.lower() == "prescott"
    if advice == "None":  # a CPU without AVX2: Prescott's kernels are the right ones
        assert hits == 0 and py == 0
    else:  # once through the log callback, once as a Python warning
        assert hits == 1 and py == 1 and f"OPENBLAS_CORETYPE={advice}" in out[4]
