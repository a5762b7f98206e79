"""The second pinned environment (.venv-ref: z-lab's dflash 0.1.0, transformers 5,
speculators 0.9.0, made by scripts/deps.sh from scripts/requirements-ref.txt) for
the oracles that need it: a script calls reexec_in_ref_env(__file__) before it
imports torch or transformers, and so runs under that interpreter or skips."""
import os
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
REF_ENV = "DFLASH_REF_PYTHON"


def ref_python():
    """DFLASH_REF_PYTHON, else DFLASH_REF_VENV's (default .venv-ref) bin/python."""
    explicit = os.environ.get(REF_ENV)
    if explicit:
        return explicit
    venv = os.environ.get("DFLASH_REF_VENV") or os.path.join(ROOT, ".venv-ref")
    return os.path.join(venv, "bin", "python")


def reexec_in_ref_env(script):
    """Re-run `script` (with this process's arguments) under the reference
    interpreter, unless already there; exit 77 (meson's skip) when it is absent."""
    if os.environ.get("DFLASH_REF_ACTIVE") == "1":
        return
    py = ref_python()
    if not os.path.exists(py):
        print(f"skip: the reference environment is absent ({py} does not exist); "
              f"scripts/deps.sh creates it from scripts/requirements-ref.txt (z-lab's dflash "
              f"0.1.0, transformers 5, speculators 0.9.0), or set {REF_ENV} to its python")
        sys.exit(77)
    os.environ["DFLASH_REF_ACTIVE"] = "1"
    sys.stdout.flush()
    os.execv(py, [py, os.path.abspath(script)] + sys.argv[1:])
