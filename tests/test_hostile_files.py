"""Files that are not what they claim, and files that change under the reader.

* special files (FIFO, socket, character/block device, directory; directly or
  through a symlink) as config.json, the index, a shard or the single-file
  checkpoint: refused with `UnreadableCheckpointError` without blocking, and
  the reload lock is free afterwards. Every call runs in a thread with a
  timeout, and any FIFO left behind is opened for writing at teardown, so a
  regression fails the test instead of hanging CI;
* a file swapped for a FIFO between the check and the open;
* OS errors (a parent directory that cannot be entered, an unreadable file, a
  symlink loop, a path that cannot exist) map to the same class on every entry
  point: `Checkpoint`, `load_model`, `update_weights_from_disk`;
* index entries in a subfolder: the header and the bytes come from the file the
  index names, never from a leftover of the same name elsewhere;
* the parsed-checkpoint cache and racing writers: an index replaced while it was
  parsed, a rewrite the file stamps cannot see, a shard replaced or truncated
  between planning and reading.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp8_reload as fr
import fp8_reload.checkpoint.files as files_mod
import fp8_reload.reload.transaction as transaction_mod
from fp8_reload.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint

from . import bad_checkpoints as bad
from .conftest import WAIT, copy_checkpoint, mix_checkpoints, rewrite_tensor, unchanged
from .threads import start as start_thread


def in_thread(fn, *args, timeout: float = WAIT):
    """Run fn(*args) in a daemon thread: ("ok", value), ("error", exception) or
    ("hung", None) if it did not return within `timeout`."""
    t, out = start_thread(fn, *args)
    t.join(timeout)
    if t.is_alive():
        return "hung", None
    return ("error", out["error"]) if "error" in out else ("ok", out["value"])


@pytest.fixture
def fifos():
    """Paths of FIFOs a test creates; at teardown each is opened for writing
    (non-blocking), which releases a reader stuck in open() if there is one."""
    made: list[Path] = []
    yield made
    for p in made:
        try:
            fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:  # no reader waiting (ENXIO), or gone
            pass


def _block_device(path: Path) -> bool:
    """A block device node at `path`: made with mknod, else a symlink to one in /dev."""
    try:
        os.mknod(path, 0o600 | stat.S_IFBLK, os.makedev(7, 0))
        return True
    except OSError:
        pass
    for d in sorted(Path("/dev").iterdir()):
        try:
            if stat.S_ISBLK(d.stat().st_mode):
                os.symlink(d, path)
                return True
        except OSError:
            continue
    return False


SPECIAL = ["fifo", "symlink-to-fifo", "socket", "char-device", "block-device", "directory",
           "dangling-symlink-then-fifo"]
ROLES = ["config", "index", "shard", "single-file"]


def _place(kind: str, target: Path, work: Path, fifos: list) -> None:
    if kind == "fifo":
        os.mkfifo(target)
        fifos.append(target)
    elif kind == "symlink-to-fifo":
        bad.make_symlink_to_fifo(target, work)
        fifos.append(work / "pipe")
    elif kind == "socket":
        bad.make_socket(target, work)
    elif kind == "char-device":
        bad.make_dev_zero(target, work)
    elif kind == "block-device":
        if not _block_device(target):
            pytest.skip("no block device can be made or found here")
    elif kind == "directory":
        target.mkdir()
    elif kind == "dangling-symlink-then-fifo":  # a symlink chain ending in a FIFO
        os.mkfifo(work / "pipe2")
        fifos.append(work / "pipe2")
        os.symlink(work / "pipe2", work / "link1")
        os.symlink(work / "link1", target)


@pytest.fixture(scope="module")
def model_fp8(ckpts):
    return fr.load_model(ckpts["fp8", 0])


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("kind", SPECIAL)
def test_special_files_are_refused_without_blocking(ckpts, model_fp8, tmp_path, fifos, kind, role):
    good = ckpts["fp8", 1]
    if role == "single-file":
        path = tmp_path / "single"
        path.mkdir()
        shutil.copy(good / "config.json", path / "config.json")
        target = path / SINGLE_FILE
    else:
        path = copy_checkpoint(good, tmp_path / "ckpt")
        target = {"config": path / "config.json", "index": path / INDEX_FILE}.get(role) \
            or bad.shard_of(path, bad.WEIGHT)
        target.unlink()
    _place(kind, target, tmp_path, fifos)
    model = model_fp8
    before = fr.snapshot(model)

    for call in (lambda: fr.update_weights_from_disk(model, path), lambda: fr.load_model(path),
                 lambda: Checkpoint(path).total_bytes()):
        outcome, err = in_thread(call)
        assert outcome == "error", f"{kind} as {role}: {outcome}"
        assert type(err) is fr.UnreadableCheckpointError, f"{type(err).__name__}: {err}"
        assert str(target) in str(err) and "not a regular file" in str(err), err
    assert unchanged(model, before) == []

    # The refused reload released the model's reload lock: the next one goes through.
    outcome, report = in_thread(fr.update_weights_from_disk, model, ckpts["fp8", 0])
    assert outcome == "ok", (outcome, report)
    assert unchanged(model, before) == []


def test_a_file_swapped_for_a_fifo_after_the_check_cannot_block(ckpts, tmp_path, fifos, monkeypatch):
    """The race: the path is a regular file when it is checked and a FIFO when it is
    opened. O_NONBLOCK makes that open return at once; fstat of the descriptor refuses it."""
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "ckpt")
    shard = bad.shard_of(path, bad.WEIGHT)
    real_stat = files_mod.stat_path
    swapped = []

    def stat_then_swap(p):
        st = real_stat(p)
        if Path(p) == shard and not swapped:
            shard.unlink()
            os.mkfifo(shard)
            fifos.append(shard)
            swapped.append(p)
        return st

    monkeypatch.setattr(files_mod, "stat_path", stat_then_swap)
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    outcome, err = in_thread(fr.update_weights_from_disk, model, path)
    assert swapped, "the swap never happened: the test proves nothing"
    assert outcome == "error" and type(err) is fr.UnreadableCheckpointError, (outcome, err)
    assert "FIFO" in str(err) and str(shard) in str(err)
    assert unchanged(model, before) == []


def test_a_huge_config_is_refused_before_it_is_read(ckpts, tmp_path):
    """A config.json of 200 MB (sparse: no disk used) is refused by its size, unread."""
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "ckpt")
    os.truncate(path / "config.json", 200_000_000)
    outcome, err = in_thread(Checkpoint, path, timeout=WAIT)
    assert outcome == "error" and type(err) is fr.CorruptCheckpointError, (outcome, err)
    assert "too large: 200000000 bytes" in str(err) and str(path / "config.json") in str(err)


# ==========================================================================
# OS errors: one class per cause, on every entry point
# ==========================================================================

class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _drop_file_permission_override() -> None:
    """Make mode bits apply to this thread even as root: clear CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH from its effective set (capabilities are per thread on Linux;
    the rest of the process keeps them). Nothing to do for a non-root user."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[0].effective &= ~((1 << 1) | (1 << 2))
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def test_os_errors_map_to_the_same_class_on_every_entry_point(ckpts, tmp_path):
    """Real permission errors: the calls run in a thread for which mode bits apply (as
    root, with its file-permission override dropped for that thread only)."""
    locked = tmp_path / "locked"
    copy_checkpoint(ckpts["fp8", 1], locked / "ckpt")
    noread = copy_checkpoint(ckpts["fp8", 1], tmp_path / "noread")
    os.chmod(noread / "config.json", 0o000)
    loop = copy_checkpoint(ckpts["fp8", 1], tmp_path / "loop")
    (loop / "config.json").unlink()
    os.symlink(loop / "config.json", loop / "config.json")
    (tmp_path / "plainfile").write_text("x")
    cases = {"parent-locked": (locked / "ckpt", "UnreadableCheckpointError", "Permission denied"),
             "config-unreadable": (noread, "UnreadableCheckpointError", "Permission denied"),
             "symlink-loop": (loop, "UnreadableCheckpointError", "symbolic links"),
             "missing": (tmp_path / "absent", "CheckpointNotFoundError", "does not exist"),
             "under-a-file": (tmp_path / "plainfile" / "ckpt", "CheckpointNotFoundError",
                              "does not exist")}
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    os.chmod(locked, 0o000)  # the parent cannot be entered

    def attempt():
        _drop_file_permission_override()
        try:
            os.stat(locked / "ckpt")
            return "mode bits do not apply to this thread"
        except PermissionError:
            pass
        out = {}
        for name, (path, _, _) in cases.items():
            for entry, call in (("Checkpoint", Checkpoint), ("load_model", fr.load_model),
                                ("update", lambda p: fr.update_weights_from_disk(model, p))):
                try:
                    call(path)
                    out[name, entry] = ("no error", "")
                except Exception as e:
                    out[name, entry] = (type(e).__name__, str(e))
        return out

    try:
        outcome, out = in_thread(attempt, timeout=60)
    finally:
        os.chmod(locked, 0o755)
    assert outcome == "ok", (outcome, out)
    if isinstance(out, str):
        pytest.skip(out)
    for name, (path, cls, words) in cases.items():
        for entry in ("Checkpoint", "load_model", "update"):
            got, msg = out[name, entry]
            assert (got, words in msg, str(path) in msg) == (cls, True, True), \
                f"{name}/{entry}: {got}: {msg}"
    assert unchanged(model, before) == []


