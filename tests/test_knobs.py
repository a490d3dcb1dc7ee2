"""`FP8_RELOAD_*` settings: read once at import, a bad value refused by name."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fp8_reload.knobs import env_choice, env_int


@pytest.mark.parametrize("raw,want", [(None, 7), ("", 7), ("  ", 7), ("0", 0), ("4096", 4096),
                                      ("67_108_864", 64 << 20), (" 12 ", 12)])
def test_a_whole_number_or_nothing_is_taken(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv("FP8_RELOAD_TEST_KNOB", raising=False)
    else:
        monkeypatch.setenv("FP8_RELOAD_TEST_KNOB", raw)
    assert env_int("FP8_RELOAD_TEST_KNOB", 7) == want


@pytest.mark.parametrize("raw,says", [("64M", "expected a whole number"), ("1.5", "expected a whole number"),
                                      ("0x10", "expected a whole number"), ("0", "at least 1"),
                                      ("-4", "at least 1")])
def test_anything_else_is_refused_by_name(monkeypatch, raw, says):
    monkeypatch.setenv("FP8_RELOAD_TEST_KNOB", raw)
    with pytest.raises(ValueError, match=f"FP8_RELOAD_TEST_KNOB={raw!r}: .*{says}"):
        env_int("FP8_RELOAD_TEST_KNOB", 7, minimum=1)


@pytest.mark.parametrize("name,raw", [("FP8_RELOAD_CHUNK_BYTES", "64M"), ("FP8_RELOAD_CHUNK_BYTES", "0"),
                                      ("FP8_RELOAD_RING_SLOTS", "0"), ("FP8_RELOAD_BACKUP_ON_DEVICE", "-1"),
                                      ("FP8_RELOAD_READ_THREADS", "0"), ("FP8_RELOAD_REGISTER_PIECE", "x"),
                                      ("FP8_RELOAD_STREAM_QUANT", "yes"),
                                      # review s25: no upper bound made a ring of 2**62-byte
                                      # chunks fail inside every commit, 5,000 reader processes
                                      # take minutes to start; a typo chose the old engine
                                      ("FP8_RELOAD_CHUNK_BYTES", str(2**62)),
                                      ("FP8_RELOAD_RING_SLOTS", str(2**63)),
                                      ("FP8_RELOAD_READ_THREADS", "5000"), ("FP8_RELOAD_ENGINE", "Stream"),
                                      ("FP8_RELOAD_IO", "Direct"), ("FP8_RELOAD_READERS", "procs"),
                                      ("FP8_RELOAD_REGISTER", "sometimes"),
                                      ("FP8_RELOAD_WRITE_WAIT_S", "0"), ("FP8_RELOAD_WRITE_WAIT_S", "1.5")])
def test_a_bad_setting_is_named_where_the_reload_is_first_looked_up(name, raw):
    """A chunk of 0 bytes or a ring of 0 slots would leave a reload nothing to make progress
    with: refused when `fr.update_weights_from_disk` is first looked up (its modules are
    imported then), with the setting's name."""
    env = {**os.environ, name: raw}
    code = "import fp8_reload as fr; fr.update_weights_from_disk"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and f"{name}={raw!r}" in done.stderr, done.stderr[-2000:]


def test_a_maximum_and_a_choice_are_refused_by_name(monkeypatch):
    monkeypatch.setenv("FP8_RELOAD_TEST_KNOB", "1025")
    with pytest.raises(ValueError, match="FP8_RELOAD_TEST_KNOB='1025': must be at most 1024"):
        env_int("FP8_RELOAD_TEST_KNOB", 7, minimum=1, maximum=1024)
    monkeypatch.setenv("FP8_RELOAD_TEST_KNOB", "1024")
    assert env_int("FP8_RELOAD_TEST_KNOB", 7, minimum=1, maximum=1024) == 1024
    monkeypatch.setenv("FP8_RELOAD_TEST_KNOB", "B")
    with pytest.raises(ValueError, match="FP8_RELOAD_TEST_KNOB='B': expected one of a, b"):
        env_choice("FP8_RELOAD_TEST_KNOB", "a", ("a", "b"))
    monkeypatch.delenv("FP8_RELOAD_TEST_KNOB")
    assert env_choice("FP8_RELOAD_TEST_KNOB", "a", ("a", "b")) == "a"


def test_the_registration_budget_is_read_the_same_way(monkeypatch):
    """(Read at each reload: the host's memory may change.) Unset: half the host's memory."""
    from fp8_reload.reload import to_device

    monkeypatch.delenv("FP8_RELOAD_REGISTER_BUDGET", raising=False)
    assert to_device._register_budget() > 0
    monkeypatch.setenv("FP8_RELOAD_REGISTER_BUDGET", "1_000")
    assert to_device._register_budget() == 1000
    monkeypatch.setenv("FP8_RELOAD_REGISTER_BUDGET", "4G")
    with pytest.raises(ValueError, match="FP8_RELOAD_REGISTER_BUDGET='4G': expected a whole number"):
        to_device._register_budget()


def test_part_bytes_of_zero_is_taken_as_documented():
    """``FP8_RELOAD_PART_BYTES=0``: a ring slot per chunk, no parts (the knob's documented
    value; the whole-number check of the sizes once refused it as below 1)."""
    env = {**os.environ, "FP8_RELOAD_PART_BYTES": "0"}
    code = "import fp8_reload.reload.chunks as c; print(c.PART_BYTES)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr[-2000:]
