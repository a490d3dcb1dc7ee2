"""What a failed rebalance puts back: each rank's changed slots and merged input scales
(`Undo.restore`), then a vote naming the ranks that could not (`Undo.roll_back_together`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device import synchronize
from ..kernels.scales import clear_kernel_caches
from ..layers import FusedMoE
from .group import failed_ranks
from .placement import Placement
from .transfer import Moves, RowMover


def _merged_scales(layer: FusedMoE) -> list[torch.Tensor]:
    return [p for p in (layer.w13_input_scale, layer.w2_input_scale) if p is not None]


def save_scales(layers, changed) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The merged input scales of the changed layers, copied by one `cat`."""
    params = [p for lid in changed for p in _merged_scales(layers[lid])]
    saved = torch.cat([p.detach().reshape(-1) for p in params]) if params else None
    return params, saved


@dataclass
class Undo:
    """One rank's way back to `old`: the backup rows `moves.restore` scatters, the merged
    input scales `scales` (`save_scales`, once taken) and the slot maps of `old`."""

    model: object
    layers: dict[int, FusedMoE]
    mover: RowMover
    moves: Moves
    mine: object  # this rank's RebalancePlan: `changed` names the layers to put back
    old: Placement
    rank: int
    scales: tuple | None = None

    def restore(self) -> None:
        """Every changed slot's rows and the saved scales back in place, the old slot maps."""
        with torch.no_grad():
            for lid, layer in self.layers.items():
                layer.expert_slots = self.old.local_slots(lid, self.rank)
            self.mover.scatter(self.moves.restore)
            params, saved = self.scales if self.scales is not None else ([], None)
            off = 0
            for p in params:
                p.data.copy_(saved[off:off + p.numel()].view_as(p))
                off += p.numel()
            for lid in self.mine.changed:
                layer = self.layers[lid]
                layer.loaded_experts.clear()
                layer.staged.clear()
                layer.weights_version += 1
        clear_kernel_caches(self.model)
        synchronize(self.model)

    def roll_back_together(self, touched: bool, error, group, comm, vote: bool) -> str:
        """Every rank restores what it wrote (`touched`), then the ranks vote on whether they
        could (`vote`: not once the group failed). A rank that could not is marked
        (`weights_undefined`: it votes no to the next rebalance; a full reload repairs it).
        Returns what this rank can say of the outcome."""
        undone = None
        if touched:
            try:
                self.restore()
            except BaseException as e:
                undone = e
                self.model.weights_undefined = (
                    f"a failed rebalance ({type(error).__name__}: {error}) "
                    f"could not roll back ({type(e).__name__}: {e})")
        broken = None
        if vote:
            try:
                broken = failed_ranks(undone, group, comm)
            except Exception:  # (the group failed: this rank knows only itself)
                pass
        if broken is None:
            me = ("this rank could not roll back: its weights are undefined (reload it fully)"
                  if undone is not None else "this rank rolled back to the old placement")
            return f"{me}; the group failed, so the others' outcome is unknown"
        if not broken:
            return "every rank rolled back to the old placement"
        return (f"rank(s) {broken} could not roll back: their weights are undefined (reload "
                "them fully); the others rolled back to the old placement")
