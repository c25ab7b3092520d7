"""The Messages API's conversion to a chat request: system blocks, tool uses and tool results
become the chat history vLLM's chat path takes, in order (no server needed)."""

from __future__ import annotations

from pagedserve.server.anthropic.convert import chat_messages, chat_request
from pagedserve.server.anthropic.protocol import MessagesRequest


def test_the_conversation_becomes_the_chat_history_in_order():
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 8,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                   {"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "w", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2",
                 "content": [{"type": "text", "text": "rain"}, {"type": "text", "text": "8C"}]},
                {"type": "text", "text": "And tomorrow?"}]}]})
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "w", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "w", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "rain\n8C"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}]
    chat = chat_request(body)
    assert chat.max_tokens == 8 and chat.add_generation_prompt
    assert "temperature" not in chat.model_fields_set  # left to the generation config
