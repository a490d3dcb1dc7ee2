"""The reload's one-launch scatters (`kernels.triton.scatter`): `copy_words_` moves every
copy of its table (rows cut at `ROW_WORDS`, sizes around it, destinations anywhere on
the device) and nothing else; `write_scalars_` writes one float per address, the last
of repeated addresses as given. On CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed (pip install triton)")
from fp8_reload.kernels.triton import scatter  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROW = scatter.ROW_WORDS * 4


@pytest.mark.parametrize("sizes", [[4], [ROW - 4, ROW, ROW + 4], [2 * ROW + 8, 12, 4 * 1000]])
def test_copy_words_moves_each_copy_and_nothing_else(sizes):
    gen = torch.Generator().manual_seed(len(sizes))
    src = torch.randint(0, 256, (sum(sizes) + 64,), dtype=torch.uint8, generator=gen).to(DEVICE)
    dsts = [torch.zeros(n + 8, dtype=torch.uint8, device=DEVICE) for n in sizes]
    copies, at = [], 8  # sources not 16-byte aligned, destinations 4 bytes into their tensor
    for n, d in zip(sizes, dsts):
        copies.append((at, d.data_ptr() + 4, n))
        at += n
    scatter.copy_words_(src, scatter.word_table(copies, DEVICE))
    for (at, _, n), d in zip(copies, dsts):
        assert torch.equal(d[4:4 + n].cpu(), src[at:at + n].cpu())
        assert not d[:4].any() and not d[4 + n:].any()  # nothing around it touched


def test_word_table_refuses_copies_not_of_whole_words():
    dst = torch.zeros(16, dtype=torch.uint8, device=DEVICE)
    for bad in [(2, dst.data_ptr(), 8), (0, dst.data_ptr() + 1, 8), (0, dst.data_ptr(), 6)]:
        with pytest.raises(ValueError, match="whole 32-bit words"):
            scatter.word_table([bad], DEVICE)


def test_an_empty_table_launches_nothing():
    src = torch.zeros(8, dtype=torch.uint8, device=DEVICE)
    scatter.copy_words_(src, scatter.word_table([], DEVICE))


def test_write_scalars_writes_each_address():
    t = torch.zeros(5, dtype=torch.float32, device=DEVICE)
    scatter.write_scalars_([t[0], t[3], t[4]], [1.5, -2.0, 3e38])
    assert t.cpu().tolist() == [1.5, 0.0, 0.0, -2.0, pytest.approx(3e38)]
