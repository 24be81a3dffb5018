#!/usr/bin/env bash
# The GPU suite in one command, for a bare lent GPU machine (no network; the CUDA image with torch):
#
#   1. install the wheels fetched beforehand (offline, --no-deps, into a --target folder under /tmp, once per wheel set)
#      and unpack libcairo's Debian packages for cairosvg (found through LD_LIBRARY_PATH);
#   2. build the random-init qwen2.5-vl-2b once per machine (cached under /tmp; about a minute);
#   3. bench/gpu_train.py (ovkit padded and packed, the plain loop, TRL; checkpointing on for all);
#   4. bench/gpu_grpo.py (TRL against ovkit at the same precision policy, sync and async; where the memory goes) and
#      bench/shared_prefix.py (the RL learner with each group's prompt forwarded once, against one row per sample);
#   5. the gpu-marked tests, then the default suite (-m "not slow and not gpu": the gpu ones just ran) on CUDA,
#      pytest -x -q, with xdist when it is there;
#   6. one summary table: each part's status, seconds and headline numbers.
# Each part gets a time cap and the whole run a budget (default 480 s: a lent machine's session is 15 minutes, one
# command at most 10); a part that runs out is stopped and shows as `timeout` in the table, the rest still run.
#
# Before, on a machine with PyPI (wheels for CPython 3.12 manylinux x86_64, ~27 MB):
#   bash ../shared/gpu/fetch.sh .gpu-wheels          # .gpu-wheels/whl, .gpu-wheels/debs (ignored by git)
# On the GPU machine, from the repository root (the folder travels with the checkout; `make gpu-suite` runs this):
#   bash bench/gpu_suite.sh [--wheels .gpu-wheels] [--budget 480] [--out /tmp/ovkit-suite]
# On a CPU box, to check the script itself (tiny model, small settings, no install unless --wheels is given):
#   PYTHON=.venv/bin/python bash bench/gpu_suite.sh --cpu-smoke
set -uo pipefail

PY=${PYTHON:-python3}
WHEELS=.gpu-wheels
BUDGET=480
OUT=/tmp/ovkit-suite
SMOKE=0
WHEELS_GIVEN=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --wheels) WHEELS=$2; WHEELS_GIVEN=1; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --cpu-smoke) SMOKE=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_suite.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -f pyproject.toml && -d src/ovkit ]] || { echo "gpu_suite.sh: run it from the repository root" >&2; exit 2; }
mkdir -p "$OUT"
START=$SECONDS
SUMMARY=$OUT/summary.tsv
: > "$SUMMARY"

