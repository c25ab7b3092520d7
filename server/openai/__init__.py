"""The OpenAI endpoints: chat and text completions, their protocol and output."""
