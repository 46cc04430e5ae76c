"""Graders API: validate and run one grader, as OpenAI's /v1/fine_tuning/alpha/graders."""
