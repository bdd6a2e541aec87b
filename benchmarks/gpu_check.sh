#!/usr/bin/env bash
# The first checks to run on a machine with a CUDA GPU (under 10 minutes: each step has a timeout):
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
#
# 1. the GPU tests (tests/test_cuda.py: byte-identity with the host path for every dtype,
#    streams, memory bound, --device cuda for files), then the torch API and --device tests;
# 2. the CLI on files: `diff --device cuda` must write the same bytes as `--device cpu`;
# 3. benchmarks/gpu.py on a Qwen2.5-7B-shaped state (15 GB): timings, peak GPU memory and
#    byte-identity with the host path (exit status 1 when a check fails).
# Results (JSON, logs) go to OUT_DIR (default bench-out/gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out/gpu}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

python - <<'EOF' 2>&1 | tee "$out/env.txt"
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF
python -c "import pulsectl._speedups" 2>/dev/null || python setup.py build_ext --inplace -q

echo "== 1. tests"
timeout 140 python -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py \
    tests/test_device.py tests/test_torch_api.py 2>&1 | tee "$out/tests.txt" | tail -20
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== 2. diff --device cuda vs cpu on files"
timeout 130 python - "$out" <<'EOF' || status=1
import sys, time
from pathlib import Path
from pulsectl.cli.app import main
from pulsectl.synth import generate_chain

out = Path(sys.argv[1])
chain = generate_chain(out / "chain", shape="qwen2.5-0.5b", steps=1, lr=1e-5, seed=0)
times = {}
for device in ("cpu", "cuda"):
    t0 = time.perf_counter()
    assert main(["diff", str(chain[0]), str(chain[1]), "--device", device, "-f",
                 "-o", str(out / f"{device}.pulse")]) == 0
    times[device] = time.perf_counter() - t0
same = (out / "cpu.pulse").read_bytes() == (out / "cuda.pulse").read_bytes()
t0 = time.perf_counter()
assert main(["apply", str(chain[0]), str(out / "cpu.pulse"), "--device", "cuda", "-f",
             "-o", str(out / "applied.safetensors")]) == 0
applied = (out / "applied.safetensors").read_bytes() == chain[1].read_bytes()
print(f"diff cpu {times['cpu']:.2f} s, cuda {times['cuda']:.2f} s, identical {same}; "
      f"apply --device cuda {time.perf_counter() - t0:.2f} s, exact {applied}")
sys.exit(0 if same and applied else 1)
EOF

echo "== 3. benchmarks/gpu.py (qwen2.5-7b)"
timeout 300 python benchmarks/gpu.py --json "$out/gpu.json" 2>&1 | tee "$out/gpu.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== $([ $status = 0 ] && echo 'all passed' || echo 'SOMETHING FAILED') (results in $out)"
exit $status
