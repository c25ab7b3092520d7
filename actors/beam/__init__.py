"""Beam search: its rules and the beams as sibling requests in the scheduler."""
