"""Losses and advantages as pure functions on tensors, each citing the equation it implements."""
