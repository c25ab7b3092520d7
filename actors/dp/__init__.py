"""Data parallelism: several engines behind one API server, and their router."""
