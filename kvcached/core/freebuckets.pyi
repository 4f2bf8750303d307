"""kvcached.core.freebuckets (Cython) has no Python-visible names: FreeBuckets is a C struct whose
operations are declared in freebuckets.pxd. PageBuckets, its Python surface for tests, is in
kvcached.core._probes."""
