#!/usr/bin/env bash
# The express engine's GPU check, in ONE run on a CUDA machine: every test in the repo that can use CUDA (all of
# tests/unit/engine and tests/unit/transfer: the lean step and its row-invariant verify, the greedy chain, the
# first request of a fresh engine in every step mode, the VRAM handoff and injection) and the decode bench (the
# 8B and 1B shapes, contexts 1k / 8k / 32k, plain, the node's own drafter, the oracle sweep k = 1..4 and the node's
# drafter on the copy model's recorded code-edit / agentic text at this engine's measured step costs (bench
# --replay-text), max_seq_len fixed at 33100 as a deployment would set it). Its summary is one table, printed last.
#
#   bash scripts/gpu_check.sh prepare            # here (pip + network): the wheels the GPU machine lacks, pinned
#                                                # with their hashes in images/gpu/check-wheels.lock, into
#                                                # .carry/gpu-check/ (nixl-cu13 repacked as tar.xz: 59 -> 32 MB)
#   bash scripts/gpu_check.sh run OUTDIR [PART]  # there: PART all (default) | tests | bench | norm (the
#                                                # tensor-core norm probe, the FORCED benches and their shapes'
#                                                # engines without speculation only) | step-tune (the plain
#                                                # engines and the 8B tensor-core one, --step-tune on and off)
#                                                # | per-request (the engine with a runner of each GEMV
#                                                # family, each request on the one its prompt suits, an
#                                                # engine of each one family, and the engine without
#                                                # speculation, at 8B then 1B: FORCED "llama-8b:per-request
#                                                # llama-8b:cuda-core llama-8b:tensor-core llama-1b:per-request
#                                                # llama-1b:cuda-core llama-1b:tensor-core"; 8B 320 s, 1B
#                                                # 150 s at REPEATS=1 on an H100)
#   bash scripts/gpu_check.sh summary OUTDIR     # anywhere: the table again from OUTDIR's pytest.txt, bench.jsonl
#
# The GPU machine (see docs/performance.md, "Method") has python3 3.12 with torch, triton, transformers,
# pytest, httpx and aiohttp, and no network: `prepare`'s folder travels with the run (the device tool's carry).
# Environment: PLAIN_ENGINE (1: also bench an engine built without speculation), STEP_TUNE_OFF (none: the
# shapes whose plain engine is also benched with --step-tune off, at STEP_TUNE_OFF_CONTEXTS 1024,32768),
# SHAPES (llama-8b llama-1b), CONTEXTS (1024,8192,32768), TOKENS (256), ORACLE_K (1,2,3,4),
# FORCED (llama-8b:tensor-core:per-row: shape:family[:verify attention[:norm[:l2]]] also benched with that
# GEMV family, verify attention, norm placement and L2 prefetch (models/lean.py; per-row, kernel and none when
# absent) forced, at
# FORCED_CONTEXTS 1024,32768 and FORCED_ORACLE_K 4: the opt-in's numbers (the family a per-request node runs
# text that repeats on: FORCED_CONTEXTS 1024,8192,32768 FORCED_ORACLE_K 3,4 for the 8B oracle targets);
# tensor-core with the norm kernels and per-row / shared attention: docs/bench/2026-12-04-gpu-check/,
# docs/bench/2026-12-05-gpu-check-green/),
# PROBE_NORM (1 in part norm, 0 in bench: docs/bench/2026-12-05-h100-gpu-check/probe_lean_norm.py, the tensor-core step with its norms as
# kernels and as tails against the CUDA-core step, into lean-norm.jsonl, at NORM_SHAPES llama-8b,llama-1b),
# REPEATS (2), MAX_SEQ_LEN (33100), REPLAY_TEXT (docs/bench/2026-12-04-cost-aware-drafter/texts.json; empty: none),
# REPLAY (recorded (drafted, kept) traces, bench --replay; none by default), PROBE_ATTENTION (0; 1: the verify
# attention probe first, into verify-attention.jsonl, at PROBE_CONTEXTS 1024,8190,32768; it decided per-row,
# docs/bench/2026-12-05-gpu-check/), TESTS (tests/unit/engine tests/unit/transfer: the test paths; a subset re-runs
# what a change touched where the device time left is short of the whole), TEST_BUDGET_S (400: the tests' share
# of the run), RUN_BUDGET_S (570: the whole run's, each phase stopped where it would pass it), TEST_WORKERS (8),
# EXPRESSLANE_COMMIT (the commit the tree is, for the table's title).
# Output in OUTDIR: pytest.txt, bench.log, bench.jsonl, verify-attention.jsonl, lean-norm.jsonl, phases.txt, summary.txt (the
# table, then each target of docs/performance.md against this run: scripts/gpu_check_targets.py).
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=.carry/gpu-check
LOCK=images/gpu/check-wheels.lock

