"""weightsync inside other frameworks: `weightsync.integrations.verl` is verl's
checkpoint-engine backend."""