# ---- 1. offline install --------------------------------------------------------------------------------------------
SITE=/tmp/ovkit-site
CAIRO=/tmp/ovkit-cairo
if [[ $SMOKE == 0 || $WHEELS_GIVEN == 1 ]]; then
  if [[ ! -d $WHEELS/whl ]]; then
    echo "gpu_suite.sh: no wheels in $WHEELS/whl; fetch them first: bash ../shared/gpu/fetch.sh $WHEELS" >&2
    exit 2
  fi
  KEY=$(ls "$WHEELS/whl" | md5sum | cut -c1-8)   # reinstall when the wheel set changes, not on every call
  if [[ ! -f $SITE/.done-$KEY ]]; then
    rm -rf "$SITE" "$CAIRO"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/whl/*.whl \
      || { echo "gpu_suite.sh: offline install failed" >&2; exit 1; }
    mkdir -p "$CAIRO"
    for f in "$WHEELS"/debs/*.deb; do [[ -f $f ]] && dpkg -x "$f" "$CAIRO"; done
    touch "$SITE/.done-$KEY"
  fi
  export PYTHONPATH=$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
  export LD_LIBRARY_PATH=$CAIRO/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[[ $SMOKE == 1 ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# part NAME CAP_SECONDS COMMAND...: run it under the smaller of its cap and what is left of the budget
part() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  (( cap > left )) && cap=$left
  if (( cap < 10 )); then
    printf '%s\tskipped\t0\tno time left in the %ss budget\n' "$name" "$BUDGET" >> "$SUMMARY"
    return
  fi
  echo "== $name (up to ${cap}s) =="
  local t0=$SECONDS rc
  timeout --kill-after=10 "$cap" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/$name.log"
  local status=ok headline
  (( rc == 124 || rc == 137 )) && status=timeout
  (( rc == 5 )) && status="ok (no tests)"   # pytest: nothing collected (no gpu-marked test in the selection)
  (( rc != 0 && rc != 5 && rc != 124 && rc != 137 )) && status="failed (rc $rc)"
  headline=$(tail -n 1 "$OUT/$name.log")
  [[ $name == *-bench ]] && headline="tables below; $OUT/$name.log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" "$headline" >> "$SUMMARY"
}

"$PY" - <<'EOF'
import torch
print(f"torch {torch.__version__}; cuda {torch.cuda.is_available()}; " + (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"))
EOF

# ---- 2. the model, once per machine -------------------------------------------------------------------------------
if [[ $SMOKE == 1 ]]; then
  MODEL_ARGS=()   # each bench builds the tiny model from its own data
  TRAIN_ARGS=(--rows 48 --steps 3 --warmup 1 --batch-size 4 --grad-accum 2 --tokens-per-row 1024)
  GRPO_ARGS=(--steps 2 --prompts-per-step 2 --group-size 4 --max-new-tokens 16 --runs trl-mixed,ovkit-mixed,trl-bf16,ovkit-bf16)
  SHARED_ARGS=(--groups 4 --sizes 84 --steps 1)
  TESTS=(tests/test_examples.py)
else
  MODEL=/tmp/ovkit-models/qwen2.5-vl-2b
  if [[ ! -f $MODEL/ovkit.json ]]; then
    part build-model 150 "$PY" -m ovkit init-model --preset qwen2.5-vl-2b --random-init --dtype bfloat16 --out "$MODEL" --overwrite --quiet
  fi
  MODEL_ARGS=(--model "$MODEL")
  # Fewer rows and steps than the benches' own defaults: each run loads the 2.2B model in its own process.
  TRAIN_ARGS=(--rows 128 --steps 5 --warmup 2)
  GRPO_ARGS=(--steps 2 --runs trl-mixed,ovkit-mixed,ovkit-mixed-async,trl-bf16,ovkit-bf16)
  SHARED_ARGS=(--groups 8 16 --sizes 448 --steps 2)   # rl-train's --shared-prefix on against off (learner step)
  TESTS=()
fi

# ---- 3-5. benches and tests ---------------------------------------------------------------------------------------
part train-bench 170 "$PY" bench/gpu_train.py "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" --out "$OUT/train" --json "$OUT/train.json"
part grpo-bench 170 "$PY" bench/gpu_grpo.py "${MODEL_ARGS[@]}" "${GRPO_ARGS[@]}" --out "$OUT/grpo" --json "$OUT/grpo.json"
part shared-prefix-bench 90 "$PY" bench/shared_prefix.py "${MODEL_ARGS[@]}" "${SHARED_ARGS[@]}"
XDIST=()   # (pyproject's addopts already pass -q: one more would drop the summary line the table shows)
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
part gpu-tests 60 "$PY" -m pytest -x -p no:cacheprovider -m gpu "${TESTS[@]}"
part default-tests 150 "$PY" -m pytest -x -p no:cacheprovider -m "not slow and not gpu" "${XDIST[@]}" "${TESTS[@]}"

# ---- 6. one table -------------------------------------------------------------------------------------------------
"$PY" - "$OUT" "$((SECONDS - START))" <<'EOF'
import json, sys
from pathlib import Path

out, total = Path(sys.argv[1]), sys.argv[2]
print(f"\n== GPU suite summary ({total} s in all; logs in {out}) ==")
print(f"{'part':<15}{'status':<16}{'s':>5}  headline")
for line in (out / "summary.tsv").read_text().splitlines():
    name, status, secs, tail = (line.split("\t") + [""] * 4)[:4]
    print(f"{name:<15}{status:<16}{secs:>5}  {tail.strip()}")
train = out / "train.json"
if train.is_file():
    t = json.loads(train.read_text())
    print(f"\ntraining ({t['device']}, policy {t['policy']}): run, tokens/s, MFU, peak GB, B/param")
    for r in t["runs"]:
        mfu = f"{r['mfu']:.1f}%" if r.get("mfu") else "-"
        bpp = f"{r['bytes_per_param']:.2f}" if r.get("bytes_per_param") is not None else "-"
        print(f"  {r['run']:<14}{r['tokens_per_s']:>9.0f}{mfu:>8}{r['peak_bytes'] / 1e9:>8.2f}{bpp:>8}")
grpo = out / "grpo.json"
if grpo.is_file():
    g = json.loads(grpo.read_text())
    print(f"\nGRPO ({g['device']}): run, samples/s, peak GB, B/param, policy")
    for name, r in g["runs"].items():
        bpp = f"{r['bytes_per_param']:.2f}" if r.get("bytes_per_param") is not None else "-"
        print(f"  {name:<18}{r['samples_per_s']:>8.2f}{r['peak_bytes'] / 1e9:>8.2f}{bpp:>8}  {r['policy']}")
EOF
! grep -qE $'\t(failed|timeout)' "$SUMMARY"
