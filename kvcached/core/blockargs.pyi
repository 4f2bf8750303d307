"""Types of the Python-visible surface of kvcached.core.blockargs (Cython): none.

Its functions are ``cdef`` (the block allocator's, through blockargs.pxd) and invisible to Python;
BlockAllocator's stub (blockalloc.pyi) types what they accept. Keep in step with blockargs.pxd.
"""
