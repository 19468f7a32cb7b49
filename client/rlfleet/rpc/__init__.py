"""What both sides of every call share, below the SDK and the services: the typed error family a
``grpc.RpcError`` becomes (``errors``), channels and calls with deadlines and bounded retries
(``channel``), and the plain records of the services' replies (``records``). The SDK re-exports them
(``rlfleet.client``); the services import them from here, never from the SDK."""
