"""The checks run on a real GPU host (the device kit carries src/ and lab/); the
lab/gpu_*.py modules are their entry points (``python3 -m lab.gpu_check``).

* lifecycle: the engine's lifecycle and input checks, and the helpers the other
  checks share (ports, HTTP, waiting, process trees);
* check: the serving path under KIND_GPU and KIND_MODEL, and tensor parallel;
* speed: the Triton path and the gateway against vLLM's own server;
* model: the generated model they serve (``python3 -m lab.gpucheck.model``).
"""
