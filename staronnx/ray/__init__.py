"""staronnx on Ray Serve: replicas, one per machine, behind one KServe v2 endpoint.

A staronnx process owns one machine (its GPU's streams, its CPU groups); Ray Serve places
many of them, restarts the ones that die, scales them with the load and puts one HTTP
endpoint in front. Each replica hosts every served model on one shared runtime (as
``staronnx serve`` does), or one model with ``--separate-runtimes``. Needs the ``ray`` extra
(``pip install 'staronnx[ray]'``).

    spec.py      ModelSpec (one plan's serving settings), ReplicaSpec (the models a replica
                 hosts on one runtime), Scaling (replicas, resources)
    replica.py   the replica: Runtime + a batcher per model, health, CPU share, perf models
    ingress.py   the KServe v2 HTTP routes on Serve's ingress (staronnx.serve's protocol code)
    app.py       build_app / build (Serve config files) / deploy
    cli.py       ``staronnx serve --ray``
"""

from staronnx.ray.spec import (APP_NAME, SHARED_NAME, ModelSpec, ReplicaSpec, Scaling, deployment_name,
                               parse_autoscale)

__all__ = ["APP_NAME", "SHARED_NAME", "ModelSpec", "ReplicaSpec", "Scaling", "deployment_name", "parse_autoscale"]
