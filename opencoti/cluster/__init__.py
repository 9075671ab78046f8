"""Several engine replicas behind one endpoint, on Ray Serve (the optional ``cluster`` extra).

    opencoti cluster serve --replicas 2          # a local Ray instance
    serve run opencoti.cluster.app:build replicas=4 gpus_per_replica=1   # an existing Ray cluster

ids.py (cluster-wide pool ids), hints.py (what routing needs from a request), policy.py (the
routing policy, free of Ray) and aggregate.py (merged answers) import nothing from Ray; router.py,
replica.py, registry.py, ingress.py, routes.py and app.py need ``ray[serve]``.
"""
