"""Executor actors: one thread in process, worker processes, Ray actors."""
