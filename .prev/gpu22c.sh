python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:server:tests
timeout 420 python3 -m pytest tests/fast/test_cuda.py -p no:logging -p no:cacheprovider --tb=short -rA -q --durations=10 \
  -k "(hybrid_rounds or moe_rounds) and float32" > $OUT/gpu_f32.txt 2>&1
grep -v "^\[" $OUT/gpu_f32.txt | grep -v "Loading\|Writing" | tail -30
