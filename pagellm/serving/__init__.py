"""Scale-out above the engine: engine replicas as Ray actors (replicas.py) behind a router
(router.py) that sends each request where its prefix is cached."""
