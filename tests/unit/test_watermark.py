"""The watermark a streamed apply's worker follows (``services/common/watermark.py``) and the segment reader
that waits on it (``transfer.shm_weights``)."""

from __future__ import annotations

import threading

import torch

from rlfleet.services.generation.transfer import RlfleetUpdateInfo, shm_weights
from rlfleet.services.common.watermark import Watermark
from rlfleet.wire import shm
from tests.waiting import wait_for


def test_a_worker_reads_each_tensor_once_its_bytes_arrived_and_stops_where_a_cut_push_ended():
    tensors = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(4, dtype=torch.int64),
               "c": torch.full((2, 3), 7.0)}
    update = RlfleetUpdateInfo(names=list(tensors), dtype_names=["float32", "int64", "float32"],
                               shapes=[list(t.shape) for t in tensors.values()])
    segment = shm.create_segment(sum(t.numel() * t.element_size() for t in tensors.values()))
    writer = Watermark.create()
    reader = Watermark.open(writer.path)
    try:
        shm.write_tensors(segment, list(tensors.values()))
        writer.advance(24)  # a's bytes, not b's
        loaded = []

        def load():
            for name, tensor in shm_weights(segment.as_uint8(), update, None, arrived=reader.wait_for):
                loaded.append((name, tensor.clone()))
        worker = threading.Thread(target=load)
        worker.start()
        wait_for(lambda: writer.loaded == 24, 60, "the reader to wait for b")  # what it loaded before b
        assert worker.is_alive() and [name for name, _ in loaded] == ["a"]
        writer.advance(56)  # b's bytes too
        wait_for(lambda: writer.loaded == 56, 60, "the reader to wait for c")
        assert worker.is_alive() and [name for name, _ in loaded] == ["a", "b"]
        writer.cut_off()  # c never comes: the reader stops there
        worker.join(5)
        assert not worker.is_alive()
        assert [name for name, _ in loaded] == ["a", "b"]
        assert torch.equal(loaded[0][1], tensors["a"]) and torch.equal(loaded[1][1], tensors["b"])
    finally:
        reader.close()
        writer.close()
        segment.close()


def test_a_cut_after_every_byte_arrived_still_reads_them_all_and_a_closed_watermark_reads_zero():
    writer = Watermark.create()
    writer.advance(100)
    writer.cut_off()
    assert writer.wait_for(0, 100) and not writer.wait_for(0, 101)
    writer.close()
    assert writer.arrived == writer.loaded == 0 and not writer.cut  # read by the metrics thread after the end
