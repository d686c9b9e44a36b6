"""Ingest stock vLLM / SGLang KV-cache events into the directory (docs/events.md).

decode    pure decoding of every wire format into typed events
hashes    engine hash forms -> the directory's key bytes
sequence  pure sequence tracking: in order, gap, restart
holders   index-only holders (one per engine DP rank and medium) fed to Publishers
consumer  the ZMQ SUB / replay DEALER loop, one thread per engine DP rank
selfcheck the hashes an engine will publish, recomputed from tokens
"""