@pytest.mark.parametrize("path", ["with\x00nul", "lone-\ud800-surrogate"], ids=["nul", "surrogate"])
def test_a_path_that_cannot_exist_is_not_found(ckpts, path):
    model = fr.load_model(ckpts["fp8", 0])
    for call in (lambda: Checkpoint(path), lambda: fr.load_model(path),
                 lambda: fr.update_weights_from_disk(model, path)):
        with pytest.raises(fr.CheckpointNotFoundError):
            call()


def test_an_index_file_name_the_os_cannot_take_is_corrupt(ckpts, tmp_path):
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "ckpt")
    raw = json.dumps({"weight_map": {**bad.weight_map(path), bad.WEIGHT: "model-\ud800.safetensors"}})
    (path / INDEX_FILE).write_text(raw, encoding="utf-8", errors="surrogatepass")
    with pytest.raises(fr.CorruptCheckpointError, match="is not a file name"):
        Checkpoint(path)


# ==========================================================================
# Index entries in a subfolder
# ==========================================================================

def _into_subfolder(path: Path, shard: str, sub: str = "sub") -> None:
    (path / sub).mkdir(exist_ok=True)
    bad.write_index(path, {n: f"{sub}/{f}" if f == shard else f for n, f in bad.weight_map(path).items()})


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_a_subfolder_entry_is_read_from_that_file_never_from_a_leftover(ckpts, tmp_path, kind):
    """sub/<shard> holds seed-1 data, <shard> (a leftover at the top) seed-0 data: the
    reload takes every byte of those tensors from sub/<shard>, header and data alike."""
    path = copy_checkpoint(ckpts[kind, 0], tmp_path / "ckpt")
    wm = bad.weight_map(path)
    shard = wm[bad.WEIGHT]
    _into_subfolder(path, shard)
    shutil.copy(ckpts[kind, 1] / shard, path / "sub" / shard)
    expected = mix_checkpoints(ckpts[kind, 0], ckpts[kind, 1], tmp_path / "mixed",
                               lambda n: wm[n] == shard)
    model = fr.load_model(ckpts[kind, 0])
    fr.update_weights_from_disk(model, path)
    want = fr.snapshot(fr.load_model(expected))
    assert fr.compare_states(want, fr.snapshot(model)) == []
    assert fr.compare_states(want, fr.snapshot(fr.load_model(path))) == []
    # and its infos name the file the index names
    ckpt = Checkpoint(path)
    assert ckpt.info(bad.WEIGHT).file == f"sub/{shard}"


