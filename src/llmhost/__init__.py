"""llmhost: a production LLM endpoint on bare metal: Triton + vLLM, deployed by Ansible.

One package per concern: `backend` (the Triton Python backend for vLLM), `gateway` (the
OpenAI gateway), `server` (Triton's lifecycle and the model repository), `bench`
(`llmhost bench` and PromQL), `tiny` (tiny model writers); `cli`, `smoke`, `cuda` and
`numbers` at the top. The GPU checks and comparisons live in the repository's `lab/`,
which is never installed.
"""

__version__ = "0.13.1"
