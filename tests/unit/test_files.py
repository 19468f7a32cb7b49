"""services/common/files.py: atomic, durable replacement of a file."""

import os
import stat

import pytest

from rlfleet.services.common import files


def test_writes_bytes_and_text_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "state.json"
    files.write_atomically(path, b"\x00one")
    assert path.read_bytes() == b"\x00one"
    files.write_atomically(str(path), "twó")
    assert path.read_text(encoding="utf-8") == "twó"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    path = tmp_path / "manifest.pb"
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    files.write_atomically(path, b"x")
    assert events == ["fsync file", "rename", "fsync dir"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    path.write_text("old")

    def replace(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="disk on fire"):
        files.write_atomically(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_mode_and_owner_are_exact_whatever_the_umask(tmp_path):
    path = tmp_path / "token"
    files.write_atomically(path, "secret\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the default: nobody else reads it
    old_umask = os.umask(0o077)
    try:
        files.write_atomically(path, b"cert", mode=0o644, owner=(os.getuid(), os.getgid()))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and path.read_bytes() == b"cert"
    assert (path.stat().st_uid, path.stat().st_gid) == (os.getuid(), os.getgid())