def test_a_subfolder_entry_that_is_missing_names_the_index_entry(ckpts, tmp_path):
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "ckpt")
    shard = bad.weight_map(path)[bad.WEIGHT]
    _into_subfolder(path, shard)  # sub/ exists but holds nothing; <shard> is still at the top
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    with pytest.raises(fr.CheckpointNotFoundError) as info:
        fr.update_weights_from_disk(model, path)
    assert f"sub/{shard}" in str(info.value) and "does not exist" in str(info.value)
    assert unchanged(model, before) == []


# ==========================================================================
# The parsed-checkpoint cache, and writers racing the reader
# ==========================================================================

def cached(model, path):
    """The parsed checkpoint a model keeps for `path` (`reload.plan.open_checkpoint`)."""
    return model._checkpoint_cache[os.path.realpath(path)][1]


def swap_before_open(monkeypatch, path: Path, n: int, action) -> list:
    """Run `action()` just before the `n`-th time `path` is opened for reading (1: its
    header is parsed while planning; 2: its bytes are read, by either engine)."""
    real = files_mod.open_regular
    opens = []

    def open_regular(p):
        if Path(p) == path:
            opens.append(p)
            if len(opens) == n:
                action()
        return real(p)

    monkeypatch.setattr(files_mod, "open_regular", open_regular)
    return opens


