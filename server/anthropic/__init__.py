"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the
chat path, as vLLM serves it (``vllm/entrypoints/anthropic/``): ``protocol`` the request
bodies, ``convert`` their reduction to a chat request, ``shape`` the answers and stream events,
``errors`` Anthropic's error shape, ``serving`` the handlers."""
