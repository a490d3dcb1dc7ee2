"""The reload's one-launch writes: `copy_rows` (a chunk's tensors from its device buffer
to their places, through a table built once and launched again on every reload) moves
every row of the table, whatever its alignment tier (16-byte vectors, 4-byte words,
bytes), sizes around its block, and nothing else; `scatter.write_scalars_` writes one
float per address. On CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed (pip install triton)")
from fp8_reload.kernels.triton import scatter  # noqa: E402
from fp8_reload.kernels.triton.copy_rows import BLOCK_BYTES, launch_rows_, row_table  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shift", [0, 4, 3], ids=["vectors", "words", "bytes"])
@pytest.mark.parametrize("sizes", [[4], [BLOCK_BYTES - 4, BLOCK_BYTES, BLOCK_BYTES + 4],
                                   [2 * BLOCK_BYTES + 16, 12, 4000]])
def test_a_kept_table_copies_each_row_and_nothing_else(sizes, shift):
    gen = torch.Generator().manual_seed(len(sizes) + shift)
    src = torch.zeros(sum(sizes) + 64 * len(sizes) + 64, dtype=torch.uint8, device=DEVICE)
    dsts = [torch.zeros(n + 32, dtype=torch.uint8, device=DEVICE) for n in sizes]
    at, rows = 16 + shift, []
    for n, d in zip(sizes, dsts):  # sources and destinations `shift` bytes off 16
        rows.append((src.data_ptr() + at, d.data_ptr() + 16 + shift, n))
        at += n + 16
    cols = torch.tensor(rows, dtype=torch.int64)
    table = row_table(cols[:, 0], cols[:, 1], cols[:, 2], DEVICE)
    for _ in range(2):  # the same table, new bytes in the source: as on every reload
        src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8, generator=gen))
        launch_rows_(table, DEVICE)
        for (s, _, n), d in zip(rows, dsts):
            off = s - src.data_ptr()
            assert torch.equal(d[16 + shift:16 + shift + n].cpu(), src[off:off + n].cpu())
            assert not d[:16 + shift].any() and not d[16 + shift + n:].any()  # nothing around it


def test_an_empty_table_launches_nothing():
    none = torch.empty(0, dtype=torch.int64)
    launch_rows_(row_table(none, none, none, DEVICE), DEVICE)


def test_write_scalars_writes_each_address():
    t = torch.zeros(5, dtype=torch.float32, device=DEVICE)
    scatter.write_scalars_([t[0], t[3], t[4]], [1.5, -2.0, 3e38])
    assert t.cpu().tolist() == [1.5, 0.0, 0.0, -2.0, pytest.approx(3e38)]