def _renamed_copy(src: Path, dst: Path, prefix: str) -> None:
    """A checkpoint at `dst` whose shards are called `<prefix>-0000k...` (same length as
    `model`), so indexes pointing at different shard sets have the same size."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    wm = bad.weight_map(src)
    for f in sorted(set(wm.values())):
        shutil.copy(src / f, dst / f.replace("model", prefix))
    bad.write_index(dst, {n: f.replace("model", prefix) for n, f in wm.items()})


@pytest.fixture
def two_indexes(ckpts, tmp_path):
    """One directory holding seed-0 shards named aaaaa-* and seed-1 shards named bbbbb-*;
    its index points at aaaaa-*. Returns (path, index text for aaaaa, index text for bbbbb)."""
    path = tmp_path / "ckpt"
    _renamed_copy(ckpts["fp8", 0], path, "aaaaa")
    _renamed_copy(ckpts["fp8", 1], tmp_path / "b", "bbbbb")
    for f in (tmp_path / "b").iterdir():
        if f.name.startswith("bbbbb"):
            shutil.move(str(f), path / f.name)
    a = (path / INDEX_FILE).read_text()
    b = (tmp_path / "b" / INDEX_FILE).read_text()
    assert len(a) == len(b)
    return path, a, b


def test_an_index_replaced_while_it_is_parsed_is_not_cached_stale(ckpts, two_indexes, monkeypatch):
    """The old order (parse, then stamp) left the stamp of the new index over the parse
    of the old one. Now the stamp is taken on the file that was read, before reading."""
    path, _, b = two_indexes
    model = fr.load_model(ckpts["fp8", 0])
    real = Checkpoint._weight_map
    replaced = []

    def parse_then_replace(self):
        out = real(self)
        if not replaced:  # a writer renames a new index into place right after our read
            tmp = path / "new-index.tmp"
            tmp.write_text(b)
            os.replace(tmp, path / INDEX_FILE)
            replaced.append(True)
        return out

    monkeypatch.setattr(Checkpoint, "_weight_map", parse_then_replace)
    fr.update_weights_from_disk(model, path)  # parsed the old index: seed 0, consistent
    monkeypatch.undo()
    assert replaced
    fr.update_weights_from_disk(model, path)  # must see the new index: seed 1
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model)) == []


def test_a_rewrite_the_stamps_cannot_see_is_still_noticed(ckpts, two_indexes, monkeypatch):
    """A file rewritten in place within one timestamp tick at the same size keeps its
    stamp. Simulated by a stamp that never changes: the cache compares the parsed bytes
    too, so the new index is used."""
    path, _, b = two_indexes
    tick = time.time_ns()  # every file's times frozen at one fresh tick
    monkeypatch.setattr(files_mod, "stamp", lambda st: (st.st_dev, st.st_ino, st.st_size, tick, tick))
    # and fresh however long the test takes: a tick that aged past SETTLED_NS (a slow
    # load on a busy machine) would be taken for a settled file, whose stamp must move
    monkeypatch.setattr(files_mod, "SETTLED_NS", 10**18)
    model = fr.load_model(ckpts["fp8", 0])
    flt = fr.generate_weight_name_filter({1: [2]})
    fr.update_weights_from_disk(model, path, flt)
    first = cached(model, path)
    with open(path / INDEX_FILE, "r+") as f:  # same inode, same size
        f.write(b)
    fr.update_weights_from_disk(model, path)
    assert cached(model, path) is not first
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model)) == []


def test_a_bad_value_written_where_the_stamps_cannot_see_is_still_refused(ckpts, tmp_path, monkeypatch,
                                                                          engine):
    """A shard rewritten in place within one timestamp tick at the same size keeps its
    stamp, and here its header too (the same tensors, one value changed). Simulated by a
    stamp that never changes, for files still fresh however long the test takes. Values
    checked by an earlier reload are not taken as checked for such a file: a NaN written
    this way is refused and the model is unchanged."""
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "c")
    tick = time.time_ns()
    monkeypatch.setattr(files_mod, "stamp", lambda st: (st.st_dev, st.st_ino, st.st_size, tick, tick))
    monkeypatch.setattr(files_mod, "SETTLED_NS", 10**18)
    model = fr.load_model(ckpts["fp8", 0])
    flt = fr.generate_weight_name_filter({1: [2]})
    fr.update_weights_from_disk(model, path, flt)  # parsed, values checked
    first = cached(model, path)
    fr.update_weights_from_disk(model, ckpts["fp8", 0], flt)
    before = fr.snapshot(model)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    other = copy_checkpoint(path, tmp_path / "other")
    rewrite_tensor(other, name, lambda t: t.view(torch.uint8).clone().fill_(0x7F).view(t.dtype))  # NaN
    shard = fr.Checkpoint(path).weight_map[name]
    with open(path / shard, "r+b") as f:  # same inode, same size, same header
        f.write((other / shard).read_bytes())
    with pytest.raises(fr.InvalidTensorError, match=name):
        fr.update_weights_from_disk(model, path, flt)
    assert cached(model, path) is first  # the same parse: the stamps and header did not move
    assert unchanged(model, before) == []


def test_a_checkpoint_at_rest_is_checked_by_stamps_alone(ckpts, two_indexes, monkeypatch):
    """Files last changed well before they were read cannot be rewritten without their
    stamp moving: reusing the parse then costs a stat per file, no read. A rewrite of
    such a file is still seen (here: in place, same size, same inode). The settling time
    is cut to 0 so the test need not wait; mtimes an hour back make the rewrite's new
    mtime differ for sure."""
    path, _, b = two_indexes
    monkeypatch.setattr(files_mod, "SETTLED_NS", 0)
    old = time.time() - 3600
    for f in path.iterdir():
        os.utime(f, (old, old))
    model = fr.load_model(ckpts["fp8", 0])
    fr.update_weights_from_disk(model, path)
    first = cached(model, path)
    reads = []
    real_read, real_open = files_mod.read_small, files_mod.open_regular
    monkeypatch.setattr(files_mod, "read_small", lambda *a: reads.append(a) or real_read(*a))
    assert first.unchanged() and reads == []
    monkeypatch.setattr(files_mod, "open_regular", lambda p: reads.append(p) or real_open(p))
    assert first.unchanged() and reads == []
    monkeypatch.setattr(files_mod, "read_small", real_read)
    monkeypatch.setattr(files_mod, "open_regular", real_open)
    with open(path / INDEX_FILE, "r+") as f:
        f.write(b)
    fr.update_weights_from_disk(model, path)
    assert cached(model, path) is not first
    assert fr.compare_states(fr.snapshot(fr.load_model(ckpts["fp8", 1])), fr.snapshot(model)) == []


def test_a_shard_replaced_between_planning_and_reading_is_refused(ckpts, tmp_path, monkeypatch, engine):
    """Offsets come from the header parsed while planning; the bytes are read from the
    file the path names when it is opened. Another file there (here: the same tensors
    saved again with other metadata, so its header differs) is refused rather than read
    at the parsed offsets; the next reload parses and reads the new file."""
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "ckpt")
    shard = bad.shard_of(path, bad.WEIGHT)
    other = tmp_path / "other.safetensors"
    save_file(load_file(str(shard)), str(other), metadata={"format": "pt", "rewritten": "yes"})
    # a writer renames a complete new shard into place after planning
    opens = swap_before_open(monkeypatch, shard, 2, lambda: os.replace(other, shard))
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    flt = fr.generate_weight_name_filter({2: [5]})
    with pytest.raises(fr.CorruptCheckpointError, match="changed after its header was read"):
        fr.update_weights_from_disk(model, path, flt)
    assert len(opens) >= 2 and unchanged(model, before) == []
    monkeypatch.undo()
    monkeypatch.setattr(transaction_mod, "ENGINE", engine)
    fr.update_weights_from_disk(model, path, flt)
    expected = mix_checkpoints(ckpts["fp8", 0], ckpts["fp8", 1], tmp_path / "mixed",
                               lambda n: n.startswith("model.layers.2.mlp.experts.5."))
    assert fr.compare_states(fr.snapshot(fr.load_model(expected)), fr.snapshot(model)) == []


def test_a_new_version_of_a_shard_is_not_mixed_into_a_reload_in_flight(ckpts, tmp_path,
                                                                        monkeypatch, engine):
    """A complete new version of one shard (same tensors and header bytes, new values)
    renamed into place between planning and reading: reading it would give one shard of
    the new version beside the others of the old one. Refused; the next reload plans
    with the new file and reads it."""
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "ckpt")
    shard = bad.shard_of(path, bad.WEIGHT)
    new = ckpts["fp8", 0] / shard.name
    assert bad.split_safetensors(new)[0] == bad.split_safetensors(shard)[0]  # same header

    def rename_new_version():
        shutil.copy(new, tmp_path / "partial")
        os.replace(tmp_path / "partial", shard)

    opens = swap_before_open(monkeypatch, shard, 2, rename_new_version)
    model = fr.load_model(ckpts["fp8", 1])
    before = fr.snapshot(model)
    with pytest.raises(fr.CorruptCheckpointError, match="changed after its header was read"):
        fr.update_weights_from_disk(model, path)
    assert len(opens) >= 2 and unchanged(model, before) == []
    fr.update_weights_from_disk(model, path)
    wm = bad.weight_map(path)
    expected = mix_checkpoints(ckpts["fp8", 1], ckpts["fp8", 0], tmp_path / "mixed",
                               lambda n: wm[n] == shard.name)
    assert fr.compare_states(fr.snapshot(fr.load_model(expected)), fr.snapshot(model)) == []


# Where each engine reads a shard's bytes: (module, function); the file path is args[1].
READ_POINT = {"staged": ("fp8_reload.checkpoint.reader", "_read_tensor"),
              "stream": ("fp8_reload.reload.chunks", "read_span")}


def hook_reads(monkeypatch, engine: str, after):
    """Call `after(fpath)` after each read of tensor bytes by `engine`'s reader."""
    module = importlib.import_module(READ_POINT[engine][0])
    real = getattr(module, READ_POINT[engine][1])

    def read(*args, **kwargs):
        out = real(*args, **kwargs)
        after(args[1])
        return out

    monkeypatch.setattr(module, READ_POINT[engine][1], read)


