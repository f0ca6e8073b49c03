"""Serving, above the engine: the ZeroMQ client API and the OpenAI HTTP API.

api.py        the request and event documents and their typed decoder
server.py     ``strata serve``: the Scheduler (coordinator/scheduler.py) behind a ROUTER socket
client.py     the Python client (runs in the user's process, not the server's)
"""
