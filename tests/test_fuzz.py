"""Property-based fuzzing of the checkpoint reader (hypothesis).

Property: whatever bytes a checkpoint holds, the reader and the reload raise
only `ReloadError` subclasses (never another exception, never a crash), finish
within a time limit (never hang), and leave the model bit-identical.
A header the reader accepts must also be readable by safetensors itself.

Examples per run (x FP8_RELOAD_FUZZ_SCALE, default 1; a nightly run can use 10):
structured headers 300, mutated real shards (end to end) 150, arbitrary bytes
100, index files 200, config.json 100: 850 in all, 15-30 s on 2 shared CPU cores.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import fp8_reload as fr
from fp8_reload.checkpoint import INDEX_FILE, SINGLE_FILE, read_safetensors_header

from .conftest import Hang, time_limit

SCALE = float(os.environ.get("FP8_RELOAD_FUZZ_SCALE", "1"))
TIME_LIMIT = 20.0  # seconds per example before it counts as a hang


def fuzz_settings(n: int):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, print_blob=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def only_reload_errors(fn, *args, **kwargs):
    """Run fn: returns its result, or the ReloadError it raised; anything else fails."""
    with time_limit(TIME_LIMIT):
        try:
            out = fn(*args, **kwargs)
        except fr.ReloadError as e:
            assert str(e), "a ReloadError must say something"
            out = e
        except Hang as e:  # a test failure hypothesis can shrink, not an interrupted session
            pytest.fail(f"{getattr(fn, '__name__', fn)} hung: {e}")
    # outcome counts show in `pytest --hypothesis-show-statistics`
    event(f"{getattr(fn, '__name__', fn)}: "
          f"{type(out).__name__ if isinstance(out, fr.ReloadError) else 'ok'}")
    return out


# --------------------------------------------------------------------------
# Shared inputs: one good checkpoint and a model loaded from it
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good(ckpts):
    return ckpts["fp8", 0]


@pytest.fixture(scope="module")
def model_and_state(good):
    model = fr.load_model(good)
    return model, fr.snapshot(model)


def _dir_like(good: Path, root: Path, skip=()) -> Path:
    """A checkpoint directory sharing the good one's files (hard links), minus `skip`."""
    out = root / "ckpt"
    out.mkdir()
    for f in good.iterdir():
        if f.name not in skip:
            os.link(f, out / f.name)
    return out


# --------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------

