"""The shared core: what the directory, the agent and the gateway all speak.

- `keys`: the namespace key, one stable encoding of a namespace's fields.
- `limits`: wire-wide bounds (message size, wire versions, field sizes).
- `security`: TLS contexts, identities, bearer tokens, authorization helpers.
- `client`: the directory client library (retries, outcomes, holder records).
- `mirror`, `mirror_sync`: an in-process mirror of the directory fed by Watch, and
  `MirroredDirectory` (the mirror while fresh, else the RPC).
- `hashing`: engine block hashes (vLLM, SGLang) and kvdir's own chains.
- `config`: TOML reading shared by every daemon's configuration.
- `logs`: JSON-lines logging.

Nothing here imports the directory server, the agent or the gateway (the mirror
imports the directory's pure state machine, `kvdir.directory.table`, on purpose).
"""