prepare() {
  mkdir -p "$CARRY"
  local tmp
  tmp="$(mktemp -d)"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --require-hashes -r "$LOCK" -d "$tmp" || { rm -rf "$tmp"; return 1; }
  # nixl-cu13's libraries (229 MB unpacked) as tar.xz: the wheel itself (59 MB) and the repo would not fit in one
  # carry (64 MiB). Unpacking a wheel is what pip --target does for it (no scripts, no data files).
  local nx
  nx="$(ls "$tmp"/nixl_cu13-*.whl)"
  (mkdir "$tmp/nx" && cd "$tmp/nx" && unzip -q "$nx" && tar -c . | xz -T0 -6 >"../nixl_cu13.tar.xz") || return 1
  rm -rf "$tmp/nx" "$nx"
  rm -rf "$CARRY" && mkdir -p "$CARRY" && mv "$tmp"/* "$CARRY"/ && rmdir "$tmp"
  du -sh "$CARRY"
  ls -la "$CARRY"
}

install_carried() {  # into /tmp/site, once per machine
  if [[ ! -f /tmp/site/.gpu-check ]]; then
    mkdir -p /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$CARRY"/*.whl || return 1
    tar -xJf "$CARRY"/nixl_cu13.tar.xz -C /tmp/site || return 1
    touch /tmp/site/.gpu-check
  fi
  export PYTHONPATH="$PWD/engine/src:$PWD/router/src:/tmp/site" PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
  python3 -c "import torch, triton, fastapi, xgrammar, nixl; from nixl._api import nixl_agent; print('torch', torch.__version__, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())"
}

run_tests() {
  local out="$1" budget="${2:-${TEST_BUDGET_S:-400}}"
  echo "== tests (at most ${budget} s)"
  # -p no:cacheprovider: the tree is a copy; --timeout: a hung test fails and the rest still run; -n: xdist
  # workers (the machine's 16 cores compile the Triton kernels; a worker that crashes is named with its test and
  # replaced, the rest still run), --dist worksteal: an idle worker takes queued tests from a busy one (a few
  # tests take a minute each); -v: every test's outcome by name in pytest.txt.
  # EXPRESSLANE_COMPILE_THREADS: each worker's Triton compile pool (models/precompile.py), 4 x 8 workers on the
  # 16 cores instead of 16 each.
  EXPRESSLANE_COMPILE_THREADS="${TEST_COMPILE_THREADS:-4}" timeout --signal=INT --kill-after=15 "$budget" \
    python3 -m pytest -v -o addopts= -p no:cacheprovider --timeout 180 -rfE \
    -n "${TEST_WORKERS:-8}" --dist worksteal --durations 15 ${TESTS:-tests/unit/engine tests/unit/transfer} 2>&1 | tee "$out/pytest.txt" \
    | grep -vE " (PASSED|SKIPPED) " | tail -80
  local rc=${PIPESTATUS[0]}
  # interrupted at its budget, pytest still prints a closing "N passed" line: say so where the targets read it
  [[ $rc == 124 || $rc == 137 ]] && echo "tests interrupted at their budget (${budget} s)" >>"$out/phases.txt"
  return 0
}

run_bench() {
  local out="$1" part="${2:-bench}"
  : >"$out/bench.jsonl"
  if [[ $part == per-request ]]; then
    # the engine that runs each request on the GEMV family its prompt suits (decode/family.py), forced as a family
    # is, beside an engine of each one family (the same requests on one card: what the choice gains over `auto`
    # and what it loses to the better family of each request), and the node without speculation all are judged
    # against: the norm part's benches without its probe
    local families="llama-8b:per-request llama-8b:cuda-core llama-8b:tensor-core"
    families+=" llama-1b:per-request llama-1b:cuda-core llama-1b:tensor-core"
    FORCED="${FORCED-$families}" PROBE_NORM="${PROBE_NORM:-0}" part=norm
  fi
  local replay="${REPLAY-}" texts="${REPLAY_TEXT-docs/bench/2026-12-04-cost-aware-drafter/texts.json}"
  if [[ $part == step-tune ]]; then
    # the warm-up's timing of the whole step (models/step_tune.py) against each kernel's shape the fastest alone,
    # side by side on one card: each shape's plain engine, then the tensor-core family's speculating engine
    local tune shape
    for shape in ${SHAPES:-llama-8b llama-1b}; do
      for tune in on off; do
        echo "== bench $shape plain engine, --step-tune $tune"
        python3 -m expresslane.engine.decode.bench --random-shape "$shape" --device cuda --dtype bfloat16 \
          --contexts "${CONTEXTS:-1024,8192,32768}" --max-seq-len "${MAX_SEQ_LEN:-33100}" --tokens "${TOKENS:-256}" \
          --speculation-k 0 --step-tune "$tune" --repeats "${REPEATS:-2}" --json "$out/bench.jsonl" 2>&1 \
          | tee -a "$out/bench.log"
      done
    done
    for tune in on off; do
      echo "== bench llama-8b tensor-core, --step-tune $tune"
      python3 -m expresslane.engine.decode.bench --random-shape llama-8b --device cuda --dtype bfloat16 \
        --contexts "${FORCED_CONTEXTS:-1024,32768}" --max-seq-len "${MAX_SEQ_LEN:-33100}" --tokens "${TOKENS:-256}" \
        --lean-gemv tensor-core --oracle-k 3,4 --lookup --step-tune "$tune" --repeats "${REPEATS:-2}" \
        --json "$out/bench.jsonl" 2>&1 | tee -a "$out/bench.log"
    done
    return 0
  fi
  # the tensor-core step's norms as kernels or as the residual kernels' tails, against the CUDA-core step
  if [[ ${PROBE_NORM:-$([[ $part == norm ]] && echo 1 || echo 0)} == 1 ]]; then
    echo "== lean norm: kernel vs tail (tensor-core), against cuda-core"
    : >"$out/lean-norm.jsonl"
    python3 docs/bench/2026-12-05-h100-gpu-check/probe_lean_norm.py --shapes "${NORM_SHAPES:-llama-8b,llama-1b}" \
      --contexts "${FORCED_CONTEXTS:-1024,32768}" --max-seq-len "${MAX_SEQ_LEN:-33100}" \
      --json "$out/lean-norm.jsonl" 2>&1 | tee -a "$out/bench.log"
  fi
  # the verify's attention per row (the lean step's) against one program reading each tile for every row: time
  # and bits at the 8B / 1B attention shapes (docs/bench/2026-12-05-gpu-check/probe_verify_attention.py)
  if [[ ${PROBE_ATTENTION:-0} == 1 ]]; then
    echo "== verify attention: per-row vs shared"
    : >"$out/verify-attention.jsonl"
    # 8190: a verify of 2-5 rows there straddles the split-KV chunk boundary at 8192 (8 KV heads: 64 splits)
    python3 docs/bench/2026-12-05-gpu-check/probe_verify_attention.py --contexts "${PROBE_CONTEXTS:-1024,8190,32768}" \
      --json "$out/verify-attention.jsonl" 2>&1 | tee -a "$out/bench.log"
  fi
  # shapes benched with a GEMV family forced (models/lean.py: auto is cuda-core) and a verify attention, at the
  # shortest and longest context: the opt-in's numbers, what auto's choice weighs (the one-row step against the
  # verify), and the shared attention's end to end. First: a run cut at its budget loses the shapes' last rows.
  # The shapes' random weights are built in memory by each bench (--random-shape: decode/shapes.py, the weights
  # scripts/gpu_make_shape_model.py would write), not written and read back.
  local pair shape family attn norm l2
  for pair in ${FORCED-llama-8b:tensor-core:per-row}; do
    IFS=: read -r shape family attn norm l2 <<<"$pair"
    attn="${attn:-per-row}" norm="${norm:-kernel}"
    echo "== bench $shape $family $attn $norm ${l2}"
    python3 -m expresslane.engine.decode.bench --random-shape "$shape" --device cuda --dtype bfloat16 \
      --contexts "${FORCED_CONTEXTS:-1024,32768}" --max-seq-len "${MAX_SEQ_LEN:-33100}" --tokens "${TOKENS:-256}" \
      --lean-gemv "$family" --verify-attention "$attn" --lean-norm "$norm" ${l2:+--lean-l2-prefetch} --oracle-k "${FORCED_ORACLE_K:-4}" --lookup ${replay:+--replay "$replay"} ${texts:+--replay-text "$texts"} --repeats "${REPEATS:-2}" \
      --json "$out/bench.jsonl" 2>&1 | tee -a "$out/bench.log"
  done
  if [[ $part == norm ]]; then
    # each forced shape's engine without speculation at the same contexts: the node the forced rows' random-prompt
    # and recorded-text speeds are judged against (>= 0.97x and never slower: scripts/gpu_check_targets.py)
    for shape in $(for pair in ${FORCED-llama-8b:tensor-core:per-row}; do echo "${pair%%:*}"; done | sort -u); do
      python3 -m expresslane.engine.decode.bench --random-shape "$shape" --device cuda --dtype bfloat16 \
        --contexts "${FORCED_CONTEXTS:-1024,32768}" --max-seq-len "${MAX_SEQ_LEN:-33100}" --tokens "${TOKENS:-256}" \
        --speculation-k 0 --repeats "${REPEATS:-2}" --json "$out/bench.jsonl" 2>&1 | tee -a "$out/bench.log"
    done
    return 0
  fi
  for shape in ${SHAPES:-llama-8b llama-1b}; do
    echo "== bench $shape"
    python3 -m expresslane.engine.decode.bench --random-shape "$shape" --device cuda --dtype bfloat16 \
      --contexts "${CONTEXTS:-1024,8192,32768}" --max-seq-len "${MAX_SEQ_LEN:-33100}" --tokens "${TOKENS:-256}" \
      --oracle-k "${ORACLE_K:-1,2,3,4}" --lookup ${replay:+--replay "$replay"} ${texts:+--replay-text "$texts"} --repeats "${REPEATS:-2}" \
      --json "$out/bench.jsonl" 2>&1 | tee -a "$out/bench.log"
    # a plain engine (no speculation: the CUDA-core GEMVs, models/lean.py) at the same contexts: the per-user
    # speed of a node that never speculates, the reference for a speculating node's plain steps
    [[ ${PLAIN_ENGINE:-1} == 1 ]] && python3 -m expresslane.engine.decode.bench --random-shape "$shape" \
      --device cuda --dtype bfloat16 --contexts "${CONTEXTS:-1024,8192,32768}" --max-seq-len "${MAX_SEQ_LEN:-33100}" \
      --tokens "${TOKENS:-256}" --speculation-k 0 --repeats "${REPEATS:-2}" --json "$out/bench.jsonl" 2>&1 \
      | tee -a "$out/bench.log"
    # the same plain engine with each kernel's block shape the fastest alone (--step-tune off): what the warm-up's
    # timing of the whole step (models/step_tune.py) wins, side by side on the same card
    if [[ " ${STEP_TUNE_OFF-} " == *" $shape "* ]]; then
      echo "== bench $shape plain engine, --step-tune off"
      python3 -m expresslane.engine.decode.bench --random-shape "$shape" --device cuda --dtype bfloat16 \
        --contexts "${STEP_TUNE_OFF_CONTEXTS:-1024,32768}" --max-seq-len "${MAX_SEQ_LEN:-33100}" \
        --tokens "${TOKENS:-256}" --speculation-k 0 --step-tune off --repeats "${REPEATS:-2}" \
        --json "$out/bench.jsonl" 2>&1 | tee -a "$out/bench.log"
    fi
  done
}

summary() {  # one table: the tests' closing line, then one row per bench result
  local out="$1"
  {
    # the device's copy of the tree may carry an older .git: the caller names the commit it sent
    echo "== GPU check $(date -u +%FT%TZ) commit ${EXPRESSLANE_COMMIT:-unknown (set EXPRESSLANE_COMMIT)}"
    echo "tests: $(grep -E "(passed|failed|error)" "$out/pytest.txt" 2>/dev/null | tail -1)"
    [[ -s $out/phases.txt ]] && echo "wall: $(paste -sd, "$out/phases.txt" | sed 's/,/, /g')"
    # a tests-only run (part tests) has no bench output: no table, the targets still read pytest.txt
    [[ -s $out/bench.jsonl ]] && python3 - "$out/bench.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
# "x node": against an engine built without speculation at the same shape and context (the speed a node with
# --speculation off gives; speculation on by default must keep >= 0.97x of it where nothing repeats)
node = {(r["model"], r["context"]): r["tok_per_s"] for r in rows
        if not r.get("speculation_k", 1) and r.get("step_tune", True)}
print(f"{'shape':10} {'gemv':19} {'ctx':>6} {'mode':19} {'tok/s':>8} {'of bound':>8} {'x plain':>7} {'x node':>6} {'accept':>6} "
      f"{'exact':>5} {'T=1 ms':>7} {'T=5/T=1':>7}")
for r in rows:
    shape = r["model"].rstrip("/").rsplit("/", 1)[-1]
    ref = node.get((r["model"], r["context"]))
    xnode = f"{r['tok_per_s'] / ref:.3f}" if ref else "-"
    spec = r.get("spec") or {}
    chosen = (r.get("family") or {}).get("family")  # a per-request engine's row: that family's forwards
    times = {int(k): v for k, v in ((r.get("step_ms_by_rows_by_family") or {}).get(chosen)
                                    or r["step_ms_by_rows"]).items()}
    ratio = times[max(times)] / times[1] if len(times) > 1 else float("nan")
    ob = f"{100 * r['of_bound']:.1f}%" if r.get("of_bound") else "-"
    acc = f"{spec.get('mean_acceptance', 0):.2f}" if r["mode"] != "plain" else "-"
    mode = r["mode"] if r.get("speculation_k", 1) else "plain-eng"  # an engine built without speculation
    mode += "" if r.get("step_tune", True) else " untuned"  # block shapes the fastest alone (--step-tune off)
    gemv = (str(r.get('gemv')).replace("per-request", "per-req") + (":" + chosen[0] + "c" if chosen else "")
            + ("+sh" if r.get("verify_attention") == "shared" else "")
            + ("+tail" if r.get("lean_norm") == "tail" else "") + ("+l2" if r.get("l2_prefetch") else ""))
    print(f"{shape:10} {gemv:19} {r['context']:>6} {mode:19} {r['tok_per_s']:>8.1f} {ob:>8} {r['speedup']:>6.2f}x {xnode:>6} "
          f"{acc:>6} {str(r.get('matches_plain', '-')):>5} {times[1]:>7.3f} {ratio:>7.2f}")
# where each engine's start went (decode/engine.py warmup_report): Triton compiles (on the compile threads) and
# block-shape timing within its warm-up
seen = set()
for r in rows:
    w = r.get("warmup")
    key = (r["model"], r.get("gemv"), r.get("speculation_k"), r.get("verify_attention"), r.get("lean_norm"),
           r.get("l2_prefetch"), r.get("step_tune"))
    if not w or key in seen:
        continue
    seen.add(key)
    shape = r["model"].rstrip("/").rsplit("/", 1)[-1]
    # a per-request engine warms each GEMV family's runner in turn: one report each (decode/engine.py)
    for gemv, w in (w["families"].items() if "families" in w else [(str(r.get("gemv")), w)]):
        phases = " ".join(f"{k} {v:.1f}" for k, v in w.get("phases", {}).items())
        print(f"start {shape:9} {gemv:11} k={r.get('speculation_k')}: load+warm-up {r.get('load_warmup_s', 0):.1f} s, "
              f"warm-up {w['seconds']:.1f} s ({phases}); compiles {w.get('compile_s', 0):.1f} s "
              f"({w.get('compile_jobs', 0)} kernels, {w.get('compile_threads', '?')} threads), "
              f"block-shape timing {w.get('pick_timing_s', 0):.1f} s ({w.get('picks', 0)} picks)")
        for pick in w.get("picked", []):  # the block shapes it picked (one-row us, rows-row us where timed)
            print(f"    {pick}")
        for t in w.get("step_tuned", []):  # the whole step's us with each candidate (models/step_tune.py)
            rows_us = t.get("step_us_rows")
            print(f"    step-timed {t['kernel']} {t['n']}x{t['k']}: {t['was']} -> {t['best']}; step us "
                  + ", ".join(f"{c} {v}" + (f"/{rows_us[c]}" if rows_us and c in rows_us else "")
                              for c, v in t["step_us"].items()))
EOF
    python3 scripts/gpu_check_targets.py "$out"
    [[ -s $out/lean-norm.jsonl ]] && python3 - "$out/lean-norm.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("lean norm (docs/bench/2026-12-05-h100-gpu-check/probe_lean_norm.py): each step's forward ms by rows; x cuda-core: its one-row step over "
      "the CUDA-core family's; tokens: 64 greedy tokens as the kernel placement's")
for r in rows:
    if "sync_us" in r:  # the host's path: us a forward, queued / after a read / replays / verifies with their read
        print(f"  {r['shape']:9} {r['gemv']:11} ctx {r['context']:>6}  us a forward: "
              + ", ".join(f"{k} {v:.1f}" for k, v in r["sync_us"].items()))
        continue
    t = {int(k): v for k, v in r["step_ms_by_rows"].items()}
    x = r.get("x_cuda_core_t1")
    l2 = "+l2" if r.get("l2_prefetch") else "   "
    print(f"  {r['shape']:9} {r['gemv']:11} {r['norm']:6}{l2} run {r['run']} ctx {r['context']:>6}  T=1 {t[1]:.3f} ms  "
          f"T=5/T=1 {t[max(t)] / t[1]:.2f}  x cuda-core {x if x is None else round(x, 3)}  "
          f"tokens {r['tokens_as_kernel_norm']}")
EOF
    [[ -s $out/verify-attention.jsonl ]] && python3 - "$out/verify-attention.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("verify attention (one launch): per-row (the lean step's) vs shared, x the one-row step; exact: every row "
      "its own one-row launch's bits")
for r in rows:
    if r["rows"] > 1:
        print(f"  {r['shape']:9} ctx {r['context']:>6} R={r['rows']}  per-row {r['per_row_ms']:.4f} ms "
              f"({r['per_row_x_t1']:.2f}x)  shared {r['shared_ms']:.4f} ms ({r['shared_x_t1']:.2f}x)  exact {r['exact']}")
EOF
    true  # a part without the optional outputs above is not a failed summary
  } | tee "$out/summary.txt"
}

case "${1:-}" in
  prepare) prepare ;;
  summary) summary "${2:?usage: gpu_check.sh summary OUTDIR (with pytest.txt and bench.jsonl)}" ;;
  run)
    out="${2:?usage: gpu_check.sh run OUTDIR [all|tests|bench]}"
    part="${3:-all}"
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    install_carried || exit 1
    # the whole run stops by RUN_BUDGET_S (570: under the device machine's 10 minutes a call, with time for the
    # summary), counted from the script's start (bash's SECONDS: the install above included): a phase that would
    # run past it is interrupted, what it wrote stays, and the table is still printed
    deadline=${RUN_BUDGET_S:-570}
    : >"$out/phases.txt"
    if [[ $part == all || $part == tests ]]; then
      t0=$SECONDS; budget=${TEST_BUDGET_S:-400}
      (( budget > deadline - SECONDS - 10 )) && budget=$((deadline - SECONDS - 10))
      run_tests "$out" "$budget"; echo "tests $((SECONDS - t0)) s" >>"$out/phases.txt"
    fi
    if [[ $part == all || $part == bench || $part == norm || $part == step-tune || $part == per-request ]]; then
      t0=$SECONDS
      if (( deadline - SECONDS >= 10 )); then
        export -f run_bench
        timeout --signal=INT --kill-after=15 "$((deadline - SECONDS))" bash -c 'run_bench "$1" "$2"' _ "$out" "$part"
        rc=$?
        [[ $rc == 124 || $rc == 137 ]] && echo "bench interrupted at the run's budget (RUN_BUDGET_S)" >>"$out/phases.txt"
      else
        echo "bench not run: the run's budget (RUN_BUDGET_S) is spent" >>"$out/phases.txt"
      fi
      echo "bench $((SECONDS - t0)) s" >>"$out/phases.txt"
    fi
    summary "$out"
    ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
