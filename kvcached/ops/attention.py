"""paged_attention and paged_decode: attention of a batch's queries over one layer's paged K/V.

Dispatch and the torch implementation: on CUDA, decode batches go to the Triton decode kernel
(triton_decode) and every other batch to the Triton prefill kernel (triton_prefill), one launch
each and no host read of any tensor's contents; on other devices (or without triton) torch ops
run here over the gathered blocks (prefill through ``scaled_dot_product_attention``). Only
blocks a request's positions need are read: entries of a block table past
``ceil(seq_len / block_size)``, and blocks wholly before a sliding window, never are, and neither
are slots past ``seq_len``. The entries that are read must be ids of held blocks: the CPU path
refuses any other, CUDA takes them on trust. See Note [Block table contract].
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F

from ..checks import as_int
from ..errors import KVCachedArgumentError
from ._args import (
    CacheGeometry,
    cache_geometry,
    check_index,
    check_query_heads,
    check_scale,
    check_tokens,
    check_window,
)

logger = logging.getLogger("kvcached")
_triton_installed: bool | None = None


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, *, sliding_window: int | None = None,
                 kv_layout: str = "NHD") -> torch.Tensor:
    """Attention of one query token per sequence, ``query [B, H, D]`` -> ``[B, H, D]``.

    ``block_tables [B, max_blocks]`` lists each sequence's blocks in order; ``seq_lens [B]``
    counts its cached tokens, the current one included (written with write_kv first), at least 1.
    Row r's entries up to ``ceil(seq_lens[r] / block_size)`` (from the window's first block on)
    must be ids of held blocks; those past it are never read, so -1 padding there is fine. H is
    a multiple of the caches' KV heads (GQA: query head h reads KV head h // (H / KVH)).
    ``sliding_window`` w: the query sees only the last w positions. The Triton kernel on CUDA,
    torch elsewhere. block_tables and seq_lens are int32 or int64, on the caches' device.
    O(sum(seq_lens) * H * D).

    Raises TypeError/ValueError for shapes, dtypes or devices that do not match (and, on CPU,
    seq_lens outside [1, max_blocks * block_size]); on CPU KVCachedArgumentError (a ValueError)
    for a negative or out-of-range id among the entries read. On CUDA the ids are not checked
    (it would cost a device sync): a bad one reads another block or faults. See Note [Block table
    contract].
    """
    geometry = cache_geometry(k_cache, v_cache, kv_layout)
    window = check_window(sliding_window)
    scale = check_scale(scale)
    _check_query(query, geometry, k_cache)
    batch = query.shape[0]
    _check_tables(block_tables, seq_lens, batch, k_cache.device)
    return _decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window, geometry, kv_layout)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *,
                    sliding_window: int | None = None, kv_layout: str = "NHD", num_decodes: int = 0) -> torch.Tensor:
    """Causal attention of a packed batch, ``query [T, H, D]`` -> ``[T, H, D]``.

    Request r's queries are ``query[query_start_loc[r]:query_start_loc[r+1]]`` (at least one),
    the last ``q_len`` positions of its ``seq_lens[r]`` cached tokens (written with write_kv
    first). A query at position p attends to positions <= p, and > p - sliding_window if given.
    Decode-only batches (T == B: every q_len is 1) take paged_decode's path; on CUDA every other
    batch is one launch of the Triton prefill kernel (chunked prefills and decode rows mixed), and
    nothing is read back to the host, so a step can be captured in a CUDA graph. Elsewhere (or
    without triton) torch SDPA per request. Index tensors int32 or int64, as paged_decode's.
    O(sum(q_len * seq_len) * H * D).

    Block tables as paged_decode: the entries a request's positions need must be held blocks'
    ids, those past ``ceil(seq_len / block_size)`` are never read.

    ``num_decodes`` n (host metadata a scheduler has; 0 when unknown) says that the first n
    requests have one query each, as a continuous-batching step puts its decoding requests
    first: on CUDA those go to the decode kernel and the rest to the prefill kernel, two
    launches, so that decode rows read their K/V at the decode kernel's rate instead of in
    mostly idle prefill tiles (Note [Decode rows of a mixed step]).

    Raises TypeError/ValueError as paged_decode, and for a query_start_loc that does not fit
    (KVCachedArgumentError for a num_decodes outside [0, B], and on the CPU for one whose
    requests do not all have one query). On
    CUDA only shapes are checked: query_start_loc rising from 0 to T with every q_len in
    [1, seq_lens[r]], seq_lens within the table and the block ids it reads are the caller's
    contract, as a bad one reads wrong data or faults. See Note [Block table contract].
    """
    geometry = cache_geometry(k_cache, v_cache, kv_layout)
    window = check_window(sliding_window)
    scale = check_scale(scale)
    _check_query(query, geometry, k_cache)
    batch = block_tables.shape[0] if isinstance(block_tables, torch.Tensor) and block_tables.dim() == 2 else -1
    _check_tables(block_tables, seq_lens, batch, k_cache.device)
    check_index("query_start_loc", query_start_loc, (batch + 1,), k_cache.device)
    num_decodes = as_int(num_decodes, "num_decodes", minimum=0, maximum=max(batch, 0),
                         hint="the leading requests with one query each", error=KVCachedArgumentError)
    tokens = query.shape[0]
    if query.is_cuda:
        if tokens == batch:
            return _decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window, geometry, kv_layout)
        if _triton_available():
            return _mixed_triton(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window,
                                 geometry, num_decodes)
    # The torch path reads the descriptors on the host anyway: check their contents here.
    starts = query_start_loc.tolist()
    lens = [b - a for a, b in zip(starts, starts[1:])]
    if starts[0] != 0 or starts[-1] != tokens or min(lens, default=1) < 1:
        raise ValueError(f"query_start_loc={starts} must rise from 0 to the {tokens} query tokens, "
                         f"each request having at least one")
    r = next((r for r, n in enumerate(lens[:num_decodes]) if n != 1), None)
    if r is not None:
        raise KVCachedArgumentError(f"num_decodes={num_decodes} but request {r} has {lens[r]} queries; the first "
                                    f"num_decodes requests must have one query each (pass 0 when unsure)")
    lens_cached = seq_lens.tolist()
    short = [r for r in range(batch) if lens_cached[r] < lens[r]]
    if short:
        r = short[0]
        raise ValueError(f"request {r} has {lens[r]} queries but seq_lens[{r}]={lens_cached[r]}; seq_lens "
                         f"counts the cached tokens including this step's")
    if tokens == batch:
        return _decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window, geometry, kv_layout)
    return _prefill(query, k_cache, v_cache, block_tables, seq_lens, starts, scale, window, geometry, kv_layout)


# -- checks ----------------------------------------------------------------------------------------

def _check_query(query: torch.Tensor, geometry: CacheGeometry, cache: torch.Tensor) -> None:
    check_tokens("query", query, geometry, cache)
    check_query_heads(query, geometry)


def _check_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, batch: int, device: torch.device) -> None:
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
        shape = tuple(block_tables.shape) if isinstance(block_tables, torch.Tensor) else type(block_tables).__name__
        raise ValueError(f"block_tables has shape {shape}; it must be [batch, max_blocks]")
    check_index("block_tables", block_tables, (batch, block_tables.shape[1]), device)
    check_index("seq_lens", seq_lens, (batch,), device)


def _check_lengths(seq_lens: list[int], capacity: int) -> None:
    bad = [(r, n) for r, n in enumerate(seq_lens) if not 1 <= n <= capacity]
    if bad:
        r, n = bad[0]
        raise ValueError(f"seq_lens[{r}]={n} must be in [1, {capacity}] (max_blocks * block_size of the "
                         f"block table); it counts the cached tokens, this step's included")


def _check_block_ids(block_tables: torch.Tensor, first_block: torch.Tensor, end_block: torch.Tensor,
                     num_blocks: int) -> None:
    """CPU only: the entries that are read, columns [first_block[r], end_block[r]) of row r, are
    ids of the cache's blocks (torch would read -1 as the last). See Note [Block table contract]."""
    columns = torch.arange(block_tables.shape[1])
    read = (columns >= first_block[:, None]) & (columns < end_block[:, None])
    bad = read & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        r, c = bad.nonzero()[0].tolist()
        raise KVCachedArgumentError(
            f"block_tables[{r}, {c}]={int(block_tables[r, c])} is not a block of the cache (ids 0..{num_blocks - 1}); "
            f"row {r} is read at columns {int(first_block[r])}..{int(end_block[r]) - 1}, the blocks its seq_lens "
            f"and window need. Pass only the used prefix per the row's sequence length (entries past "
            f"ceil(seq_len / block_size) are never read: -1 padding there is fine), or point padding at a valid "
            f"block")


