python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:server:tests
timeout 500 python3 -m pytest tests/fast/test_cuda.py -p no:logging -p no:cacheprovider --tb=short -rfE -v --durations=25 \
  -k "not tree_attention_matches_sdpa and not one_split" > $OUT/gpu_rest.txt 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gpu_rest.txt | grep -v "^\[" | tail -60
