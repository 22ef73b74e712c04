"""How one tensor of cached entries (keys or values) is stored: as is, quantized and bit-packed, as
coefficients on a low-rank basis, or as the channels a head keeps.

A codec turns entries `[B, H, n, D]` into per-slot fields `{name: [B, H, n, ...]}` (which move with their
slots when the cache evicts) and back. Some keep a layer-wide table beside the slots: KIVI's per-channel
key scales (one row per group of tokens) or a low-rank basis. Each layer gets its own codec instances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

Fields = dict[str, torch.Tensor]
# entries' positions: `[B, H, n]`, or a range when every head holds the same consecutive positions (known to the
# host, so a codec can use them without reading the device)
Positions = torch.Tensor | range


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`[..., D]` integer codes below 2**bits -> `[..., D * bits / 8]` uint8, 8 / bits codes per byte: byte i holds
    codes i, i + W, i + 2W, ... (W = D * bits / 8), so each bit plane unpacks with one shift over whole rows."""
    per_byte = 8 // bits
    planes = codes.to(torch.uint8).unflatten(-1, (per_byte, -1))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)[:, None]
    return (planes << shifts).sum(-2, dtype=torch.uint8)  # disjoint bit fields: the sum is their OR


def unpack(packed: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of `pack`: `[..., D]` codes, uint8 or written into `out` (a float buffer holds them exactly; the
    arithmetic with the scales then runs in place, where on CPU an operation mixing uint8 codes with float scales
    would first convert them into a temporary). One operation per bit plane, each with a plain number: a shift by
    a tensor of shifts broadcast over the planes runs several times slower on CPU."""
    if bits == 8:
        return packed if out is None else out.copy_(packed)
    width, mask = packed.shape[-1], 2**bits - 1
    codes = torch.empty(*packed.shape[:-1], width * 8 // bits, dtype=torch.uint8, device=packed.device) \
        if out is None else out
    planes = codes.unflatten(-1, (-1, width))
    torch.bitwise_and(packed, mask, out=planes[..., 0, :])
    for plane, shift in enumerate(range(bits, 8 - bits, bits), start=1):  # the planes between (2 bits: two)
        torch.bitwise_and(packed >> shift, mask, out=planes[..., plane, :])
    torch.bitwise_right_shift(packed, 8 - bits, out=planes[..., -1, :])
    return codes


def take_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`table[b, h, index[b, h, i]]` for a contiguous `[B, H, R, ...]` table and `[B, H, n]` index: whole rows
    copied (an index_select), much cheaper than an element-wise gather of the expanded index."""
    batch, heads, rows = table.shape[:3]
    offsets = torch.arange(batch * heads, device=index.device).view(batch, heads, 1) * rows
    picked = table.reshape(batch * heads * rows, -1).index_select(0, (index + offsets).reshape(-1))
    return picked.view(*index.shape, *table.shape[3:])


def put_rows(table: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """`table[b, h, index[b, h, i]] = rows[b, h, i]` for a contiguous `[B, H, R, ...]` table: whole rows copied (an
    index_copy). Where `index` repeats a row, which copy lands there is unspecified."""
    batch, heads, count = table.shape[:3]
    offsets = torch.arange(batch * heads, device=index.device).view(batch, heads, 1) * count
    table.view(batch * heads * count, -1).index_copy_(0, (index + offsets).reshape(-1),
                                                      rows.reshape(index.numel(), -1))


def quantize(x: torch.Tensor, low: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Asymmetric round-to-nearest codes of `x` on the grid `low + k * scale`, k in [0, 2**bits - 1]."""
    return ((x.float() - low.float()) / scale.float()).round_().clamp_(0, 2**bits - 1)


def grid(low: torch.Tensor, high: torch.Tensor, bits: int) -> torch.Tensor:
    """The step of a `bits`-bit grid spanning [low, high] (never zero, so a constant group still divides)."""
    return ((high.float() - low.float()) / (2**bits - 1)).clamp_(min=1e-8)


def _whole_bytes(bits: int, head_dim: int) -> None:
    if head_dim * bits % 8:
        raise ValueError(f"{bits}-bit codes of head_dim {head_dim} fill no whole byte")


@dataclass
class Codec:
    """Stores entries as they are (the model dtype): the full-precision tier."""

    # whether `forget_before` can give memory back: only then does the caller find the oldest position it holds
    frees_rows: ClassVar[bool] = False

    def fields(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-slot field name -> (trailing shape, dtype)."""
        return {"x": ((head_dim,), dtype)}

    def encode(self, x: torch.Tensor, positions: torch.Tensor, chosen: torch.Tensor, newest: int) -> Fields:
        """Fields for every slot of `x` `[B, H, n, D]`; only the `chosen` ones `[B, H, n]` are kept by the caller
        (a codec with a table fills it from those alone). `newest` is the newest position the caller holds, counted
        on the host (a table grows to it without reading `positions` back from the device)."""
        return {"x": x}

    def decode(self, fields: Fields, positions: Positions, out: torch.Tensor | None = None) -> torch.Tensor:
        """The entries `[B, H, n, D]` in the model dtype, written into `out` when given."""
        return fields["x"] if out is None else out.copy_(fields["x"])

    def table_bytes(self, positions: Positions | None = None, held: torch.Tensor | None = None) -> int:
        """Bytes of the layer-wide table: all of it, or the part the `held` `[B, H, n]` slots at `positions` use
        (a range: positions every head holds)."""
        return 0

    def fit(self, head_dim: int) -> None:
        """Check this codec against the model's head_dim (ValueError: why it cannot store it)."""

    def forget_before(self, position: int) -> None:
        """No entry older than `position` is held any more: a table may drop what served only those."""

    def has_row(self, position: int) -> bool:
        """Whether the table already has room for `position` (if it frees rows: else it never grows)."""
        return True

    def choose_channels(self, scores: torch.Tensor) -> None:
        """Given each KV head's channel scores `[B, H, D]` before the first entry is encoded (a layout with
        `channel_scores`): a codec that keeps some channels keeps the best; the others ignore them."""

    def kept_channels(self) -> torch.Tensor | None:
        """`[B, H, kept]`: the channels each head stores, if not all."""
        return None

    def entry_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        return sum(math.prod(shape) * kind.itemsize for shape, kind in self.fields(head_dim, dtype).values())


@dataclass
class TokenQuant(Codec):
    """Each token quantized on its own: `bits`-bit codes, one scale and zero-point per `group` channels (KIVI's
    values; mixed precision's keys and values)."""

    bits: int = 4
    group: int = 32

    def fit(self, head_dim: int) -> None:
        self.group = min(self.group, head_dim)  # a channel group wider than a head is the head
        if head_dim % self.group:
            raise ValueError(f"group_size {self.group} does not divide head_dim {head_dim}")
        _whole_bytes(self.bits, head_dim)

    def fields(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        groups = head_dim // self.group
        return {"codes": ((head_dim * self.bits // 8,), torch.uint8), "low": ((groups,), dtype),
                "scale": ((groups,), dtype)}

    def encode(self, x: torch.Tensor, positions: torch.Tensor, chosen: torch.Tensor, newest: int) -> Fields:
        grouped = x.unflatten(-1, (-1, self.group))
        low, high = grouped.aminmax(dim=-1)
        low, scale = low.to(x.dtype), grid(low, high, self.bits).to(x.dtype)
        codes = quantize(grouped, low[..., None], scale[..., None], self.bits).flatten(-2)
        return {"codes": pack(codes, self.bits), "low": low, "scale": scale}

    def decode(self, fields: Fields, positions: Positions, out: torch.Tensor | None = None) -> torch.Tensor:
        codes = unpack(fields["codes"], self.bits, out).unflatten(-1, (-1, self.group))
        low, scale = fields["low"].float()[..., None], fields["scale"].float()[..., None]
        if out is None:
            return torch.addcmul(low, codes, scale).flatten(-2).to(fields["low"].dtype)
        torch.addcmul(low, codes, scale, out=codes)  # the codes were unpacked into `out`: decoded in place
        return out


@dataclass
class ChannelQuant(Codec):
    """KIVI's keys: each channel quantized over a group of `group` consecutive tokens (keys have outlier
    channels, so a per-channel range keeps the others fine). The scales and zero-points are a table with one
    row per token group, beside the slots; a group's row is set when it is encoded. Rows of groups that no
    slot holds any more are dropped from the front (evicting old tokens gives their rows back)."""

    bits: int = 4
    group: int = 32
    low: torch.Tensor | None = field(default=None, repr=False)  # [B, H, groups, D]
    scale: torch.Tensor | None = field(default=None, repr=False)
    first: int = 0  # the token group of row 0
    frees_rows: ClassVar[bool] = True

    def forget_before(self, position: int) -> None:
        dead = position // self.group - self.first
        if self.low is None or self.scale is None or dead < self.low.shape[2] // 2:  # amortized: once half is dead
            return
        self.low, self.scale = self.low[:, :, dead:].clone(), self.scale[:, :, dead:].clone()
        self.first += dead

    def has_row(self, position: int) -> bool:
        return self.low is not None and position // self.group - self.first < self.low.shape[2]

    def fit(self, head_dim: int) -> None:
        _whole_bytes(self.bits, head_dim)

    def fields(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"codes": ((head_dim * self.bits // 8,), torch.uint8)}

    def encode(self, x: torch.Tensor, positions: torch.Tensor, chosen: torch.Tensor, newest: int) -> Fields:
        rows = self._row_of(positions)
        used = newest // self.group - self.first + 1
        table_low, table_scale = self._grow(used, x)
        # each chosen slot's channels reduce into its group's row; the others into a spare row past the end
        target = torch.where(chosen, rows, used)[..., None].expand_as(x)
        low = torch.full(x.shape[:2] + (used + 1, x.shape[-1]), float("inf"), device=x.device)
        high = torch.full_like(low, float("-inf"))
        low.scatter_reduce_(2, target, x.float(), "amin")
        high.scatter_reduce_(2, target, x.float(), "amax")
        low, high = low[:, :, :used], high[:, :, :used]
        touched = torch.isfinite(low)  # rows of the groups encoded now
        table_low[:, :, :used] = torch.where(touched, low, table_low[:, :, :used])
        table_scale[:, :, :used] = torch.where(touched, grid(low, high, self.bits), table_scale[:, :, :used])
        codes = quantize(x, *self._rows(positions), self.bits)
        return {"codes": pack(codes, self.bits)}

    def decode(self, fields: Fields, positions: Positions, out: torch.Tensor | None = None) -> torch.Tensor:
        codes = unpack(fields["codes"], self.bits, out)
        shape = codes.shape
        groups = self._groups(positions)
        table_low, table_scale = self._table()
        if groups is None:  # a row per slot, gathered
            low, scale = self._rows(_as_tensor(positions, codes))
        else:  # whole token groups in order: each row serves its group's slots by broadcasting, nothing gathered
            low, scale = table_low[:, :, groups, None], table_scale[:, :, groups, None]
            codes = codes.unflatten(2, (-1, self.group))
        if out is not None:  # the codes were unpacked into `out`: decoded in place
            torch.addcmul(low.float(), codes, scale.float(), out=codes)
            return out
        return torch.addcmul(low.float(), codes, scale.float()).to(table_low.dtype).view(shape)

    def table_bytes(self, positions: Positions | None = None, held: torch.Tensor | None = None) -> int:
        if self.low is None:
            return 0
        row_bytes = 2 * self.low.shape[-1] * self.low.element_size()
        if positions is None:
            return self.low.shape[:3].numel() * row_bytes
        if isinstance(positions, range):  # counted on the host
            rows = (positions.stop - 1) // self.group - positions.start // self.group + 1 if positions else 0
            return self.low.shape[0] * self.low.shape[1] * rows * row_bytes
        assert held is not None, "positions held per slot come with the slots that hold them"
        used = torch.zeros(self.low.shape[:3], dtype=torch.bool, device=self.low.device)
        used.scatter_(2, self._row_of(positions).clamp(0, self.low.shape[2] - 1), held)
        return int(used.sum()) * row_bytes  # a row counts once, however many of its tokens a head still holds

    def _groups(self, positions: Positions) -> slice | None:
        """The table rows of `positions` if they are whole token groups in order (a range), else None."""
        if not isinstance(positions, range) or positions.start % self.group or len(positions) % self.group:
            return None
        first = positions.start // self.group - self.first
        return slice(first, first + len(positions) // self.group)

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        low, scale = self._table()
        index = self._row_of(positions).clamp(0, low.shape[2] - 1)
        return take_rows(low, index), take_rows(scale, index)

    def _table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The zero-points and scales, which the first encode made."""
        assert self.low is not None and self.scale is not None, "an entry is encoded before any is read"
        return self.low, self.scale

    def _row_of(self, positions: torch.Tensor) -> torch.Tensor:
        return positions // self.group - self.first

    def _grow(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The table, with at least `rows` rows."""
        have = 0 if self.low is None else self.low.shape[2]
        if rows <= have:
            return self._table()
        rows = max(rows, 2 * have)  # amortized: the table grows by doubling
        shape = like.shape[:2] + (rows, like.shape[-1])
        low, scale = torch.zeros(shape, dtype=like.dtype, device=like.device), torch.ones(
            shape, dtype=like.dtype, device=like.device)
        if self.low is not None and self.scale is not None:
            low[:, :, :have], scale[:, :, :have] = self.low, self.scale
        self.low, self.scale = low, scale
        return low, scale


@dataclass
class LowRank(Codec):
    """Coefficients on the top-`rank` right singular vectors of the entries first encoded (the prompt), per
    KV head; entries encoded later are projected on the same basis. rank = head_dim reconstructs exactly."""

    rank: int = 32
    basis: torch.Tensor | None = field(default=None, repr=False)  # [B, H, D, rank], orthonormal columns

    def fit(self, head_dim: int) -> None:
        if not 0 < self.rank <= head_dim:
            raise ValueError(f"rank must be in [1, head_dim={head_dim}], got {self.rank}")

    def fields(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"coefficients": ((self.rank,), dtype)}

    def encode(self, x: torch.Tensor, positions: torch.Tensor, chosen: torch.Tensor, newest: int) -> Fields:
        if self.basis is None:
            self.basis = self._fit(x, chosen)
        return {"coefficients": (x.float() @ self.basis.float()).to(x.dtype)}

    def decode(self, fields: Fields, positions: Positions, out: torch.Tensor | None = None) -> torch.Tensor:
        assert self.basis is not None, "the basis is fitted by the first encode"
        x = (fields["coefficients"].float() @ self.basis.float().transpose(-1, -2)).to(self.basis.dtype)
        return x if out is None else out.copy_(x)

    def table_bytes(self, positions: Positions | None = None, held: torch.Tensor | None = None) -> int:
        return 0 if self.basis is None else self.basis.numel() * self.basis.element_size()

    def _fit(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        # the first encode is the prompt's: every head holds the same slots, so slot selection is shared
        prompt = x[:, :, chosen[0, 0]].float()
        directions = torch.linalg.svd(prompt, full_matrices=False).Vh.transpose(-1, -2)  # [B, H, D, min(n, D)]
        basis = torch.zeros(*x.shape[:2], x.shape[-1], self.rank, device=x.device)
        kept = min(self.rank, directions.shape[-1])  # a prompt shorter than the rank spans fewer directions
        basis[..., :kept] = directions[..., :kept]
        return basis.to(x.dtype)


@dataclass
class KeyChannels(Codec):
    """ThinK's keys: each KV head stores only the channels it keeps, `head_dim - int(head_dim x pruned)` of them
    (the fewest kvpress's ThinKPress keeps), chosen once by `choose_channels`; the table is their indices
    `[B, H, kept]`. A pruned channel decodes as zero, so a query's dot product sums over the kept channels only:
    what kvpress computes on keys whose pruned channels it zeroes, in fewer bytes."""

    pruned: float = 0.5
    head_dim: int = 0  # set by `fit`
    kept: int = 0
    channels: torch.Tensor | None = field(default=None, repr=False)  # [B, H, kept] int64, ascending

    def fit(self, head_dim: int) -> None:
        self.head_dim, self.kept = head_dim, head_dim - int(head_dim * self.pruned)
        if self.kept < 1:
            raise ValueError(f"pruning {self.pruned} of head_dim {head_dim} leaves no key channel")

    def choose_channels(self, scores: torch.Tensor) -> None:
        self.channels = scores.topk(self.kept, dim=-1).indices.sort(dim=-1).values

    def kept_channels(self) -> torch.Tensor | None:
        return self.channels

    def fields(self, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"x": ((self.kept,), dtype)}

    def encode(self, x: torch.Tensor, positions: torch.Tensor, chosen: torch.Tensor, newest: int) -> Fields:
        assert self.channels is not None, "the key channels are chosen before the first entry is stored"
        return {"x": x.gather(-1, self._index(x))}

    def decode(self, fields: Fields, positions: Positions, out: torch.Tensor | None = None) -> torch.Tensor:
        kept = fields["x"]
        if out is None:
            out = kept.new_empty(*kept.shape[:-1], self.head_dim)
        return out.zero_().scatter_(-1, self._index(out), kept)

    def table_bytes(self, positions: Positions | None = None, held: torch.Tensor | None = None) -> int:
        return 0 if self.channels is None else self.channels.numel() * self.channels.element_size()

    def _index(self, like: torch.Tensor) -> torch.Tensor:
        """The kept channels' indices, one row per slot of `like` `[B, H, n, ...]`."""
        assert self.channels is not None, "the key channels are chosen before the first entry is stored"
        return self.channels[:, :, None, :].expand(*like.shape[:3], self.kept)


def _as_tensor(positions: Positions, like: torch.Tensor) -> torch.Tensor:
    """`positions` as a `[B, H, n]` tensor on `like`'s device."""
    if isinstance(positions, torch.Tensor):
        return positions
    return torch.arange(positions.start, positions.stop, device=like.device).expand(*like.shape[:2], len(positions))