def test_a_shard_truncated_while_it_is_read_is_refused(ckpts, tmp_path, monkeypatch, engine):
    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "ckpt")
    shard = bad.shard_of(path, bad.WEIGHT)
    cut = []

    def truncate(fpath):
        if fpath == shard and not cut:
            os.truncate(shard, 100)  # a writer truncates it (e.g. open "wb")
            cut.append(fpath)

    hook_reads(monkeypatch, engine, truncate)
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    # read on: short (truncated); opened again later (the streaming engine): a new stamp
    with pytest.raises(fr.CorruptCheckpointError,
                       match="truncated while reading|changed after its header was read"):
        fr.update_weights_from_disk(model, path)
    assert cut and unchanged(model, before) == []


@pytest.mark.parametrize("reader_path", ["sequential", "parallel"])
def test_a_shard_written_to_while_it_is_read_is_refused(ckpts, tmp_path, monkeypatch, reader_path,
                                                        engine):
    """A writer changes bytes in place (same size, same inode) while the tensors are being
    read: what was read may be a torn mix, so the shard's stamp is checked after its
    last tensor (the streaming engine: every file's, after the writes) and the read fails."""
    from fp8_reload.checkpoint import PinnedArena

    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "ckpt")
    shard = bad.shard_of(path, bad.WEIGHT)
    wrote = []

    def write(fpath):
        if fpath == shard and not wrote:
            with open(shard, "r+b") as f:  # a writer updates another tensor's bytes in place
                f.seek(-16, os.SEEK_END)
                f.write(b"\x01" * 16)
            wrote.append(fpath)

    hook_reads(monkeypatch, "staged", write)
    ckpt = Checkpoint(path)
    into = PinnedArena(pin=False) if reader_path == "parallel" else None
    with pytest.raises(fr.CorruptCheckpointError, match="changed while it was being read"):
        list(ckpt.read(ckpt.names, {}, into=into))
    assert wrote
    monkeypatch.undo()
    monkeypatch.setattr(transaction_mod, "ENGINE", engine)
    hook_reads(monkeypatch, engine, write)
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    wrote.clear()
    with pytest.raises(fr.CorruptCheckpointError, match="changed (while|after its header)"):
        fr.update_weights_from_disk(model, path)
    assert wrote and unchanged(model, before) == []


