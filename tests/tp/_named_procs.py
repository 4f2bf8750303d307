"""A rank > 0 of a tensor-parallel instance met by name (kvcached.tp.named), as a real process,
for tests/tp/test_named.py.

``python tests/tp/_named_procs.py PID START NS RANK WORLD WORKDIR PAGE_BYTES`` joins, as RANK, the
instance that the process of identity (PID, START, NS) leads, on the host backend; makes the KV
tensors of tests/tp/_tp_procs.py's shape; creates WORKDIR/ready<RANK>; then serves until the leader
shuts kvcached down (exit 0) or is lost (exit 1).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for path in (REPO, os.path.join(REPO, "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

import _tp_procs as tp_procs
import torch

from kvcached import alloc_kv_cache, init_kvcached, shutdown_kvcached, wait_for_scheduler
from kvcached.tp import named


def main(pid: int, start: int, ns: int, rank: int, world_size: int, workdir: str, page_bytes: int) -> int:
    tp_procs.configure(page_bytes)
    link = named.join((pid, start, ns), rank, world_size, tp_procs.WAIT_S)
    init_kvcached(tp_rank=rank, world_size=world_size, device="cpu", page_size_bytes=page_bytes, tp_link=link)
    alloc_kv_cache((2, tp_procs.NUM_BLOCKS, tp_procs.BLOCK, tp_procs.HEADS, tp_procs.DIM), tp_procs.BLOCK,
                   torch.float32, "cpu", tp_procs.LAYERS)
    tp_procs.touch(os.path.join(workdir, f"ready{rank}"))
    stopped = wait_for_scheduler(tp_procs.WAIT_S)
    shutdown_kvcached()
    return 0 if stopped else 1


if __name__ == "__main__":
    sys.exit(main(*map(int, sys.argv[1:6]), sys.argv[6], int(sys.argv[7])))
