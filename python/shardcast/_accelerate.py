"""The old home of `prepare_pretrained`, kept so that `from shardcast._accelerate import prepare_pretrained`
still works: it is public as `shardcast.integrations.accelerate.prepare_pretrained`."""
from .integrations.accelerate import prepare_pretrained

__all__ = ["prepare_pretrained"]
