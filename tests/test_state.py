"""Snapshots judge "the same Parameter object" soundly, even when CPython hands a
dead Parameter's address to its replacement (the CI run that failed on gate step 5)."""

from __future__ import annotations

import torch
from torch import nn

from fp8_reload.state import compare_states, object_serial, snapshot


def test_replacement_at_the_dead_ones_address_is_not_the_same_object(monkeypatch):
    """CPython hands a dead object's memory to the next one of its size, at times (on one
    host in a loop of 1,000 tries, on another never): here every Parameter gets the same
    address, so the replacement's always is the dead one's."""
    import builtins

    import fp8_reload.state as state

    monkeypatch.setattr(state, "id", lambda obj: 42 if isinstance(obj, nn.Parameter) else builtins.id(obj),
                        raising=False)
    mod = nn.Module()
    mod.w = nn.Parameter(torch.zeros(3), requires_grad=False)
    before = snapshot(mod)
    del mod.w  # dies here: its serial goes with it
    mod.w = nn.Parameter(torch.zeros(3), requires_grad=False)
    now = snapshot(mod)
    assert now.ids != before.ids
    assert compare_states(before, now, identity=True) == ["w: Parameter object replaced"]


def test_serial_stays_while_the_object_lives():
    p = nn.Parameter(torch.zeros(2))
    assert object_serial(p) == object_serial(p)
    assert object_serial(p) != object_serial(nn.Parameter(torch.zeros(2)))


def test_a_loader_swapped_for_another_is_reported():
    """Same attribute names, another loader: the next reload would not run the one
    the model was built with."""
    mod = nn.Module()
    mod.w = nn.Parameter(torch.zeros(2), requires_grad=False)
    mod.w.weight_loader = lambda p, t: p.data.copy_(t)
    before = snapshot(mod)
    assert compare_states(before, snapshot(mod), identity=True) == []
    mod.w.weight_loader = lambda p, t: p.data.copy_(t)
    diffs = compare_states(before, snapshot(mod), identity=True)
    assert diffs == ["w: loader attributes ['weight_loader'] replaced"]
