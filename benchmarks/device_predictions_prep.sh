#!/usr/bin/env bash
# What issue 40's simulator benchmark needs on a lent device machine, whose 16 cores are quiet
# where the 2-core development VM is not (its speed moves 3-6 % around its mean in 3 s windows):
# pymetis and pyhwloc (the image lacks them), into .predict/ (git-ignored, a few MB: under the
# 64 MiB a call carries; no GPU library, the benchmark runs on CPU cores only). The models it
# sweeps (googlenet, crnn_ocr, unet_seg) are tracked under models/ and travel with the tree.
# Run here, from the project's root:
#   bash benchmarks/device_predictions_prep.sh
# then one device call with carry [".predict"]:
#   bash benchmarks/gpu_session.sh predictions
set -euo pipefail
root="$(git rev-parse --show-toplevel)"; cd "$root"
grep -qxF '/.predict/' .git/info/exclude 2>/dev/null || echo '/.predict/' >> .git/info/exclude
dest=.predict
rm -rf "$dest"; mkdir -p "$dest/whl"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in 17 24 27 28 31 34 35; do plat+=(--platform "manylinux_2_${p}_x86_64"); done
plat+=(--platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dest/whl" pymetis pyhwloc
du -sh "$dest"