# -- decode ----------------------------------------------------------------------------------------

def _decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window, geometry, kv_layout):
    if query.is_cuda and _triton_available():
        from .triton_decode import paged_decode_triton

        return paged_decode_triton(query, k_cache, v_cache, block_tables, seq_lens, scale, window, geometry)
    return decode_torch(query, k_cache, v_cache, block_tables, seq_lens, scale, window, geometry, kv_layout)


def _mixed_triton(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window,
                  geometry: CacheGeometry, num_decodes: int) -> torch.Tensor:
    """A batch that is not decode-only, on CUDA: its first num_decodes requests (one query each)
    through the decode kernel, the others through the prefill kernel, both writing into one
    output. See Note [Decode rows of a mixed step]."""
    from .triton_prefill import paged_prefill_triton

    if not num_decodes:
        return paged_prefill_triton(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window,
                                    geometry)
    from .triton_decode import paged_decode_triton

    d = num_decodes
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    paged_decode_triton(query[:d], k_cache, v_cache, block_tables[:d], seq_lens[:d], scale, window, geometry,
                        out=out[:d])
    paged_prefill_triton(query[d:], k_cache, v_cache, block_tables[d:], seq_lens[d:], query_start_loc[d:], scale,
                         window, geometry, out=out[d:], first_token=d)
    return out