SIZES = {"F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "F32": 4, "I64": 8, "BOOL": 1}
junk = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
names = st.text(max_size=24) | st.sampled_from(
    ["model.norm.weight", "__metadata__", "", "model.layers.1.mlp.experts.0.up_proj.weight"])


@st.composite
def safetensors_files(draw) -> bytes:
    """A well-formed safetensors file, then a few targeted corruptions of it."""
    header, pos = {}, 0
    for i in range(draw(st.integers(0, 5))):
        dtype = draw(st.sampled_from(sorted(SIZES)))
        shape = draw(st.lists(st.integers(0, 6), max_size=3))
        n = math.prod(shape) * SIZES[dtype]
        header[draw(names.filter(lambda s: s != "__metadata__")) or f"t{i}"] = {
            "dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)
                                      | junk)
    data_len = pos
    keys = [k for k in header if k != "__metadata__"]
    for _ in range(draw(st.integers(0, 3))):
        what = draw(st.sampled_from(["dtype", "shape", "offsets", "entry", "drop", "data", "whole"]))
        key = draw(st.sampled_from(keys)) if keys else None
        if key is not None and not isinstance(header[key], dict):
            key = None  # already replaced by junk
        if what == "dtype" and key is not None:
            header[key]["dtype"] = draw(st.sampled_from(["U32", "F8_E4M3FN", "", "f32"]) | junk)
        elif what == "shape" and key is not None:
            header[key]["shape"] = draw(st.lists(st.integers(-3, 2**63), max_size=4) | junk)
        elif what == "offsets" and key is not None:
            header[key]["data_offsets"] = draw(st.lists(st.integers(-5, 2**65), max_size=3) | junk)
        elif what == "entry" and key is not None:
            header[key] = draw(junk)
        elif what == "drop" and key is not None:
            header[key].pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
        elif what == "data":
            data_len = max(0, data_len + draw(st.sampled_from([-1, 1, -8, 64])))
        elif what == "whole":
            header = draw(junk)
            break
    body = json.dumps(header).encode()
    hlen = len(body) + draw(st.sampled_from([0, 0, 0, 0, 1, -1, 2**40, 2**64 - 1 - len(body)]))
    hlen = min(max(hlen, 0), 2**64 - 1)
    return struct.pack("<Q", hlen) + body + b"\x3c" * data_len


def _write_single_file_checkpoint(good: Path, root: Path, blob: bytes) -> Path:
    d = root / "single"
    d.mkdir()
    shutil.copy(good / "config.json", d / "config.json")
    (d / SINGLE_FILE).write_bytes(blob)
    return d


def _read_everything(d: Path) -> dict[str, torch.Tensor]:
    ckpt = fr.Checkpoint(d)
    return dict(ckpt.read(ckpt.names))


# --------------------------------------------------------------------------
# Safetensors headers
# --------------------------------------------------------------------------

@fuzz_settings(300)
@given(blob=safetensors_files())
def test_structured_headers(good, blob):
    with tempfile.TemporaryDirectory() as tmp:
        d = _write_single_file_checkpoint(good, Path(tmp), blob)
        parsed = only_reload_errors(read_safetensors_header, d / SINGLE_FILE)
        read = only_reload_errors(_read_everything, d)
        if not isinstance(parsed, fr.ReloadError):
            # Accepted: our reader returns exactly what the safetensors library reads.
            assert not isinstance(read, fr.ReloadError), read
            reference = load_file(str(d / SINGLE_FILE))
            assert sorted(read) == sorted(reference)
            for name, t in read.items():
                assert fr.state.bitwise_equal(t, reference[name]), name


@fuzz_settings(100)
@given(blob=st.binary(max_size=512))
def test_arbitrary_bytes(good, blob):
    with tempfile.TemporaryDirectory() as tmp:
        d = _write_single_file_checkpoint(good, Path(tmp), blob)
        only_reload_errors(read_safetensors_header, d / SINGLE_FILE)
        only_reload_errors(_read_everything, d)


MUTATIONS = st.lists(st.tuples(st.sampled_from(["flip", "set", "delete", "insert", "truncate"]),
                               st.floats(0, 1), st.integers(0, 255), st.integers(1, 16)),
                     min_size=1, max_size=4)


def _mutate(raw: bytes, region: int, mutations) -> bytes:
    b = bytearray(raw)
    for op, where, value, n in mutations:
        i = int(where * region)
        if op == "flip" and i < len(b):
            b[i] ^= 1 << (value % 8)
        elif op == "set" and i < len(b):
            b[i] = value
        elif op == "delete":
            del b[i:i + n]
        elif op == "insert":
            b[i:i] = bytes([value]) * n
        elif op == "truncate":
            del b[i:]
    return bytes(b)


def reload_checked(model, path, flt=None, held=None):
    """A reload either raises a ReloadError and leaves the model as it was, or succeeds
    and leaves it equal to a fresh load of `path` (full), or to the same reload of a fresh
    load of `held`, the checkpoint the model held (filtered: a mutation that reaches tensor
    bytes changes what the filter takes; CI found one). Parameters are kept either way."""
    pre = fr.snapshot(model)
    out = only_reload_errors(fr.update_weights_from_disk, model, path, flt)
    post = fr.snapshot(model)
    assert [d for d in fr.compare_states(pre, post, identity=True) if not d.endswith("bytes differ")] == []
    if isinstance(out, fr.ReloadError):
        assert fr.compare_states(pre, post) == []
    elif flt is None:
        assert fr.compare_states(fr.snapshot(fr.load_model(path)), post) == []
    elif fr.compare_states(pre, post):
        want = fr.load_model(held)
        fr.update_weights_from_disk(want, path, flt)
        assert fr.compare_states(fr.snapshot(want), post) == []
    return out


@fuzz_settings(150)
@given(mutations=MUTATIONS, which=st.integers(0, 3))
@example(mutations=[("flip", 1.0, 0, 1), ("flip", 0.25, 0, 1)], which=1)  # (CI: a name and a data byte)
def test_mutated_real_shard_end_to_end(good, model_and_state, mutations, which):
    """Mutate the length field and JSON header of a real shard (a deletion or
    insertion near the header's end may shift tensor bytes too): every reload
    raises a ReloadError with the model untouched, or succeeds with the model equal
    to a fresh load of the mutated checkpoint."""
    model, before = model_and_state
    shards = sorted(set(json.loads((good / INDEX_FILE).read_text())["weight_map"].values()))
    shard = shards[which % len(shards)]
    raw = (good / shard).read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    with tempfile.TemporaryDirectory() as tmp:
        d = _dir_like(good, Path(tmp), skip={shard})
        (d / shard).write_bytes(_mutate(raw, 8 + hlen, mutations))
        full = reload_checked(model, d)
        held = good if isinstance(full, fr.ReloadError) else d
        reload_checked(model, d, fr.generate_weight_name_filter({1: [0, 5], 2: [3]}), held)
    if fr.compare_states(before, fr.snapshot(model)):
        fr.update_weights_from_disk(model, good)  # back to the good state for the next example
    assert fr.compare_states(before, fr.snapshot(model), identity=True) == []


# --------------------------------------------------------------------------
# Index and config files
# --------------------------------------------------------------------------

@st.composite
def index_files(draw, real: dict) -> bytes:
    shards = sorted(set(real.values()))
    nasty = ["../ckpt/" + shards[0], "/etc/passwd", "pytorch_model.bin", "model.gguf", "",
             "x\x00.safetensors", "missing.safetensors", "sub/model.safetensors", shards[0].upper(),
             "model.pt", "./" + shards[0], "sub//" + shards[0], "sub/./" + shards[0],
             "sub/../" + shards[0], "model-\ud800.safetensors", "sub/missing.safetensors"]
    nasty += [f"sub/{f}" for f in shards] + [f"{f}.safetensors" for f in SPECIAL_FILES]
    style = draw(st.sampled_from(["perturbed", "perturbed", "random", "junk", "bytes"]))
    if style == "bytes":
        return draw(st.binary(max_size=256))
    if style == "junk":
        return json.dumps(draw(junk)).encode()
    if style == "random":
        wm = draw(st.dictionaries(names | st.sampled_from(sorted(real)),
                                  st.sampled_from(shards + nasty) | junk, max_size=8))
    else:
        wm = dict(real)
        keys = sorted(real)
        for _ in range(draw(st.integers(1, 4))):
            what = draw(st.sampled_from(["remap", "drop", "add", "nasty"]))
            k = draw(st.sampled_from(keys))
            if what == "remap":
                wm[k] = draw(st.sampled_from(shards))
            elif what == "drop":
                wm.pop(k, None)
            elif what == "add":
                wm[draw(names)] = draw(st.sampled_from(shards + nasty))
            else:
                wm[k] = draw(st.sampled_from(nasty) | junk)
    top = {"metadata": draw(junk), "weight_map": wm} if draw(st.booleans()) else {"weight_map": wm}
    raw = json.dumps(top).encode()
    if draw(st.integers(0, 9)) == 0:
        raw = raw[: draw(st.integers(0, len(raw)))]
    return raw


@pytest.fixture(scope="module")
def real_weight_map(good):
    return json.loads((good / INDEX_FILE).read_text())["weight_map"]


# Names an index may give that are not regular files: each is made in the fuzzed directory.
SPECIAL_FILES = ["fifo", "zero", "dir", "loop"]


def _add_special_files(d: Path, shards: list[str]) -> None:
    """sub/ with the same shards (hard links: same data, so a reload through them leaves
    the model as it was), a FIFO, /dev/zero, a directory and a symlink loop."""
    (d / "sub").mkdir()
    for f in shards:
        os.link(d / f, d / "sub" / f)
    os.mkfifo(d / "fifo.safetensors")
    os.symlink("/dev/zero", d / "zero.safetensors")
    (d / "dir.safetensors").mkdir()
    os.symlink(d / "loop.safetensors", d / "loop.safetensors")


def test_index_fuzz(good, model_and_state, real_weight_map):
    model, before = model_and_state
    shards = sorted(set(real_weight_map.values()))

    @fuzz_settings(200)
    @given(raw=index_files(real_weight_map), full=st.booleans())
    def check(raw, full):
        with tempfile.TemporaryDirectory() as tmp:
            d = _dir_like(good, Path(tmp), skip={INDEX_FILE})
            _add_special_files(d, shards)
            (d / INDEX_FILE).write_bytes(raw)
            only_reload_errors(_read_everything, d)
            flt = None if full else fr.generate_weight_name_filter({1: [2], 2: [6]})
            only_reload_errors(fr.update_weights_from_disk, model, d, flt)
        assert fr.compare_states(before, fr.snapshot(model), identity=True) == []

    check()


def test_config_fuzz(good, model_and_state):
    model, before = model_and_state
    hf = json.loads((good / "config.json").read_text())

    @fuzz_settings(100)
    @given(edits=st.lists(st.tuples(st.sampled_from(sorted(hf) + ["quantization_config"]),
                                    st.sampled_from(["junk", "drop", "int"]), junk,
                                    st.integers(-2, 2**40)), max_size=4),
           whole=st.none() | junk)
    def check(edits, whole):
        cfg = dict(hf)
        for key, what, value, number in edits:
            if what == "drop":
                cfg.pop(key, None)
            else:
                cfg[key] = value if what == "junk" else number
        with tempfile.TemporaryDirectory() as tmp:
            d = _dir_like(good, Path(tmp), skip={"config.json"})
            (d / "config.json").write_text(json.dumps(cfg if whole is None else whole))
            only_reload_errors(fr.Checkpoint, d)
            only_reload_errors(fr.update_weights_from_disk, model, d,
                               fr.generate_weight_name_filter({1: [1]}))
        assert fr.compare_states(before, fr.snapshot(model), identity=True) == []

    check()


# One config.json field set to one value: accepted exactly when the value is one a
# model can have. Sizes: JSON integers >= 1 (0 allowed where marked); floats: finite
# numbers in range; flags: booleans. Anything else names the field.
SIZE_FIELDS = {"hidden_size": 1, "num_hidden_layers": 1, "n_routed_experts": 1,
               "moe_intermediate_size": 1, "intermediate_size": 1, "num_experts_per_tok": 1,
               "num_attention_heads": 1, "qk_head_dim": 1, "v_head_dim": 1,
               "n_shared_experts": 0, "first_k_dense_replace": 0}
FLOAT_FIELDS = {"rms_norm_eps": 1.0, "routed_scaling_factor": 1e6}  # (0, max]
field_values = (st.integers(-3, 70) | st.sampled_from([10**30, 2**63, -(2**63)])
                | st.floats(allow_nan=True, allow_infinity=True) | st.booleans() | st.none()
                | st.sampled_from(["64", "nan", "-inf", "1e-6", "", "true"]) | st.just([64]))


def _acceptable(hf: dict, key: str, v) -> bool:
    """The oracle. Drawn integers are either at most 70 (far below every cap) or at
    least 2**63 in size (above every cap)."""
    if v is None:  # null: the default of an optional field, an error for a required one
        return key in ("n_shared_experts", "first_k_dense_replace", "rms_norm_eps",
                       "routed_scaling_factor", "norm_topk_prob")
    if key == "norm_topk_prob":
        return isinstance(v, bool)
    if isinstance(v, bool | str | list):
        return False
    if key in FLOAT_FIELDS:
        return math.isfinite(v) and 0 < v <= FLOAT_FIELDS[key]
    if not isinstance(v, int) or not SIZE_FIELDS[key] <= v <= 70:
        return False
    cfg = {**hf, key: v}
    return (cfg["num_experts_per_tok"] <= cfg["n_routed_experts"]
            and cfg["first_k_dense_replace"] <= cfg["num_hidden_layers"])


def test_config_field_values(good):
    hf = json.loads((good / "config.json").read_text())

    @fuzz_settings(300)
    @given(key=st.sampled_from(sorted(SIZE_FIELDS) + sorted(FLOAT_FIELDS) + ["norm_topk_prob"]),
           value=field_values)
    def check(key, value):
        cfg = {**hf, key: value}
        try:
            parsed = fr.MoEConfig.from_hf_config(cfg)
        except ValueError as e:
            assert not _acceptable(hf, key, value), f"{key}={value!r} refused: {e}"
            assert repr(key) in str(e), e
        else:
            assert _acceptable(hf, key, value), f"{key}={value!r} accepted"
            assert fr.MoEConfig.from_hf_config(parsed.to_hf_config()) == parsed
        with tempfile.TemporaryDirectory() as tmp:
            d = _dir_like(good, Path(tmp), skip={"config.json"})
            # JSON has no NaN (refused by the JSON layer); 1e999 is how it spells inf
            text = json.dumps(cfg).replace("Infinity", "1e999")
            (d / "config.json").write_text(text)
            out = only_reload_errors(fr.Checkpoint, d)
            if isinstance(out, fr.ReloadError):
                named = repr(key) in str(out) or ("NaN" in text and "NaN is not valid JSON" in str(out))
                assert type(out) is fr.CorruptCheckpointError and named, out

    check()


@pytest.mark.parametrize("preset", fr.MoEConfig.PRESETS)
def test_every_preset_round_trips_through_config_json(preset):
    for cfg in (fr.MoEConfig.preset(preset), fr.MoEConfig.preset(preset, num_layers=2)):
        hf = json.loads(json.dumps(cfg.to_hf_config()))
        assert fr.MoEConfig.from_hf_config(hf) == cfg


class _BadBool:
    def __bool__(self):
        raise ValueError("no truth value")


filter_results = st.sampled_from([True, False, 0, 1, None, "", "yes", [], [0], 0.0, float("nan")]) \
    | st.builds(_BadBool)


def test_filter_results_fuzz(good, model_and_state):
    """Whatever a weight_name_filter returns: its truth value selects; a result without
    one is a ReloadError naming the filter; nothing selected is FilterMatchedNothingError."""
    model, before = model_and_state
    names = fr.Checkpoint(good).names

    @fuzz_settings(100)
    @given(results=st.dictionaries(st.sampled_from(names), filter_results, max_size=12),
           default=filter_results)
    def check(results, default):
        def flt(name):
            return results.get(name, default)

        try:
            truths = [bool(flt(n)) for n in names]
        except ValueError:
            truths = None
        out = only_reload_errors(fr.update_weights_from_disk, model, good, flt)
        if truths is None:
            assert isinstance(out, fr.ReloadError) and "weight_name_filter raised" in str(out)
        elif not any(truths):
            assert type(out) is fr.FilterMatchedNothingError, out
        else:
            assert not isinstance(out, fr.ReloadError), out
        assert fr.compare_states(before, fr.snapshot(model), identity=True) == []

    check()


def test_time_limit_catches_a_hang(monkeypatch):
    """The never-hang guard works: a stuck call is interrupted and reported as a failure."""
    monkeypatch.setattr(sys.modules[__name__], "TIME_LIMIT", 0.2)

    def stuck():
        while True:
            pass

    with pytest.raises(pytest.fail.Exception, match="stuck hung"):
        only_reload_errors(stuck)
