"""Real processes running real KVCacheManagers (host backend) for tests/shm/test_sharing.py.

Run as ``python tests/shm/_sharing_procs.py manager NAME [options]`` (PYTHONPATH = repository root).
The process builds one KVCacheManager over small pages (no torch: blocks are stamped and checked
through ctypes at their real addresses), prints one JSON line ``{"ready": ...}``, then serves one
command per stdin line, answering each with one JSON line:

  alloc N            -> {"ok": bool, "held_blocks": int}
  free_all           -> {"held_blocks": 0}
  churn SECONDS SEED -> random alloc/free for SECONDS; {"allocs", "refused", "frees", "checks"}
  state              -> {"mapped_bytes", "limit", "stats", "held_blocks"}
  limit BYTES REV    -> what set_memory_limit returned
  demand BLOCKS      -> {"ok": true}  (report_demand)
  free_blocks N      -> {"held_blocks": int}  (the N most recently allocated blocks freed)
  share              -> {"share": share(), "over": over_limit_blocks(), "mapped_bytes",
                         "reserved_pages", "held_blocks"}
  close              -> {"closed": true}  (shutdown_kvcached: every page unmapped)

It exits (shutting kvcached down) when stdin closes. Every block handed out is stamped with a
value of its allocation and checked when freed: two live blocks sharing memory, or a page
unmapped under a live block, fails the process loudly.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

PAGE_SIZE_BYTES = 64 << 10       # host granularity of the tests: a page id maps L*2 of these
BLOCK_BYTES = 1 << 10            # one block of one layer and buffer
NUM_LAYERS = 2


def say(record: dict) -> None:
    print(json.dumps(record), flush=True)


class Worker:
    def __init__(self, num_blocks: int, limit_bytes: int | None) -> None:
        from kvcached import KVCacheManager, init_kvcached
        from kvcached.runtime import runtime

        init_kvcached(device="cpu", page_size_bytes=PAGE_SIZE_BYTES)
        # cell_size * block_size = BLOCK_BYTES
        self.m = KVCacheManager(num_blocks, 16, BLOCK_BYTES // 16, NUM_LAYERS)
        group = runtime().groups[0]
        self.layout, self.ranges = group.layout, group.ranges
        self.held: list[tuple[list[int], int]] = []   # (ids, stamp) per allocation
        self.next_stamp = (os.getpid() << 20) + 1
        self.checks = 0
        if limit_bytes is not None:
            state = self.m.set_memory_limit(limit_bytes, revision=1)
            assert state["status"] in ("applied", "deferred"), state

    def _cells(self, block_id: int):
        for layer, buffer in ((0, 0), (NUM_LAYERS - 1, 1)):
            r, offset = self.layout.byte_location(block_id, layer, buffer)
            yield ctypes.c_int64.from_address(self.ranges[r].address + offset)

    def alloc(self, n: int) -> bool:
        ids = self.m.alloc(n)
        if ids is None:
            return False
        stamp, self.next_stamp = self.next_stamp, self.next_stamp + 1
        for b in ids:
            for cell in self._cells(b):
                cell.value = stamp
        self.held.append((ids, stamp))
        return True

    def free(self, index: int) -> None:
        ids, stamp = self.held.pop(index)
        for b in ids:
            for cell in self._cells(b):
                if cell.value != stamp:
                    raise AssertionError(f"block {b} holds {cell.value}, not its stamp {stamp}: "
                                         "its memory was shared or remapped while live")
        self.checks += len(ids)
        self.m.free(ids)

    def free_all(self) -> None:
        while self.held:
            self.free(len(self.held) - 1)

    def free_blocks(self, n: int) -> None:
        while n > 0:
            ids, stamp = self.held[-1]
            if len(ids) > n:          # free the tail of the last allocation, keep its head
                self.held[-1] = (ids[:-n], stamp)
                self.held.append((ids[-n:], stamp))
            n -= len(self.held[-1][0])
            self.free(len(self.held) - 1)

    def held_blocks(self) -> int:
        return sum(len(ids) for ids, _ in self.held)

    def churn(self, seconds: float, seed: int) -> dict:
        rng = random.Random(seed)
        bpp = self.m.page_bytes // (BLOCK_BYTES * NUM_LAYERS * 2)
        cap = self.m.num_blocks * 3 // 4
        allocs = refused = frees = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.held and (rng.random() < 0.5 or self.held_blocks() > cap):
                self.free(rng.randrange(len(self.held)))
                frees += 1
            elif self.alloc(rng.randint(1, 2 * bpp)):
                allocs += 1
            else:
                refused += 1
                time.sleep(0.0005)
        return {"allocs": allocs, "refused": refused, "frees": frees, "checks": self.checks}

    def state(self) -> dict:
        return {"mapped_bytes": int(self.m.get_mapped_memory_size()), "limit": self.m.memory_limit(),
                "stats": self.m._pages.stats(), "held_blocks": self.held_blocks()}


def role_manager(args: argparse.Namespace) -> None:
    worker = Worker(args.blocks, args.limit)
    m = worker.m
    say({"ready": True, "pid": os.getpid(), "ipc_name": m.ipc_name, "page_bytes": m.page_bytes,
         "num_pages": m.num_pages, "blocks_per_page": m.page_bytes // (BLOCK_BYTES * NUM_LAYERS * 2)})
    from kvcached import shutdown_kvcached

    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "alloc":
            say({"ok": worker.alloc(int(rest[0])), "held_blocks": worker.held_blocks()})
        elif cmd == "free_all":
            worker.free_all()
            say({"held_blocks": 0})
        elif cmd == "churn":
            say(worker.churn(float(rest[0]), int(rest[1])))
        elif cmd == "state":
            say(worker.state())
        elif cmd == "demand":
            m.report_demand(int(rest[0]))
            say({"ok": True})
        elif cmd == "free_blocks":
            worker.free_blocks(int(rest[0]))
            say({"held_blocks": worker.held_blocks()})
        elif cmd == "share":
            say({"share": m.share(), "over": m.over_limit_blocks(),
                 "mapped_bytes": int(m.get_mapped_memory_size()),
                 "reserved_pages": m._pages.stats()["reserved"], "held_blocks": worker.held_blocks()})
        elif cmd == "limit":
            say(m.set_memory_limit(int(rest[0]), revision=int(rest[1])))
        elif cmd == "close":
            worker.free_all()
            shutdown_kvcached()
            say({"closed": True})
        else:
            raise SystemExit(f"unknown command {line!r}")
    shutdown_kvcached()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="role", required=True)
    p = sub.add_parser("manager")
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--limit", type=int, default=None, help="limit set at revision 1")
    p.set_defaults(run=role_manager)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
