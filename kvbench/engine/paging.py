"""A layer's slots grouped into pages by token position, as a paged KV cache lays them out: page p of a row holds its
tokens p * size .. (p + 1) * size - 1 (counted from the row's first real token, so a left-padded row pages as it
would alone), the last page partly filled. Sparse policies that read whole pages (Quest) summarise and select
pages through this. It needs the slots in position order, each row's tokens after its padding (nothing evicted or
moved: a sparse policy's cache), so a page is a run of slots and summarising it is a reshape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvbench.errors import KvbenchError

if TYPE_CHECKING:
    from kvbench.engine.layer import LayerKV


@dataclass
class Pages:
    """A layer's pages at one step. Shapes come from the host's token counts; the tensors are derived on the device
    from the slots' positions, so finding pages costs no host-device transfer."""

    index: torch.Tensor  # [batch, kv_heads, length] each slot's page; a padding slot's is `count` (no page)
    tokens: torch.Tensor  # [batch, 1] each row's own tokens: the last `tokens` slots of the row
    count: int  # pages of the longest row
    size: int

    @classmethod
    def of(cls, layer: LayerKV, size: int) -> Pages:
        if not layer.slots_in_order:
            raise KvbenchError(f"layer {layer.layer_idx}: pages need the slots in position order (nothing evicted)")
        positions = layer.live_positions()
        most = layer.seen - min(layer.owner.row_padding)  # the longest row's tokens (host counts)
        count = -(-most // size)
        # a padding slot has a negative position: it goes to the extra page `count`, which no one reads
        index = torch.where(positions >= 0, positions.div(size, rounding_mode="floor"), count)
        return cls(index, positions[:, 0, -1:] + 1, count, size)

    @property
    def per_row(self) -> torch.Tensor:
        """`[batch, 1]` pages each row holds, its last one (the page being written) partly filled."""
        return (self.tokens + self.size - 1).div(self.size, rounding_mode="floor")

    def min_max(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The min and the max of `values` `[batch, kv_heads, length, dim]` over each page's slots, each
        `[batch, kv_heads, count, dim]` (a row's pages beyond its own hold its last token's values)."""
        batch, heads, length, dim = values.shape
        span = self.count * self.size
        # each row's tokens from its first (past its padding) onwards, up to whole pages: a partly filled last page
        # is filled up with its own last token, which changes neither its min nor its max
        wanted = (torch.arange(span, device=values.device) + (length - self.tokens)).clamp(max=length - 1)
        if batch == 1:  # one row (the usual case): a plain index along the slots
            paged = values.index_select(2, wanted[0])
        else:
            paged = values.gather(2, wanted[:, None, :, None].expand(batch, heads, span, dim))
        paged = paged.view(batch, heads, self.count, self.size, dim)
        return paged.amin(dim=3), paged.amax(dim=3)

    def missing(self) -> torch.Tensor:
        """`[batch, 1, 1, count]`: True on the pages a row does not have (a shorter row of a batch)."""
        return (torch.arange(self.count, device=self.index.device) >= self.per_row)[:, None, None]

    def last(self) -> torch.Tensor:
        """`[batch, 1, 1, count]`: True on each row's last page, the one the newest token was written to."""
        return (torch.arange(self.count, device=self.index.device) == self.per_row - 1)[:, None, None]

    def slots(self, chosen: torch.Tensor) -> torch.Tensor:
        """Chosen pages `[batch, kv_heads, group, count]` as the slots they hold: `[batch, kv_heads, group, length]`
        (padding slots never chosen)."""
        batch, heads, group, count = chosen.shape
        padded = torch.cat([chosen, chosen.new_zeros(batch, heads, group, 1)], dim=-1)  # the padding slots' page
        return padded.gather(-1, self.index[:, :, None].expand(batch, heads, group, -1))
