"""Model definitions that run on the flattened paged batch."""
