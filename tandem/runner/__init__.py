"""Device work: the model runner (input preparation, paged attention, launch / collect)."""
