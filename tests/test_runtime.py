"""runtime.upload / upload_into: host arrays reach the device whole, in order with the
stream's work, and the array may change as soon as the call returns (the driver staged it)."""
import numpy as np
import pytest
import torch

from conftest import gpu
from flash_reasoning import runtime


def test_upload_copies_strided_arrays_on_cpu():
    array = np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2]
    out = runtime.upload(np.ascontiguousarray(array), torch.device("cpu"))
    assert out.tolist() == array.tolist()


def test_upload_into_fills_a_buffer_of_another_shape_on_cpu():
    buffer = torch.full((5, 1), -1, dtype=torch.long)
    runtime.upload_into(buffer, np.arange(5, dtype=np.int64))
    assert buffer[:, 0].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("into", [False, True])
@gpu
def test_gpu_upload_queued_behind_work_keeps_the_array_as_it_was(into):
    """The copy is queued behind ~50 ms of GPU work and the array is overwritten at once:
    the device must see the values of the call (staged), and the host must not have
    waited for the queued work (no stream sync)."""
    device = torch.device("cuda")
    array = np.arange(2048, dtype=np.int64)  # 16 KB: a decode step's slots or positions
    expected = array.copy()
    buffer = torch.full((array.size,), -1, dtype=torch.long, device=device)
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    torch.cuda._sleep(100_000_000)  # ~50 ms of spinning on the current stream
    out = runtime.upload_into(buffer, array) if into else runtime.upload(array, device)
    done.record()
    queued = not done.query()  # the host returned while the GPU still spins
    array[:] = -7
    torch.cuda.synchronize()
    assert queued
    assert torch.equal(out.cpu(), torch.from_numpy(expected))
