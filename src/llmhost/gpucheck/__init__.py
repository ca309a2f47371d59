"""The checks run on a real GPU host (the device kit carries src/ and scripts/):
scripts/gpu_*.py are their entry points.

* lifecycle: issue 12's engine lifecycle and input checks, and the helpers the
  other checks share (ports, HTTP, waiting, process trees);
* check: issue 14's serving-path check under KIND_GPU and KIND_MODEL;
* speed: issue 14's speed run, the Triton path against vLLM's own server;
* model: the generated model they serve (``python -m llmhost.gpucheck.model``).
"""
