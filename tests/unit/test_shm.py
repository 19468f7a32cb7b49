"""Shared-memory segments: layout, validation of paths from requests, and crash cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from rlfleet.wire import shm


def test_write_then_open_elsewhere_sees_the_same_bytes(tmp_path):
    tensors = [torch.randn(3, 4), torch.arange(5, dtype=torch.int16), torch.randn(7).to(torch.bfloat16)]
    size = sum(t.numel() * t.element_size() for t in tensors)
    with shm.create_segment(size, directory=str(tmp_path)) as segment:
        shm.write_tensors(segment, tensors)
        reader = shm.open_segment(segment.path, size, directory=str(tmp_path))
        flat = reader.as_uint8()
        offsets = shm.tensor_offsets([t.numel() * t.element_size() for t in tensors])
        for tensor, offset in zip(tensors, offsets):
            assert torch.equal(shm.view_tensor(flat, offset, tensor.dtype, tensor.shape), tensor)
        del flat
        reader.close()
        assert os.path.exists(segment.path)  # a reader never unlinks
    assert not os.path.exists(segment.path)  # the creator does


def test_write_tensors_refuses_more_bytes_than_the_segment_holds(tmp_path):
    with shm.create_segment(8, directory=str(tmp_path)) as segment:
        with pytest.raises(ValueError, match="more than the segment's 8 bytes"):
            shm.write_tensors(segment, [torch.ones(1), torch.ones(2)])
        with pytest.raises(ValueError, match="tensors hold 4 bytes, the segment 8"):
            shm.write_tensors(segment, [torch.ones(1)])
        shm.write_tensors(segment, [torch.ones(1), torch.empty(0), torch.full((1,), 2.0)])
        assert segment.as_uint8().view(torch.float32).tolist() == [1.0, 2.0]


def test_paths_from_requests_are_confined_to_segments(tmp_path):
    for bad in ["/etc/passwd", f"{tmp_path}/../rlfleet-w-{'0' * 32}", f"{tmp_path}/rlfleet-w-xyz",
                f"rlfleet-w-{'0' * 32}"]:
        with pytest.raises(ValueError, match="not an rlfleet shm segment path"):
            shm.open_segment(bad, 1, directory=str(tmp_path))
    (tmp_path / "sub").mkdir()
    elsewhere = tmp_path / "sub" / f"rlfleet-w-{'0' * 32}"
    elsewhere.write_bytes(b"x")  # a segment's name, but not in our shm directory: never opened
    with pytest.raises(shm.SegmentUnavailable, match="not in this host's shm directory"):
        shm.open_segment(str(elsewhere), 1, directory=str(tmp_path))
    with pytest.raises(shm.SegmentUnavailable):
        shm.open_segment(f"{tmp_path}/rlfleet-w-{'a' * 32}", 1, directory=str(tmp_path))


def test_size_mismatch_is_unavailable(tmp_path):
    with shm.create_segment(16, directory=str(tmp_path)) as segment:
        with pytest.raises(shm.SegmentUnavailable, match="holds 16 bytes"):
            shm.open_segment(segment.path, 32, directory=str(tmp_path))


def test_sweep_removes_only_segments_of_dead_holders(tmp_path):
    held = shm.create_segment(8, directory=str(tmp_path))
    # A process that creates a segment and dies without cleaning up (SIGKILL-like: os._exit).
    code = ("import os, sys; from rlfleet.wire import shm; "
            f"s = shm.create_segment(8, directory={str(tmp_path)!r}); print(s.path, flush=True); os._exit(0)")
    orphan = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert os.path.exists(orphan)
    assert shm.sweep_stale(str(tmp_path)) == []  # too young: its creator may not hold the lock yet
    old = time.time() - 60
    for path in (orphan, held.path):
        os.utime(path, (old, old))
    assert shm.sweep_stale(str(tmp_path)) == [orphan]
    assert os.path.exists(held.path)  # still held by this process
    held.close()
    assert shm.list_segments(str(tmp_path)) == []


def test_a_held_directory_goes_with_its_process_however_it_ends(tmp_path):
    """A replica's LoRA adapters directory (``HeldDirectory``): removed by ``close``; a SIGKILLed holder's
    by the next sweep once it is old enough; a live holder's kept."""
    code = ("import os, sys; from rlfleet.wire import shm; "
            f"d = shm.HeldDirectory('rlfleet-lora-', directory={str(tmp_path)!r}); "
            "open(os.path.join(d.path, 'adapter.bin'), 'w').write('x'); print(d.path, flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        orphan = holder.stdout.readline().strip()
        mine = shm.HeldDirectory("rlfleet-lora-", directory=str(tmp_path))
        assert shm.sweep_stale(str(tmp_path), min_age_seconds=0) == []  # both held
        holder.kill()  # SIGKILL: no close
        holder.wait()
        assert shm.sweep_stale(str(tmp_path)) == []  # too young
        assert shm.sweep_stale(str(tmp_path), min_age_seconds=0) == [orphan]
        assert not os.path.exists(orphan) and os.path.isdir(mine.path)
        mine.close()
        assert os.listdir(tmp_path) == []
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_reaches_its_segment_through_its_descriptor_once_unlinked(tmp_path):
    """The generation service hands its worker ``fd_path``: a trainer that unlinks the name
    (a cut push) between stage and commit cannot pull the bytes from under the apply."""
    with shm.create_segment(8, directory=str(tmp_path)) as writer:
        shm.write_tensors(writer, [torch.arange(2, dtype=torch.int32)])
        holder = shm.open_segment(writer.path, 8, directory=str(tmp_path))
    assert not os.path.exists(writer.path)
    reader = shm.open_segment(holder.fd_path, 8, trusted=True)
    assert torch.equal(shm.view_tensor(reader.as_uint8(), 0, torch.int32, (2,)), torch.arange(2, dtype=torch.int32))
    with pytest.raises(ValueError):
        shm.open_segment(holder.fd_path, 8)  # never from a request
    reader.close()
    holder.close()


def test_a_kept_segment_is_rewritten_only_once_no_reader_holds_it(tmp_path):
    cache = shm.SegmentCache(directory=str(tmp_path))
    first = cache.take(16)
    cache.keep(first)
    assert cache.take(16) is first  # nobody else holds it: the same pages again
    reader = shm.open_segment(first.path, 16, directory=str(tmp_path))
    cache.keep(first)
    second = cache.take(16)  # a reader still maps it: a new segment, the old name unlinked
    assert second is not first and not os.path.exists(first.path) and os.path.exists(second.path)
    reader.close()
    cache.keep(second)
    os.unlink(second.path)  # e.g. a sweep that slipped in while the lock was being converted
    third = cache.take(16)
    assert third is not second and os.path.exists(third.path)
    cache.keep(third)
    fourth = cache.take(32)  # another size: a new one
    assert fourth is not third and not os.path.exists(third.path)
    cache.keep(fourth)
    cache.close()
    assert shm.list_segments(str(tmp_path)) == []
