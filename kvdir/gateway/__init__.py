"""`kvdir gateway`: an OpenAI-compatible HTTP reverse proxy that routes by cached prefix.

docs/gateway.md: the request path (parse, tokenize, hash, directory lookup,
route, forward), configuration, metrics and the pull-hint headers.
"""
