"""Operator tools: ``kvctl`` (inspect instances, change limits and budgets) and ``kvtop`` (live
view). They read the shared-memory segments only, so they import neither torch nor the compiled
core and start in a few tens of milliseconds."""
