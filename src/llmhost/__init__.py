"""llmhost: a production LLM endpoint on bare metal: Triton + vLLM, deployed by Ansible."""

__version__ = "0.2.0"
