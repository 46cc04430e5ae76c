"""The Tinker training-primitives API for the official `tinker` SDK (docs/tinker.md): routes under
`/api/v1`, the rules (service.py), the way to the workers (channel.py), the protobuf bodies (wire.py)."""
