"""colibri.core.atomic: a file is replaced whole or not at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from colibri.core.atomic import atomic_write, partial_path, write_json


def test_replaces_whole_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "state.json"
    write_json(path, {"turn": 1})
    write_json(path, {"turn": 2})
    assert json.loads(path.read_text()) == {"turn": 2}
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failure_mid_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write(b"half of the new")
            assert partial_path(path).exists()
            raise RuntimeError("disk pulled")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["blob"]


def test_a_killed_writer_leaves_the_old_file_and_only_a_partial(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"old")
    code = ("import os, sys; from colibri.core.atomic import atomic_write\n"
            "with atomic_write(sys.argv[1]) as f:\n"
            "    f.write(b'half'); f.flush(); os.kill(os.getpid(), 9)\n")
    p = subprocess.run([sys.executable, "-c", code, str(path)])
    assert p.returncode == -9
    assert path.read_bytes() == b"old"
    left = [n for n in os.listdir(tmp_path) if n != "blob"]
    assert len(left) == 1 and left[0].startswith("blob.partial-")  # never read as the file itself


def test_permission_bits(tmp_path):
    path = tmp_path / "private"
    with atomic_write(path, perms=0o600) as f:
        f.write(b"x")
    assert path.stat().st_mode & 0o777 == 0o600
