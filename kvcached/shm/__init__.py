"""kvcached's shared memory under /dev/shm: what operators see of each instance, and the budgets.

- ``segment``: an instance segment's format, its seqlock, a reader's ``Snapshot``.
- ``owner``: ``MemInfoTracker``, what the owning process writes into its segment.
- ``client``: what ``kvctl`` and ``kvtop`` use: read, list, request a limit, delete, gc.
- ``budget``: the global budget several instances share, with a slot per holder.
- ``poller``: the one thread per process that beats every heartbeat, answers limit requests
  and publishes every manager's usage.
- ``files``: process identity and the file helpers the segments and the budgets share.

Pure Python, imports neither torch nor the compiled core (``kvctl`` must start fast).
"""
