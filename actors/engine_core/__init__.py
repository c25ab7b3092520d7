"""The process boundary: an engine in its own process, its client and the messages between them."""
