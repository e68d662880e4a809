#!/usr/bin/env bash
# The wheels benchmarks/serve.py needs on a lent device machine (offline; Python 3.12; its image
# has aiohttp, grpcio, typer, rich, uvloop and prometheus-client but not these), into .serve-whl/
# (git-ignored, ~40 MB: under the 64 MiB a device call carries). Run here, from the project's root:
#   bash benchmarks/device_serve_wheels.sh
# then, on the device, after the gpu-host-prep install calls:
#   run with carry [".serve-whl"]:  . /tmp/gpuhost/host.sh && bash benchmarks/gpu_session.sh serve
set -euo pipefail
root="$(git rev-parse --show-toplevel)"; cd "$root"
dest=.serve-whl
rm -rf "$dest"; mkdir -p "$dest"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in 17 24 27 28 31 34 35; do plat+=(--platform "manylinux_2_${p}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# tritonclient[http,grpc] and its needs, the serve extra's JSON parsers, and the grpcio/protobuf
# pair the server's generated stubs were made for (the image's own may be another major): the
# versions the development venv runs its tests with (tritonclient's http extra wants greenlet<3.4)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dest" \
  tritonclient==2.73.0 geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2 zope.event zope.interface \
  python-rapidjson==1.25 ml_dtypes==0.5.4 brotli==1.2.1 certifi urllib3==2.8.0 pysimdjson==7.0.2 \
  orjson==3.13.0 grpcio==1.85.1 protobuf==6.33.6 typing_extensions==4.16.0 packaging==26.3
du -sh "$dest"
