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
