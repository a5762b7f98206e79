"""libdflash.Progress: the library's reporter writing through a callback to Python files,
paths and descriptors."""
import os
import re

import pytest

import libdflash


def test_progress_writes_plain_lines_to_a_file(tmp_path):
    log = tmp_path / "progress.log"
    with libdflash.Progress("tokenize", "samples", total=200, interval=1e-6, stream=log) as p:
        for done in range(0, 201, 50):
            p.update(done, note=f"step {done}")
    lines = log.read_text().splitlines()
    # One line per update (interval ~0) and the final line from finish; none is redrawn.
    assert len(lines) >= 5 and "\r" not in log.read_text()
    assert lines[-1].startswith("tokenize: 200/200 samples (100.0%)")
    assert lines[-1].endswith("step 200")
    assert any(re.match(r"tokenize: 100/200 samples \(50\.0%\)", x) for x in lines)


def test_progress_interval_limits_lines(tmp_path):
    log = tmp_path / "quiet.log"
    with open(log, "w") as f:
        f.write("header\n")
        p = libdflash.Progress("job", "tok", total=0, interval=3600, stream=f)
        for done in range(1000):
            p.update(done)
        p.finish()
        p.update(5000)  # ignored after finish
        p.close()
        f.write("trailer\n")
    lines = log.read_text().splitlines()
    # Nothing was due within the hour: the header, finish's one line, the trailer.
    assert lines[0] == "header" and lines[-1] == "trailer" and len(lines) == 3
    assert lines[1].startswith("job: 999 tok,")


def test_progress_to_a_descriptor(tmp_path):
    r, w = os.pipe()
    try:
        with libdflash.Progress("pipe", "x", total=3, stream=w) as p:
            p.update(3)
        os.close(w)
        w = None
        assert os.read(r, 4096).decode().startswith("pipe: 3/3 x (100.0%)")
    finally:
        os.close(r)
        if w is not None:
            os.close(w)


def test_progress_to_a_binary_file_and_a_bad_path(tmp_path):
    with pytest.raises(OSError):
        libdflash.Progress("x", "y", stream=tmp_path / "no" / "such" / "dir.log")
    with open(tmp_path / "b.log", "wb") as f:
        p = libdflash.Progress("bin", "x", total=2, stream=f)
        p.update(2)
        p.close()
        p.close()  # idempotent
    assert (tmp_path / "b.log").read_bytes().startswith(b"bin: 2/2 x (100.0%)")
