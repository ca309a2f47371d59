"""Tiny random models written to disk without downloads: the text model (`model`), a
LoRA adapter for it (`lora`) and a BLIP-2-shaped vision model (`vision`)."""
