"""shardcast inside other frameworks' flows: `shardcast.integrations.accelerate.prepare_pretrained` (accelerate
FSDP2) and `shardcast.integrations.torchtitan.CheckpointManager` (torchtitan's checkpoint manager)."""
