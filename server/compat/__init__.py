"""What vLLM's server has beside the OpenAI API: its flags and its routes."""
