"""The fixture of the vLLM contract tests, over tests/conftest.py's kv_env."""

from __future__ import annotations

import pytest


@pytest.fixture
def vllm_kv(kv_env):
    """kv_env, with kvcached set up for the contract tests of the vLLM integration
    (_vllm_contract.py says how)."""
    from _vllm_contract import kvcached_for_vllm

    with kvcached_for_vllm(kv_env):
        yield kv_env