def test_a_header_with_too_many_entries_is_refused_before_parsing(ckpts, tmp_path):
    """100 MB of empty tensor entries would cost ~16 s and 1.7 GB to parse: refused by
    counting entries in the raw bytes first."""
    from fp8_reload.checkpoint.header import MAX_HEADER_ENTRIES

    path = copy_checkpoint(ckpts["fp8", 1], tmp_path / "ckpt")
    shard = bad.shard_of(path, bad.WEIGHT)
    entries = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
               for i in range(MAX_HEADER_ENTRIES + 1)}
    bad.join_safetensors(shard, entries, b"")
    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    outcome, err = in_thread(fr.update_weights_from_disk, model, path)
    assert outcome == "error" and type(err) is fr.CorruptCheckpointError, (outcome, err)
    assert f"{MAX_HEADER_ENTRIES + 1} tensor entries" in str(err) and str(shard) in str(err)
    assert unchanged(model, before) == []


@pytest.mark.parametrize("writer", ["rename", "in-place"])
def test_reloads_racing_a_writer_are_never_mixed(ckpts, tmp_path, writer, engine):
    """A writer thread keeps replacing one shard by version A (seed 0) or B (seed 1), by
    renaming a complete copy into place or by rewriting it in place, while reloads run.
    Every reload ends in one of the two consistent states or is refused; none mixes."""
    a, b = ckpts["fp8", 0], ckpts["fp8", 1]
    path = copy_checkpoint(a, tmp_path / "ckpt")
    shard = bad.shard_of(path, bad.WEIGHT).name
    mixed = copy_checkpoint(a, tmp_path / "mixed")
    shutil.copy(b / shard, mixed / shard)
    states = [fr.snapshot(fr.load_model(a)), fr.snapshot(fr.load_model(mixed))]
    model = fr.load_model(b)
    stop = threading.Event()

    def write():
        i = 0
        while not stop.is_set():
            src = (a if i % 2 else b) / shard
            if writer == "rename":
                shutil.copy(src, tmp_path / "partial")
                os.replace(tmp_path / "partial", path / shard)
            else:
                data = src.read_bytes()
                with open(path / shard, "r+b") as f:
                    f.truncate(0)
                    f.write(data)
            i += 1

    t = threading.Thread(target=write, daemon=True)
    t.start()
    outcomes = {"consistent": 0, "refused": 0}
    try:
        for _ in range(40):
            try:
                fr.update_weights_from_disk(model, path)
            except fr.CheckpointError:  # changed or torn: refused, rolled back
                outcomes["refused"] += 1
                continue
            now = fr.snapshot(model)
            assert any(fr.compare_states(s, now) == [] for s in states), "a mixed model"
            outcomes["consistent"] += 1
    finally:
        stop.set()
        t.join(WAIT)
    assert sum(outcomes.values()) == 40
    fr.update_weights_from_disk(model, path)  # the writer stopped: the reload goes through
    assert any(fr.compare_states(s, fr.snapshot(model)) == [] for s in states)


