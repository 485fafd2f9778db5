#!/usr/bin/env bash
# Install the project's GPU profile (requirements/gpu.txt) into the vLLM image WITHOUT changing any
# package the image already has: torch, vllm, transformers, triton, flashinfer, numpy ... stay exactly
# as vLLM pinned them (a different torch under vLLM's compiled kernels breaks the image).
#
#   bash install-gpu-profile.sh DIR      # DIR holds gpu.txt and cpu.txt; the records below are written there
#
# How:
#  1. image-packages.txt = `pip list --format=freeze` of the image (name==version, never a URL, so pip
#     accepts it as a constraints file). Installing under it makes pip FAIL, instead of silently
#     replacing, whenever something would need another version of an image package.
#  2. gpu.txt lines naming a package the image already has are dropped: the image's version wins (logged).
#  3. Packages new to the image that gpu.txt does not name (dvc's own dependencies...) take their version
#     from the CPU lock cpu.txt, which was resolved together with the same dvc / dvc-s3 / fla-core pins;
#     cpu.txt lines for packages the image has are left out. So the whole profile is pinned.
#  4. `pip check` must not report anything the image did not already report; torch and vllm must be unchanged.
# Records kept in DIR: image-packages.txt (before), packages.txt (after), the pip check outputs.
set -euo pipefail
dir=$1
cd "$dir"
# The image's system Python IS vLLM's environment: installing next to vLLM is the point (PEP 668 marker, if any).
export PIP_BREAK_SYSTEM_PACKAGES=1

python3 -c "import torch, vllm; print('image: torch', torch.__version__, '| vllm', vllm.__version__, '| CUDA', torch.version.cuda)"
python3 -m pip --version
python3 -m pip list --format=freeze > image-packages.txt
python3 -m pip check > pip-check-before.txt 2>&1 || true

python3 - <<'PY'
import re

def name(line):
    return re.sub(r"[-_.]+", "-", re.split(r"[\[=<>!~; ]", line, maxsplit=1)[0]).lower()

def requirements(path):  # requirement lines without comments
    lines = (ln.split(" #", 1)[0].strip() for ln in open(path))
    return [ln for ln in lines if ln and not ln.startswith("#")]

image = {name(ln): ln for ln in requirements("image-packages.txt")}
keep = []
for ln in requirements("gpu.txt"):
    if name(ln) in image:
        print(f"gpu.txt: {ln} -> the image's {image[name(ln)]} is kept")
    else:
        keep.append(ln)
cpu = [ln for ln in requirements("cpu.txt") if name(ln) not in image]
open("gpu-install.txt", "w").write("".join(f"{ln}\n" for ln in keep))
open("constraints.txt", "w").write("\n".join(list(image.values()) + cpu) + "\n")
print(f"installing {len(keep)} gpu.txt requirement(s) under {len(image)} image + {len(cpu)} CPU-lock constraints")
PY

if [[ -s gpu-install.txt ]]; then
    python3 -m pip install --no-cache-dir -c constraints.txt -r gpu-install.txt
fi
python3 -m pip check > pip-check-after.txt 2>&1 || true
if new=$(grep -vxF -f pip-check-before.txt pip-check-after.txt | grep -v "No broken requirements found"); then
    echo "pip check reports new problems after installing the GPU profile:" >&2
    echo "$new" >&2
    exit 1
fi
python3 -m pip list --format=freeze > packages.txt
for pkg in torch vllm; do
    before=$(grep -iE "^${pkg}==" image-packages.txt || true)
    after=$(grep -iE "^${pkg}==" packages.txt || true)
    if [[ "$before" != "$after" ]]; then
        echo "the GPU profile changed the image's ${pkg}: '${before}' -> '${after}'" >&2
        exit 1
    fi
done
echo "GPU profile installed; image packages unchanged ($(wc -l < packages.txt) packages, list in ${dir}/packages.txt)"
