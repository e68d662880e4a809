"""``staronnx serve``: plans served over the network with the KServe v2 (Open Inference) protocol.

HTTP/REST (with Triton's binary-tensor extension) and gRPC, so Triton's clients, load
generators and dashboards work unchanged; Prometheus metrics under Triton's names plus
staronnx's own. Needs the ``serve`` extra (``pip install 'staronnx[serve]'``).

    models.py      one plan served: runtime + batcher, request checks, split/join of client batches
    protocol.py    v2 datatypes, shapes, byte counts; errors and their HTTP/gRPC statuses
    frontend.py    what both front ends share: lookups, statistics, index, refusals, counts
    http_api.py    the REST API on aiohttp
    fastpath.py    the inference lane: plain inference requests answered beside aiohttp
    grpc_api.py    the gRPC API on grpc.aio (stubs generated from proto/grpc_predict_v2.proto)
    metrics.py     Prometheus registry and collector
    app.py         listeners, one event loop, graceful shutdown
"""
