"""Triton's lifecycle and the model repository: the repository's layout and templates,
the models' GPU placement, `llmhost serve`, stop and drain, the admin key."""
