python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:server:tests
echo "== GPU reference with Triton's float32 dots in IEEE (TRITON_F32_DEFAULT=ieee)"
TRITON_F32_DEFAULT=ieee timeout 120 python3 .prev/diag22.py qwen3_next refonly 2>&1 | grep -v "^\[" | grep -v "Loading\|Writing\|Warning\|warn" | tail -8
echo "== whole GPU test file"
timeout 480 python3 -m pytest tests/fast/test_cuda.py -p no:logging -p no:cacheprovider --tb=short -q --durations=15 2>&1 | grep -v "^\[" > $OUT/gpu_tests.txt
tail -40 $OUT/gpu_tests.txt
