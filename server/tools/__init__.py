"""Tool calling: the request fields, the templates and the output parsers."""
