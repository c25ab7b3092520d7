"""KV connectors: moving a request's KV blocks between instances (disaggregated prefill and
decode) or to storage. ``base.py`` is the contract; each connector is one file."""
