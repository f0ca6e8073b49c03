"""The host backend: the network on the coordinator's CPU with its compiled loops (backend.py, ops.py), and the dense
matrices packed in their storage formats (packed.py)."""