def _triton_available() -> bool:
    """Whether triton is installed, looked up once; warns once when it is not."""
    global _triton_installed
    if _triton_installed is None:
        _triton_installed = importlib.util.find_spec("triton") is not None
        if not _triton_installed:
            logger.warning("triton is not installed: paged attention on CUDA runs the (slower) torch path")
    return _triton_installed


def _gather(cache: torch.Tensor, ids: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """Blocks ``ids [..., n]`` of a cache as tokens ``[..., n * block_size, KVH, D]``."""
    blocks = cache[ids]
    if kv_layout == "HND":
        blocks = blocks.transpose(-3, -2)
    return blocks.flatten(-4, -3)


def decode_torch(query, k_cache, v_cache, block_tables, seq_lens, scale, window, geometry: CacheGeometry,
                 kv_layout: str) -> torch.Tensor:
    """The torch decode path (any device): the needed blocks of every sequence gathered into a
    padded batch, masked, fp32 softmax. Arguments as paged_decode, already checked."""
    batch, heads, head_dim = query.shape
    if batch == 0:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    bs, kv_heads = geometry.block_size, geometry.num_kv_heads
    lens = seq_lens.long()
    if not query.is_cuda:
        _check_lengths(lens.tolist(), block_tables.shape[1] * bs)
    first_token = (lens - window).clamp(min=0) if window is not None else torch.zeros_like(lens)
    first_block = first_token // bs
    num_blocks = (lens - 1) // bs - first_block + 1
    if not query.is_cuda:
        _check_block_ids(block_tables, first_block, first_block + num_blocks, geometry.num_blocks)
    width = int(num_blocks.max())
    cols = torch.arange(width, device=query.device)
    used = cols < num_blocks[:, None]
    # Unused columns repeat the first needed block, so that nothing outside the table is read.
    columns = torch.where(used, first_block[:, None] + cols, first_block[:, None])
    ids = block_tables.long().gather(1, columns)
    keys = _gather(k_cache, ids, kv_layout)                                 # [B, S, KVH, D]
    values = _gather(v_cache, ids, kv_layout)
    positions = first_block[:, None] * bs + torch.arange(width * bs, device=query.device)
    valid = (positions < lens[:, None]) & (positions >= first_token[:, None])   # [B, S]
    q = query.float().reshape(batch, kv_heads, heads // kv_heads, 1, head_dim)
    k = keys.float().permute(0, 2, 3, 1)[:, :, None]                       # [B, KVH, 1, D, S]
    scores = (q @ k).squeeze(-2) * scale                                    # [B, KVH, G, S]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Slots past seq_len hold whatever was there (NaN included): zero them, 0 * NaN would leak.
    v = torch.where(valid[:, :, None, None], values.float(), 0.0).permute(0, 2, 1, 3)   # [B, KVH, S, D]
    out = probs @ v                                                         # [B, KVH, G, D]
    return out.reshape(batch, heads, head_dim).to(query.dtype)


# -- prefill ---------------------------------------------------------------------------------------

def _prefill(query, k_cache, v_cache, block_tables, seq_lens, starts, scale, window, geometry: CacheGeometry,
             kv_layout: str) -> torch.Tensor:
    """Per request: gather the blocks its queries see, SDPA with a causal (and window) mask."""
    bs = geometry.block_size
    group = query.shape[1] // geometry.num_kv_heads
    lens = seq_lens.tolist()
    _check_lengths(lens, block_tables.shape[1] * bs)
    first_tokens = [max(0, seq_len - (b - a) - window + 1) if window is not None else 0
                    for seq_len, a, b in zip(lens, starts, starts[1:])]
    if not query.is_cuda:
        _check_block_ids(block_tables, torch.tensor(first_tokens) // bs, (torch.tensor(lens) - 1) // bs + 1,
                         geometry.num_blocks)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    for r, seq_len in enumerate(lens):
        q = query[starts[r]:starts[r + 1]]                                  # [q_len, H, D]
        first_query = seq_len - q.shape[0]
        first_token = first_tokens[r]
        first_block, end_block = first_token // bs, (seq_len - 1) // bs + 1
        ids = block_tables[r, first_block:end_block].long()
        skip = first_token - first_block * bs
        keys = _gather(k_cache, ids, kv_layout)[skip:seq_len - first_block * bs]      # [S, KVH, D]
        values = _gather(v_cache, ids, kv_layout)[skip:seq_len - first_block * bs]
        q_pos = torch.arange(first_query, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(first_token, seq_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        k = keys.transpose(0, 1).repeat_interleave(group, dim=0)            # [H, S, D]
        v = values.transpose(0, 1).repeat_interleave(group, dim=0)
        out[starts[r]:starts[r + 1]] = F.scaled_dot_product_attention(
            q.transpose(0, 1), k, v, attn_mask=allowed, scale=scale).transpose(0, 1)
    return out


# Note [Decode rows of a mixed step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The prefill kernel takes decode rows too (one launch for any batch), but it gives each a q-tile
# of its own: BLOCK_M = 128 rows of which a GQA group of 4 are used, 8 warps and 96 KiB of shared
# memory per program, so one program per multiprocessor streams the row's K/V through dots 32
# times taller than needed. With Llama-3-8B shapes (64 decoding requests of ~520 tokens beside a
# 512-token chunk) the prefill kernel took a fifth of such a step's device time, twice what the
# decode kernel needs for the same rows (benchmarks/HISTORY.md). A scheduler knows which requests
# decode and puts them first (ServingLoop does: running requests are scheduled oldest first, and
# a request that has its first token is older than the ones still prefilling), so it passes their
# count, a host integer, and the step costs two launches instead of one: the decode kernel over the
# leading rows, the prefill kernel over the rest (its request starts offset by num_decodes, so
# query_start_loc is never rewritten), both writing into one output tensor.
#
# Note [Block table contract]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Row r of a block table is read only where request r's positions lie: from the block of the
# first position its queries see (0, or the sliding window's start) to the block of token
# seq_lens[r] - 1. Entries past ceil(seq_len / block_size) and blocks wholly before the window are
# never read, so -1 padding (the usual value) and released window blocks may stay there. An entry
# that is read must be the id of a block the caller holds. On the CPU a bad one is refused before
# any gather: torch indexing would read -1 as the cache's last block, which on kvcached tensors is
# an unmapped row with small pages (a segfault) and another request's data, or zeros, with the
# default ones (a silently wrong output). The check is a few vector compares over the table, next
# to the attention itself. On CUDA, nothing is checked: reading the table's contents on the host
# would stall the stream on every step (and break graph capture); a bad id there reads another
# block or faults with an illegal address. The same holds for the other descriptors' contents on
# CUDA: query_start_loc must rise from 0 to T with every q_len in [1, seq_lens[r]], and seq_lens
# stay within the table's capacity. The Triton kernels take them as given (a bad query_start_loc
# attends the wrong rows, leaves output rows unwritten or faults); the CPU path checks them.
