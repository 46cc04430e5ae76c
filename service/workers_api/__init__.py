"""/v1/workers: the live training workers, their devices and what they run (the dashboard's workers page)."""
