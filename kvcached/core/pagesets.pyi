"""kvcached.core.pagesets (Cython) has no Python-visible names: FreeSet, PoolStack, PendingRing and
PageLedger are C structs whose operations are declared in pagesets.pxd. Their test hooks are in
kvcached.core._probes."""
