"""KV memory behind the ``KVContext`` interface the model attends through."""

from engine.kv.contiguous import ContiguousBatch, SequenceKV

__all__ = ["ContiguousBatch", "SequenceKV"]
