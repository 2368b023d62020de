set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:server:tests
nvidia-smi --query-gpu=name --format=csv
timeout 300 python3 -m pytest tests/fast/test_cuda.py -p no:logging -p no:cacheprovider --tb=long -q -k "hybrid_rounds and qwen3_next and float32" 2>&1 | grep -v "^\[" | tail -60
timeout 240 python3 .prev/diag22.py qwen3_next 2>&1 | grep -v "^\[" | tail -40
