"""shardcast inside other frameworks' flows: `shardcast.integrations.accelerate.prepare_pretrained`."""
