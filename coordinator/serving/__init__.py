"""Serving: the ZeroMQ client API.

api.py        the request and event documents and their typed decoder
scheduler.py  continuous batching over one Engine, free of sockets
server.py     ``strata serve``: the Scheduler behind a ROUTER socket
client.py     the Python client (runs in the user's process, not the server's)
"""
