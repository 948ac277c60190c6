"""Corpus tooling: readers, sentencepiece training, megatron-core indexed dataset shards and
their manifest. The training side uses only data_tools.manifest (see README.md)."""

from ora_megatron.module_aliases import install

# A command users may have scripted, from before the module stopped shadowing the stdlib's inspect.
install({"data_tools.inspect": "data_tools.inspect_shards"})
