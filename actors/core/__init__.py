"""The core: the scheduler actor, its step planner and queues, request state."""
