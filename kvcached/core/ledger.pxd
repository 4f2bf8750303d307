# The C-level contract of kvcached.core.ledger: LedgerBackend, a backend that keeps the books of
# a page table without memory behind them, for a tensor-parallel leader that owns no device
# (Note [Leader without pages] in ledger.pyx). Its primitives never fail but as HostBackend's
# reservations do; nothing of the core cimports it.

from libc.stdint cimport uint64_t

from kvcached.core.hostmem cimport HostBackend


cdef class LedgerBackend(HostBackend):
    cdef uint64_t next_handle                   # the next bookkeeping handle (never 0); under _lock
