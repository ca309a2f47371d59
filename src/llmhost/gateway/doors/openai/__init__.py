"""OpenAI's API as vLLM's server answers it: ``api`` (``/v1/models``, chat
completions, completions, embeddings), ``responses`` (``/v1/responses``), ``tokenize``
(``/tokenize``, ``/detokenize``); ``request_models`` (request bodies), ``mapping``
(OpenAI request -> backend request), ``completion_bodies`` (response bodies and SSE
chunks), ``batch`` (several prompts in one completions request), ``embeddings`` and
``images`` (image parts of chat messages).
"""
