"""The tier engine: a model, its KV memory and session table, and the step loop that batches the work
of many sessions into one forward. Used by draft_service and target_service; needs torch."""
