"""Corpus tooling: readers, sentencepiece training, megatron-core indexed dataset shards and
their manifest. The training side uses only data_tools.manifest (see README.md)."""
