"""Optional integrations with inference engines, each in a module of its own that imports its engine.

Nothing here is imported by ``import rlightning_comm``: import the module you need
(``rlightning_comm.integrations.vllm`` needs vLLM, the ``vllm`` extra).
"""
