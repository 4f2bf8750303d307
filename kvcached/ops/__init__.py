"""Paged attention over kvcached tensors: write K/V into blocks, attend through block tables."""
