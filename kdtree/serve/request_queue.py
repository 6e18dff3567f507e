"""The server's refusals at submission (kdtree/serve/batch_worker.py): a full queue (HTTP 429, instead of growing
without bound) and a draining server (HTTP 503). The request itself is kdtree.decode.request.Request, the one record
from the route to the scheduler; the route keeps its side of the wire (the asyncio future and queue) in `req.tag`
(kdtree/serve/bridge.py's Wire)."""
from __future__ import annotations


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass
