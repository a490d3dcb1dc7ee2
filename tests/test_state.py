"""Snapshots judge "the same Parameter object" soundly, even when CPython hands a
dead Parameter's address to its replacement (the CI run that failed on gate step 5)."""

from __future__ import annotations

import torch
from torch import nn

from fp8_reload.state import compare_states, object_serial, snapshot


def test_replacement_at_the_dead_ones_address_is_not_the_same_object():
    mod = nn.Module()
    for _ in range(1000):  # CPython most often hands a freed object's memory to the next one
        mod.w = nn.Parameter(torch.zeros(3), requires_grad=False)  # of its size: try until it does
        before = snapshot(mod)
        address, data = id(mod.w), torch.zeros(3)  # (made first: it could take the address)
        del mod.w
        mod.w = nn.Parameter(data, requires_grad=False)
        if id(mod.w) == address:
            break
    assert id(mod.w) == address, "no replacement landed at the old address"
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
