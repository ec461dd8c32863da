"""The L2 prefetch (prr.kernels.l2_prefetch) reads every byte of its tensor exactly once: the
checksum each program stores equals the XOR of its 32-bit words, at sizes that leave a partial
last chunk; bad input is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prr.kernels.l2_prefetch import CHUNK, l2_prefetch, prefetch_sink


@pytest.mark.parametrize("shape,dtype", [((3, 5000), torch.bfloat16), ((2 * CHUNK + 7,), torch.float32),
                                          ((10, 6), torch.float16)])
def test_prefetch_checksums_every_word(shape, dtype):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    sink = prefetch_sink(t)
    l2_prefetch(t, sink)
    words = t.view(-1).view(torch.int32).numpy()
    padded = np.zeros(len(sink) * CHUNK, dtype=np.int32)
    padded[: len(words)] = words
    want = np.bitwise_xor.reduce(padded.reshape(len(sink), CHUNK), axis=1)
    assert np.array_equal(sink.numpy(), want)


def test_prefetch_refuses_bad_input():
    t = torch.randn(8, 8)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(t.t(), prefetch_sink(t))
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        prefetch_sink(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="sink must be int32"):
        l2_prefetch(t, torch.zeros(5, dtype=torch.int32))