def test_no_read_outlives_a_failed_staging(ckpts, monkeypatch):
    """An error while the parallel reader still runs (here: in the value check, fed as
    tensors arrive) must not leave reads writing into the staging arena after the reload
    has returned: the next reload reuses that memory. (The staged engine's reader; the
    streaming engine's ring waits for its reads in flight itself.)"""
    import fp8_reload.checkpoint.values as values
    import fp8_reload.reload.plan as plan

    monkeypatch.setattr(transaction_mod, "ENGINE", "staged")
    monkeypatch.setattr(plan, "on_cuda", lambda model: True)  # the GPU path's arena, on CPU
    real = values.ValueCheck.add
    calls = []

    def fail_early(self, name, tensor):
        calls.append(name)
        if len(calls) == 3:
            raise RuntimeError("device error while checking")
        return real(self, name, tensor)

    model = fr.load_model(ckpts["fp8", 0])
    before = fr.snapshot(model)
    monkeypatch.setattr(values.ValueCheck, "add", fail_early)
    earlier = set(threading.enumerate())  # other tests' pools may live on
    with pytest.raises(fr.ReloadError, match="before anything was written: RuntimeError") as info:
        fr.update_weights_from_disk(model, ckpts["fp8", 1])
    readers = [t for t in threading.enumerate() if t not in earlier]
    assert readers == [], f"reads still running after the reload returned: {readers}"
    assert info.value.__cause__ is not None  # the traceback (and its frames) is still held
    assert unchanged(model, before) == []


