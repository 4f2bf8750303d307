"""Integrations of kvcached into serving engines, built on the public API like any engine.

Nothing here is imported by ``import kvcached``, and importing a submodule changes no engine:
each integration is switched on by an explicit call (see ``kvcached.integration.vllm``).
"""
