"""kvcached's main job in one command: two models share one device's KV memory, which follows the load.

``python -m kvcached.demo`` starts two instances (a Llama and a Qwen2 model with random weights,
each served by the continuous-batching loop of kvcached.serving over kvcached memory) under one
global budget, moves the load from one to the other and back, shows each instance's memory and
serving counters live, and draws the memory over time into a PNG. Modules: ``run`` (the parent
process), ``instance`` (an instance process), ``schedule`` (the phases), ``view`` and ``plot``.
"""
