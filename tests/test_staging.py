"""The pinned-staging read path returns exactly what the plain read path returns."""

import pytest

import fp8_reload as fr
from fp8_reload.checkpoint.staging import PinnedArena


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_read_into_arena_matches_plain_read(ckpts, kind):
    ckpt = fr.Checkpoint(ckpts[kind, 0])
    arena = PinnedArena()
    names = ckpt.names[::3]
    stats = {}
    staged = dict(ckpt.read(names, stats, into=arena))
    ref = dict(ckpt.read(names))
    assert set(staged) == set(ref)
    for n, t in ref.items():
        assert fr.state.bitwise_equal(staged[n], t), n
        assert staged[n].data_ptr() % 64 == 0
    assert stats["bytes_read"] == sum(ckpt.info(n).nbytes for n in names)
    assert stats["files_opened"] == len({ckpt.weight_map[n] for n in names})
    # the arena is reused: a smaller second read allocates nothing
    buf = arena.buffer
    list(ckpt.read(names[:5], into=arena))
    assert arena.buffer is buf


def test_truncated_file_is_a_checkpoint_error(ckpts, tmp_path):
    from .conftest import copy_checkpoint

    path = copy_checkpoint(ckpts["fp8", 0], tmp_path / "t")
    ckpt = fr.Checkpoint(path)
    last = max(ckpt.names, key=lambda n: (ckpt.weight_map[n], ckpt.info(n).offset))
    f = path / ckpt.weight_map[last]
    f.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(fr.CheckpointError, match="truncated"):
        list(ckpt.read([last], into=PinnedArena()))
