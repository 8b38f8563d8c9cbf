"""Metadata of one ragged forward: which slot and positions each request's new tokens occupy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.models.cpu_attention import DecodeAttention, decode_attention

# Requests adding at most this many tokens (decode and verification rows) share one padded
# attention call per layer; longer prompt chunks attend one request at a time.
SHORT_ROW_TOKENS = 32
# A group whose slots span at most this many times its requests attends over that span of the
# cache in place; gathering every request's cache prefix instead copies all of it, every layer.
SPAN_SLACK = 2


@dataclass
class ShortGroup:
    """Requests whose queries are padded to [num_rows, n_max] and attend in one call."""

    # How the cache is read: the slot of a lone request, a slice of slots read in place (row r is
    # slot start + r; rows of slots outside the group are padding), or [R_s] slots to gather.
    slots: int | slice | torch.Tensor
    tokens: torch.Tensor  # [T_s] flattened token indices
    rows: torch.Tensor  # [T_s] padded row of each token
    cols: torch.Tensor  # [T_s] position of each token inside its row
    num_rows: int
    max_new: int
    max_len: int  # longest cache prefix attended (start + n)
    mask: torch.Tensor | None  # [R_s, 1, n_max, max_len] bool; None when nothing needs masking
    covers_all: bool  # the group is the whole batch: its tokens are 0..T-1 in order
    dense: bool  # covers_all, rows are the requests in order with n_max tokens each: a view of q
    decode: DecodeAttention | None = None  # on the CPU, a dense group read in place: one kernel call a layer


@dataclass
class ForwardBatch:
    """Requests contribute `lengths[i]` new tokens at positions `starts[i]..` of KV slot `slots[i]`.

    Tokens are flattened request after request; `logit_rows` selects the flattened tokens whose
    logits are needed (the last token of a prefill chunk, every token of a verification).
    """

    slots: list[int]
    starts: list[int]
    lengths: list[int]
    offsets: list[int]  # start of each request in the flattened token axis (len = R + 1)
    positions: torch.Tensor  # [T] int64
    token_slots: torch.Tensor  # [T] int64
    logit_rows: torch.Tensor  # [N] int64
    short: ShortGroup | None
    long_rows: list[int]  # requests that attend alone (long prompt chunks)

    @classmethod
    def build(
        cls,
        slots: list[int],
        starts: list[int],
        lengths: list[int],
        logit_rows: list[int],
        device: torch.device,
    ) -> ForwardBatch:
        lengths_t = torch.tensor(lengths, dtype=torch.int64)
        starts_t = torch.tensor(starts, dtype=torch.int64)
        offsets_t = torch.cat([torch.zeros(1, dtype=torch.int64), lengths_t.cumsum(0)])
        request_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lengths_t)
        col = torch.arange(int(offsets_t[-1])) - offsets_t[request_of_token]
        positions = starts_t[request_of_token] + col
        short_ids = [i for i, n in enumerate(lengths) if n <= SHORT_ROW_TOKENS]
        return cls(
            slots=slots,
            starts=starts,
            lengths=lengths,
            offsets=offsets_t.tolist(),
            positions=positions.to(device),
            token_slots=torch.tensor(slots, dtype=torch.int64)[request_of_token].to(device),
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=device),
            short=_short_group(short_ids, slots, starts_t, lengths_t, offsets_t, device, len(lengths))
            if short_ids
            else None,
            long_rows=[i for i, n in enumerate(lengths) if n > SHORT_ROW_TOKENS],
        )

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]


def _short_group(
    ids: list[int],
    slots: list[int],
    starts: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    device,
    num_requests: int,
) -> ShortGroup:
    idx = torch.tensor(ids, dtype=torch.int64)
    n, s = lengths[idx], starts[idx]
    group = [slots[i] for i in ids]
    lo, hi = min(group), max(group) + 1
    in_place = len(ids) > 1 and hi - lo <= SPAN_SLACK * len(ids)
    group_slots = torch.tensor(group, dtype=torch.int64)
    if in_place:  # padded row = slot - lo; slots outside the group add padding rows with no queries
        row_of_request, num_rows = group_slots - lo, hi - lo
        row_n = torch.zeros(num_rows, dtype=torch.int64).index_copy_(0, row_of_request, n)
        row_s = torch.zeros(num_rows, dtype=torch.int64).index_copy_(0, row_of_request, s)
    else:
        row_of_request, num_rows, row_n, row_s = torch.arange(len(ids)), len(ids), n, s
    request_of_token = torch.repeat_interleave(torch.arange(len(ids)), n)
    cols = (
        torch.arange(int(n.sum()))
        - torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)[:-1]])[request_of_token]
    )
    tokens = offsets[idx][request_of_token] + cols
    max_new, max_len = int(n.max()), int((s + n).max())
    mask = None
    if max_new > 1 or num_rows > 1:
        keys = torch.arange(max_len)[None, None, :]
        query_pos = row_s[:, None, None] + torch.arange(max_new)[None, :, None]
        valid_query = torch.arange(max_new)[None, :, None] < row_n[:, None, None]
        # Padding queries see key 0 only, so no softmax row is empty.
        mask = torch.where(valid_query, keys <= query_pos, keys == 0)[:, None].to(device)
    covers_all = len(ids) == num_requests
    rows_in_order = not in_place or group == list(range(lo, hi))
    if len(ids) == 1:
        slot_index: int | slice | torch.Tensor = group[0]
    else:
        slot_index = slice(lo, hi) if in_place else group_slots.to(device)
    dense = covers_all and rows_in_order and max_new * len(ids) == len(tokens)
    decode = None
    if dense and torch.device(device).type == "cpu" and not isinstance(slot_index, torch.Tensor):
        decode = decode_attention(slot_index, num_rows, max_new, max_len, mask)
    return ShortGroup(
        slots=slot_index,
        tokens=tokens.to(device),
        rows=row_of_request[request_of_token].to(device),
        cols=cols.to(device),
        num_rows=num_rows,
        max_new=max_new,
        max_len=max_len,
        mask=mask,
        covers_all=covers_all,
        dense=dense,
        decode=decode,
    )
