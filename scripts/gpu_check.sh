#!/usr/bin/env bash
# The GPU checks, as one prepared script for a machine with an NVIDIA GPU and no internet.
# Written for the `device` machine (one H200) but NOT RUN YET: no GPU was lent to the sessions so far.
#
#   scripts/gpu_check.sh WHEELS_DIR      # WHEELS_DIR: pip wheels of rlgate's learner extra, vllm, openrlhf
#
# Prepare WHEELS_DIR where the internet is reachable (same Python version and platform as the GPU machine):
#   pip download -d wheels setuptools wheel '.[learner,test]' vllm==0.33.0
#   pip download -d wheels --no-deps openrlhf==0.11.2
#
# What it checks, printing one table at the end:
#   1. the learner's update on CUDA (scripts/bench_learner.py --device cuda) on a larger tiny model, with
#      torch's AdamW and on DeepSpeed (one rank, NCCL); with two GPUs or more, also on one rank per GPU
#   2. vLLM serving the tiny model with runtime LoRA (--enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING)
#   3. the gateway in front of vLLM recording token ids, then a LoRA push from the learner's pusher, and a
#      call through the gateway served by the adapter and tagged with the new version
#
# The learner on several GPUs (data-parallel ranks, NCCL; docs/learner.md#data-parallel-ranks), e.g. 8:
#   torchrun --standalone --nproc-per-node 8 -m rlgate learner --engine deepspeed --zero-stage 2 --device cuda ...
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${1:?usage: scripts/gpu_check.sh WHEELS_DIR}
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
python3 -m venv "$out/venv"
py="$out/venv/bin/python"
"$py" -m pip install --quiet --no-index --find-links "$wheels" -e '.[learner,test]' vllm==0.33.0 \
  && "$py" -m pip install --quiet --no-index --find-links "$wheels" --no-deps openrlhf==0.11.2 \
  || { echo "install failed"; exit 1; }
redis-server --port 6399 --save "" --appendonly no --daemonize yes >/dev/null 2>&1 || true
export RLGATE_TEST_REDIS_URL=redis://127.0.0.1:6399

declare -A result
"$py" scripts/bench_learner.py --device cuda --hidden 512 --layers 8 --sizes 32,128,512 --ranks 1 \
  --redis-url "$RLGATE_TEST_REDIS_URL/0" --json "$out/bench.json" > "$out/bench.log" 2>&1 \
  && result[learner_step_cuda]=ok || result[learner_step_cuda]="FAILED (see $out/bench.log)"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -ge 2 ]; then  # one rank per GPU, NCCL
  "$py" scripts/bench_learner.py --device cuda --hidden 512 --layers 8 --sizes 32 --ranks "1,$gpus" \
    --redis-url "$RLGATE_TEST_REDIS_URL/0" > "$out/bench_ranks.log" 2>&1 \
    && result[learner_ranks_nccl]=ok || result[learner_ranks_nccl]="FAILED (see $out/bench_ranks.log)"
fi

"$py" - "$out" > "$out/vllm.log" 2>&1 <<'PY'
import json, os, subprocess, sys, time, uuid, asyncio
from pathlib import Path
import httpx
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
from conftest import free_port, start_gateway
from rlgate.inference.tiny_model import build_tiny_model
from learner.settings import LearnerSettings
from learner.policy import Policy
from learner.push import LoraPusher
from rlgate.episodes import EpisodeStore
out = Path(sys.argv[1])
model = build_tiny_model(out / "tiny", seed=0, hidden_size=256, num_layers=4)
port = free_port()
env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
vllm = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                         "--served-model-name", "tiny", "--port", str(port), "--enable-lora", "--max-lora-rank", "8",
                         "--logprobs-mode", "processed_logprobs",
                         "--gpu-memory-utilization", "0.3", "--max-model-len", "2048"], env=env,
                        stdout=(out / "vllm_server.log").open("wb"), stderr=subprocess.STDOUT)
base = f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        if httpx.get(f"{base}/health", timeout=2).status_code == 200: break
    except httpx.TransportError: pass
    time.sleep(1)
else:
    raise SystemExit("vllm did not start")
redis_url = os.environ["RLGATE_TEST_REDIS_URL"] + "/0"
gw = start_gateway(out, f"{base}/v1", redis_url=redis_url, policy_poll_s="0.05")
rid = uuid.uuid4().hex
body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
r = httpx.post(f"{gw.url}/rollouts/{rid}/v1/chat/completions", json=body, timeout=60)
call = httpx.get(f"{gw.url}/rollouts/{rid}").json()["calls"][0]
print("RESULT gateway_records_vllm_token_ids", "ok" if r.status_code == 200 and call["completion_token_ids"] else "FAILED")
async def push():
    store = EpisodeStore.from_url(redis_url)
    policy = Policy(LearnerSettings(model=model, device="cuda", tensorboard=False))
    pusher = LoraPusher([base], out / "adapters", store, "tiny")
    t = await pusher.push(1, policy)
    await store.aclose()
    return t
seconds = asyncio.run(push())
print("RESULT lora_push_to_vllm_s", f"{seconds:.3f}")
time.sleep(0.3)
rid = uuid.uuid4().hex
httpx.post(f"{gw.url}/rollouts/{rid}/v1/chat/completions", json=body, timeout=60)
call = httpx.get(f"{gw.url}/rollouts/{rid}").json()["calls"][0]
print("RESULT call_served_by_adapter", "ok" if call["model"] == "policy-v1" and call["policy_version"] == 1 else f"FAILED {call['model']} {call['policy_version']}")
gw.kill(); vllm.terminate()
PY
while read -r _ name value; do result[$name]=$value; done < <(grep '^RESULT' "$out/vllm.log")
[ -n "${result[gateway_records_vllm_token_ids]:-}" ] || result[vllm_checks]="FAILED (see $out/vllm.log)"

echo
echo "| check | result |"
echo "|---|---|"
for key in "${!result[@]}"; do echo "| $key | ${result[$key]} |"; done
echo
cat "$out/bench.log" 2>/dev/null | sed -n '/^| samples/,$p'
cat "$out/bench_ranks.log" 2>/dev/null | sed -n '/^| ranks/,$p'
