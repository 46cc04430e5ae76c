"""/v1/models: listing the base and fine-tuned models a tenant can train or try, and deleting a fine-tuned one
(which asks the jobs whether it is still needed, so it sits above both `base_models` and `jobs`)."""