def test_a_header_is_parsed_once_per_bytes_and_a_bad_one_every_time(tmp_path):
    """Headers parse to what their name, size and bytes say: the same again (a file
    touched, or RL's next step written with the same layout) gives the same objects,
    any other bytes or size is parsed anew, and a refused header is refused every time
    (a refusal is never kept)."""
    from fp8_reload.checkpoint.header import parse_shard_header, read_header_bytes

    path = tmp_path / "a.safetensors"
    save_file({"x": torch.zeros(4), "y": torch.ones(2, 3)}, str(path))
    with open(path, "rb") as f:
        stamp, head = read_header_bytes(f, path)
    first = parse_shard_header(path, "a.safetensors", stamp[2], head)
    assert parse_shard_header(path, "a.safetensors", stamp[2], head) is first
    other = parse_shard_header(path, "b.safetensors", stamp[2], head)  # another name: another file field
    assert other is not first and other["x"].file == "b.safetensors"
    bad = head.replace(b'"F32"', b'"F99"', 1)
    for _ in range(2):
        with pytest.raises(fr.UnsupportedCheckpointError, match="F99"):
            parse_shard_header(path, "a.safetensors", stamp[2], bad)
    with pytest.raises(fr.CorruptCheckpointError):  # the same bytes, a size they do not fit
        parse_shard_header(path, "a.safetensors", stamp[2] + 4, head)
