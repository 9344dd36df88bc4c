"""HiSpec heads inside vLLM: the draft exit as an EAGLE-style speculator.

    import vllm, hispec_vllm
    llm = vllm.LLM(model=BASE, speculative_config=hispec_vllm.speculative_config(HEADS))

or ``vllm serve BASE --speculative-config "$(python -m hispec_vllm HEADS)"``. The plugin registers
the drafter's architecture in every vLLM process through the ``vllm.general_plugins`` entry point
(installing this package is enough). Only :mod:`hispec_vllm.model` imports vLLM.
"""

from .draft import DRAFT_ARCHITECTURE, build_draft_dir, speculative_config

__all__ = ["DRAFT_ARCHITECTURE", "build_draft_dir", "register", "speculative_config"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make the drafter's architecture known to vLLM."""
    from vllm import ModelRegistry

    if DRAFT_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(DRAFT_ARCHITECTURE, "hispec_vllm.model:EagleHiSpecForCausalLM")
