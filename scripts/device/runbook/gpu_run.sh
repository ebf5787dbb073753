#!/usr/bin/env bash
# The GPU runbook as one script: `bash scripts/device/runbook/gpu_run.sh STAGE` on the device machine
# (the `device` tool's `run`, repository root as working directory). Stages, in order, each one
# device call issued right after the previous one (a warm machine is given back after ~30 s idle):
#
#   setup1    carry [".w1"]          megatron-core; stash the first half of the vLLM wheel
#   setup2    carry [".w2"]          vLLM (repacked, no flash-attn .so) + its missing deps
#   setup3    carry [".w3", ".w4"]   Ray; tinker SDK + deps; random Qwen3 0.6B / 1.7B shapes
#   setup_moe carry [".w5"]          optional: vLLM's MoE kernels (scripts/device/packers/prepare_moe_part.sh)
#   setup_lite carry [".wmr"]        instead of setup1-3 when no vLLM is needed (megatron engine tests,
#                                    groups, benches): megatron-core, Ray, tinker and the deps of the
#                                    three the image lacks (the .w2/.w3/.w4 wheels of those, one
#                                    folder of 52 MB); random Qwen3 0.6B (MODELS=...). setup1, setup2
#                                    (and setup_moe) can follow it for vLLM: 4 calls for everything
#   megatron_group                   after setup_lite (or 1-3): the Ray-placed megatron group of one
#                                    rank vs the one-process engine, step time on the 1.7B shape
#                                    (benchmarks/gpu_megatron_group.py, GROUP_ARGS), then the megatron
#                                    engine tests on the group (ENGINE_K="ray_group"; "" runs both
#                                    kinds, "one_process" the one-process engine's)
#   setup_project carry [".wpN"]     oneloop's own locked dependencies the image lacks (Harbor, MCP,
#                                    LiteLLM, ...), one folder per call: PART=1, PART=2, ...
#                                    (scripts/device/packers/prepare_project_parts.py builds them)
#   loop_resume / loop_local / loop_serve   the loop on the GPU: kill -9 and --resume; LoRA RL
#                                    in-process vs through `oneloop serve` (loop_gpu.py)
#   demo_gpu                         after setup_project: `oneloop train --config demo-gpu` (SFT warm
#                                    start, async RL, held-out success before vs after), bounded by
#                                    DEMO_TIMEOUT_S (560); DEMO_ARGS adds dotted overrides
#   megatron                         megatron-vs-torch parity test, save/load test, MFU bench
#   megatron_moe                     megatron engine on the 4-layer Qwen3-30B-A3B-width MoE vs the
#                                    torch engine (loss, logprobs, update, save/load), then MFU
#                                    (active parameters) megatron vs torch at seq 4096
#   megatron_hybrid carry [".wfla"]  megatron engine on the 4-layer Qwen3.6-35B-A3B-width hybrid vs
#                                    the torch engine, fp32 (loss, logprobs, grad norm, update)
#   moe_r3                           after setup_moe: vLLM routed experts (R3) replayed by the torch
#                                    trainer on a 4-layer Qwen3-30B-A3B-width MoE: gap R3 on < off
#   vllm                             vLLM engine tests, engine-vs-raw and weight-sync benches
#   e2e                              the whole local backend on Ray (megatron + vllm): colocated on
#                                    one GPU (CUDA IPC) and, on nvidia-h200-x2, on two GPUs (NCCL);
#                                    dense 0.6B and (after setup_moe) the 32-expert 30B-A3B width
#                                    with R3; E2E_K selects cases; $OUT/triton_cache.txt lists
#                                    the Triton kernels compiled (file time, name)
#   vllm_moe                         after setup_moe: gpu_vllm.py on that MoE, routed experts on,
#                                    vs raw vLLM with and without them
#   vllm_r3   carry [".w5"]          after setup1-2: where returning routed experts (R3) costs
#                                    tokens/s: raw vLLM R3 on/off and our engine, eager and CUDA
#                                    graphs, vLLM's step methods timed (benchmarks/r3prof)
#   moe_mb                           megatron vs torch engine on the 30B-A3B-width MoE per
#                                    micro-batch size (8k..64k tokens), one variant per process
#   nccl      (nvidia-h200-x2)       NCCL in-flight sync: ours vs vLLM's stock weight-transfer API
#   tp        (nvidia-h200-x2)       megatron engine at TP=2 vs TP=1 (tests/gpu/test_megatron_tp.py)
#   mfu                              megatron MFU per speed switch vs baseline vs torch (~4 min;
#                                    starts no variant after 200 s: MFU_ARGS="--time-budget-s 400")
#   mfu_test                         speed switches on vs off: same logprobs/loss/step (0.6B)
#   lora                             LoRA adapters as vLLM LoRA modules: engine tests (snapshots,
#                                    logprobs vs torch merged weights, inflight swap) + Ray run
#   mlora                            megatron-engine LoRA vs torch-engine LoRA (loss, logprobs,
#                                    adapter after a step, merged weights) + LoRA save/load
#   mlora_tp  (nvidia-h200-x2)       megatron-engine LoRA at TP=2 vs TP=1 (loss, logprobs, grad
#                                    norm, adapter after a step, merged weights, per-rank save/load)
#   offload                          megatron optimizer CPU offload vs not (0.6B): loss, weights,
#                                    state on the CPU, GPU memory after the step, save/load
#   pp        (nvidia-h200-x2)       megatron engine at PP=2 vs PP=1 (loss, logprobs, grad norm,
#                                    update cosine, forward_only, per-rank save/load; test_megatron_pp)
#   cp        (nvidia-h200-x2)       megatron engine at CP=2 vs CP=1, seq 4096, no TE (loss, logprobs,
#                                    grad norm, update cosine, forward_only, save/load; test_megatron_cp)
#   te1..te4  carry [".wteN"]        optional, after setup1-3: stash a part of TransformerEngine's wheel
#   te5       carry [".wte5"]        join and install TE 2.20.2 (+ its torch extension built here by
#                                    scripts/device/packers/prepare_te_parts.sh); from then on the megatron
#                                    engine's default layer spec is TE's (local.megatron.speed.layer_spec)
#   te_tests                         after te5: megatron engine on the TE spec and the local spec vs the
#                                    torch engine, save/load on both, a TE checkpoint on the local spec,
#                                    LoRA (local spec), optimizer offload (TE's FusedAdam state in and out)
#                                    Then `mfu` with MFU_ARGS="--variants baseline,all,te,te_mb8k,torch"
#                                    and `e2e` (the whole backend, TE spec) run on TE too.
#
# Build the carried folders here first: ../shared/device/prepare_parts.sh (.w1-.w3) and
# `pip download` of tinker 0.38 and its deps the image lacks into .w4 (see docs in README "GPU").
# Figures land in $OUT (JSON per test / bench) and in the printed RESULT / FIGURES lines.
set -uo pipefail
stage="${1:?stage}"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
export VLLM_WORKER_MULTIPROC_METHOD=spawn HF_HUB_OFFLINE=1 TINKER_TELEMETRY=0 RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0  # no NVLink multicast on the lent machines (device KINDS.md)
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT" /tmp/site /tmp/w /tmp/models
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$@"; }
pytest_gpu() { python3 -m pytest -m gpu -o addopts="" -p no:cacheprovider -q -rA "$@"; }
if [[ ! "$stage" =~ ^(setup1|setup2|setup_lite)$ ]] && [ ! -d /tmp/site/megatron ]; then
  echo "machine lost (no /tmp/site/megatron): start again at setup1" >&2; exit 3
fi
case "$stage" in
  setup1)   # the megatron-core wheel rides in .w1, or in .w2 when the tree leaves .w1 no room
    cp .w1/vllm.part0 /tmp/w/
    if ls .w1/megatron_core*.whl >/dev/null 2>&1; then pip_target .w1/megatron_core*.whl; fi
    nvidia-smi --query-gpu=name,memory.total --format=csv ;;
  setup2)
    if ls .w2/megatron_core*.whl >/dev/null 2>&1; then pip_target .w2/megatron_core*.whl; fi
    cat /tmp/w/vllm.part0 .w2/vllm.part1 > /tmp/w/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
    pip_target /tmp/w/vllm-0.26.0-*.whl .w2/deps/*.whl
    sed -i 's/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:/' /tmp/site/vllm/vllm_flash_attn/__init__.py
    python3 -c "import vllm; print('vllm', vllm.__version__)" ;;
  setup3)
    pip_target .w3/ray*.whl .w4/*.whl
    for shape in ${MODELS-0.6b 1.7b}; do   # MODELS="" builds none
      python3 scripts/device/runbook/build_random_qwen3.py --shape "$shape" --out "/tmp/models/qwen3-$shape"
    done
    python3 -c "import ray, tinker, megatron.core; print('ray', ray.__version__, 'tinker', tinker.__version__)" ;;
  setup_lite)   # carry [".wmr"]: megatron-core, Ray, tinker + their missing deps, no vLLM
    pip_target .wmr/*.whl
    for shape in ${MODELS-0.6b}; do
      python3 scripts/device/runbook/build_random_qwen3.py --shape "$shape" --out "/tmp/models/qwen3-$shape"
    done
    python3 -c "import ray, tinker, megatron.core; print('ray', ray.__version__, 'tinker', tinker.__version__)" 2>&1 | tail -1
    nvidia-smi --query-gpu=name,memory.total --format=csv ;;
  megatron_group)   # issue 18 at DP = 1: bench (GROUP_BENCH_S=0 skips it), then the engine tests
    # on the group, output streamed (-s); each bounded (`timeout` runs programs, not pytest_gpu)
    if [ "${GROUP_BENCH_S:-240}" != 0 ]; then
      # shellcheck disable=SC2086
      timeout "${GROUP_BENCH_S:-240}" python3 benchmarks/gpu_megatron_group.py --model-dir /tmp/models \
        ${GROUP_ARGS:-} > "$OUT/megatron_group_bench.log" 2>&1 || tail -40 "$OUT/megatron_group_bench.log"
      grep '^RESULT' "$OUT/megatron_group_bench.log" | grep -v '^RESULT {'
    fi
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b timeout "${GROUP_TESTS_S:-300}" python3 -m pytest \
      -m gpu -o addopts="" -p no:cacheprovider -q -rA -s tests/gpu/test_megatron_engine.py \
      -k "${ENGINE_K-ray_group}" > "$OUT/megatron_group_tests.log" 2>&1
    echo "tests rc=$?"
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES" "$OUT/megatron_group_tests.log" | tail -20
    tail -30 "$OUT/megatron_group_tests.log" ;;
  setup_moe)   # carry [".w5"] (scripts/device/packers/prepare_moe_part.sh): vLLM's MoE kernels
    xz -dc .w5/_moe_C_stable_libtorch.abi3.so.xz > /tmp/site/vllm/_moe_C_stable_libtorch.abi3.so
    python3 -c "import vllm._moe_C_stable_libtorch" 2>&1 | tail -1 ;;
  setup_project)   # carry [".wp$PART"]: after setup3, one call per folder
    pip_target ".wp${PART:?PART=1,2,... names the carried folder}"/*.whl
    python3 -c "import harbor, mcp, litellm, oneloop.loop.train; print('oneloop runtime ready')" 2>&1 | tail -1 ;;
  demo_gpu)
    # shellcheck disable=SC2086
    timeout --signal=INT --kill-after=20 "${DEMO_TIMEOUT_S:-560}" python3 -m oneloop.cli train \
      --config demo-gpu --run-dir /tmp/runs/demo-gpu backend.run_dir=/tmp/runs/demo-gpu/backend \
      ${DEMO_ARGS:-} > "$OUT/demo_gpu.log" 2>&1
    echo "rc=$?"
    cp /tmp/runs/demo-gpu/*.jsonl "$OUT/" 2>/dev/null
    grep -vE "^\s*$" "$OUT/demo_gpu.log" | grep -E "eval|held-out|Error|error|rate" | tail -30
    tail -25 "$OUT/demo_gpu.log" ;;
  loop_resume|loop_local|loop_serve)   # after setup_project: scripts/device/runbook/loop_gpu.py
    # resume: demo-gpu killed with SIGKILL after step 2, then --resume (and the warm start's
    # weights written as an HF directory); local / serve: LoRA RL on that base, in-process vs
    # through `oneloop serve` (serve prints both side by side). Run in this order on one machine.
    python3 scripts/device/runbook/loop_gpu.py "${stage#loop_}" --out "$OUT" ${LOOP_ARGS:-} \
      2>&1 | grep -E "^RESULT|Error|error" | tail -20 ;;
  megatron)
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b pytest_gpu tests/gpu/test_megatron_engine.py 2>&1 | tail -40
    python3 benchmarks/gpu_train.py --model-dir /tmp/models 2>&1 | grep -E "RESULT|Error|error" | tail -20 ;;
  megatron_moe)   # megatron MoE engine vs torch engine on the 4-layer Qwen3-30B-A3B width, then
    # training tokens/s and MFU (active parameters) at seq 4096, megatron vs torch, side by side
    python3 scripts/device/runbook/build_random_qwen3.py --shape 30b-a3b-4l --out /tmp/models/qwen3-30b-a3b-4l
    ONELOOP_GPU_MOE_DIR=/tmp/models/qwen3-30b-a3b-4l timeout "${MOE_TEST_S:-400}" python3 -m pytest \
      -m gpu -o addopts="" -p no:cacheprovider -q -rA tests/gpu/test_megatron_moe.py \
      > "$OUT/megatron_moe.log" 2>&1
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES" "$OUT/megatron_moe.log" | tail -20
    tail -25 "$OUT/megatron_moe.log"
    [ "${MOE_MFU:-1}" = 0 ] && exit 0   # MOE_MFU=0: the tests only (moe_mb measures per variant)
    python3 benchmarks/gpu_mfu.py --model-dir /tmp/models --shape 30b-a3b-4l \
      --variants all,all_sequential_experts,torch \
      --profile none --time-budget-s 300 ${MFU_ARGS:-} > "$OUT/mfu_moe.log" 2>&1 || tail -40 "$OUT/mfu_moe.log"
    grep -E "RESULT|Error|error" "$OUT/mfu_moe.log" | tail -12 ;;
  megatron_hybrid)   # carry [".wfla"]: flash-linear-attention, fla-core 0.6.0 and einops wheels
    # (`pip download --no-deps -d .wfla flash-linear-attention==0.6.0 fla-core==0.6.0 einops`);
    # megatron hybrid engine vs torch engine, fp32, on the 4-layer Qwen3.6-35B-A3B text width
    # HYBRID_SHAPE=35b-a3b-4l-32e: the same layers with 32 of the 256 experts (a shorter call)
    pip_target .wfla/*.whl
    hybrid="/tmp/models/qwen3.6-${HYBRID_SHAPE:-35b-a3b-4l}"
    python3 scripts/device/runbook/build_random_qwen3.py --shape "${HYBRID_SHAPE:-35b-a3b-4l}" --out "$hybrid"
    ONELOOP_GPU_HYBRID_DIR="$hybrid" pytest_gpu tests/gpu/test_megatron_hybrid.py \
      > "$OUT/megatron_hybrid.log" 2>&1
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES" "$OUT/megatron_hybrid.log" | tail -20
    tail -25 "$OUT/megatron_hybrid.log" ;;
  vllm)
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b pytest_gpu tests/gpu/test_vllm_engine.py 2>&1 | tail -40
    python3 benchmarks/gpu_vllm.py --model-dir /tmp/models/qwen3-0.6b 2>&1 | grep -E "RESULT|Error|error" | tail -20 ;;
  e2e)   # E2E_K="moe and colocated" picks cases (-k); the MoE cases need setup_moe.
    # A fresh Triton cache per call, listed after (mtime, kernel): which kernels vLLM / megatron
    # JIT-compiled when, to line up with the sync records' wall-clock starts.
    export TRITON_CACHE_DIR="/tmp/triton-e2e-$(date +%s)"
    python3 scripts/device/runbook/build_random_qwen3.py --shape 30b-a3b-4l-32e --out /tmp/models/qwen3-30b-a3b-4l-32e
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b ONELOOP_GPU_MOE_E2E_DIR=/tmp/models/qwen3-30b-a3b-4l-32e \
      pytest_gpu tests/gpu/test_local_gpu_backend.py -k "${E2E_K:-dense or moe}" > "$OUT/e2e.log" 2>&1
    find "$TRITON_CACHE_DIR" -name '*.json' ! -name '__grp__*' -printf '%T@ %P\n' 2>/dev/null \
      | sort -n > "$OUT/triton_cache.txt"
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES" "$OUT/e2e.log" | tail -20; tail -30 "$OUT/e2e.log" ;;
  vllm_moe)   # after setup_moe: our engine vs raw vLLM decode on the 32-expert 30B-A3B width,
    # routed experts (R3) returned, and raw vLLM without them (the record's cost)
    python3 scripts/device/runbook/build_random_qwen3.py --shape 30b-a3b-4l-32e --out /tmp/models/qwen3-30b-a3b-4l-32e
    python3 benchmarks/gpu_vllm.py --model-dir /tmp/models/qwen3-30b-a3b-4l-32e --routed-experts \
      --skip-sync --eager --reps "${REPS:-3}" > "$OUT/vllm_moe.log" 2>&1 || tail -40 "$OUT/vllm_moe.log"
    grep RESULT "$OUT/vllm_moe.log" | tail -12 ;;
  vllm_r3)   # carry [".w5"] (setup_moe's library, unpacked here when missing): where R3's cost
    # goes. Per mode (R3_MODES: eager, graphs = CUDA graphs + compile, our engine's MoE default),
    # one process: our engine (R3 on), raw vLLM R3 on, raw vLLM R3 off, each method of vLLM's step
    # timed in every process (benchmarks/r3prof); R3_ARGS="--raw-only --interleave": raw vLLM on
    # and off alive together, reps alternating; R3_ARGS="--interleave --all-alive": our engine too,
    # one more side of those reps (paired per-rep ratios). R3_DEEP=1 adds raw vLLM on/off on
    # R3_DEEP_LAYERS (48) layers of Qwen3-30B-A3B (dummy weights; CUDA graphs unless
    # R3_DEEP_FLAGS=--eager).
    so=/tmp/site/vllm/_moe_C_stable_libtorch.abi3.so
    [ -f "$so" ] || xz -dc .w5/_moe_C_stable_libtorch.abi3.so.xz > "$so"
    python3 scripts/device/runbook/build_random_qwen3.py --shape 30b-a3b-4l-32e --out /tmp/models/qwen3-30b-a3b-4l-32e
    for mode in ${R3_MODES:-eager graphs}; do
      mkdir -p "$OUT/$mode"; flag=""; [ "$mode" = eager ] && flag=--eager
      R3PROF_DIR="/tmp/r3prof/$mode" PYTHONPATH="$PWD/benchmarks/r3prof:$PYTHONPATH" OUT=/tmp \
        timeout "${R3_MODE_S:-250}" python3 benchmarks/gpu_vllm.py --model-dir /tmp/models/qwen3-30b-a3b-4l-32e \
        --routed-experts --skip-sync $flag --reps "${REPS:-3}" ${R3_ARGS:-} > "$OUT/$mode/vllm.log" 2>&1 || tail -20 "$OUT/$mode/vllm.log"
      echo "== $mode"; grep RESULT "$OUT/$mode/vllm.log" | grep -v '"bench": "start"' | tail -12
      python3 benchmarks/r3prof/merge.py "/tmp/r3prof/$mode" "$OUT/$mode/r3prof.json" | grep -v " 0.00[0-9] ms/step"
    done
    if [ "${R3_DEEP:-0}" = 1 ]; then
      mkdir -p "$OUT/deep"
      python3 scripts/device/runbook/build_random_qwen3.py --shape 30b-a3b --out /tmp/models/qwen3-30b-a3b-cfg --config-only
      R3PROF_DIR=/tmp/r3prof/deep PYTHONPATH="$PWD/benchmarks/r3prof:$PYTHONPATH" OUT=/tmp \
        timeout "${R3_DEEP_S:-250}" python3 benchmarks/gpu_vllm.py --model-dir /tmp/models/qwen3-30b-a3b-cfg \
        --raw-only --routed-experts ${R3_DEEP_FLAGS:-} --gpu-mem "${R3_DEEP_MEM:-0.75}" --reps "${REPS_DEEP:-2}" \
        --engine-args "{\"load_format\": \"dummy\", \"hf_overrides\": {\"num_hidden_layers\": ${R3_DEEP_LAYERS:-48}}}" \
        > "$OUT/deep/vllm.log" 2>&1 || tail -20 "$OUT/deep/vllm.log"
      echo "== deep"; grep RESULT "$OUT/deep/vllm.log" | tail -6
      python3 benchmarks/r3prof/merge.py /tmp/r3prof/deep "$OUT/deep/r3prof.json" | grep -v " 0.00[0-9] ms/step"
    fi ;;
  moe_mb)   # issue 19's training goal: megatron (grouped experts) vs torch engine on the 4-layer
    # Qwen3-30B-A3B width at seq 4096, 16 sequences a step, per tokens-per-micro-batch size, one
    # variant per process (a deleted megatron engine leaves ~29 GiB behind); MB_PROFILE names
    # the variants to profile one more step of (top kernels and torch ops; MB_ARGS="--profile-top 60")
    python3 scripts/device/runbook/build_random_qwen3.py --shape 30b-a3b-4l --out /tmp/models/qwen3-30b-a3b-4l
    for v in ${MB_VARIANTS:-torch torch_mb16k torch_mb32k torch_mb64k all all_mb32k all_mb64k}; do
      mkdir -p "/tmp/mb_$v"
      # shellcheck disable=SC2086
      OUT="/tmp/mb_$v" timeout "${MB_VARIANT_S:-150}" python3 benchmarks/gpu_mfu.py --model-dir /tmp/models \
        --shape 30b-a3b-4l --batch 16 --variants "$v" --profile "${MB_PROFILE:-none}" ${MB_ARGS:-} \
        > "$OUT/mb_$v.log" 2>&1 || { echo "$v rc=$?"; tail -4 "$OUT/mb_$v.log"; }
      grep "^RESULT {\"$v\"" "$OUT/mb_$v.log" | cut -c1-600
      sed -n "/^profile $v/,/^RESULT/p" "$OUT/mb_$v.log" | grep -v "^RESULT"
    done ;;
  nccl)
    python3 benchmarks/gpu_nccl_sync.py --model-dir /tmp/models/qwen3-0.6b > "$OUT/nccl.log" 2>&1 \
      || tail -40 "$OUT/nccl.log"
    grep RESULT "$OUT/nccl.log" | tail -20 ;;
  tp)
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b pytest_gpu tests/gpu/test_megatron_tp.py > "$OUT/tp.log" 2>&1
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES" "$OUT/tp.log" | tail -20; tail -30 "$OUT/tp.log" ;;
  mfu)
    # shellcheck disable=SC2086
    python3 benchmarks/gpu_mfu.py --model-dir /tmp/models ${MFU_ARGS:-} > "$OUT/mfu.log" 2>&1 \
      || tail -40 "$OUT/mfu.log"
    grep -E "Error|error" "$OUT/mfu.log" | grep -v '^RESULT' | tail -8
    grep -v '^RESULT {"summary"' "$OUT/mfu.log" | sed -n '/^variant /,$p' ;;
  mfu_test)
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b pytest_gpu tests/gpu/test_megatron_speed.py > "$OUT/mfu_test.log" 2>&1
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES" "$OUT/mfu_test.log" | tail -20; tail -30 "$OUT/mfu_test.log" ;;
  lora)
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b pytest_gpu tests/gpu/test_vllm_engine.py -k lora \
      tests/gpu/test_vllm_lora_backend.py > "$OUT/lora.log" 2>&1
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES|^lora " "$OUT/lora.log" | tail -20; tail -30 "$OUT/lora.log" ;;
  mlora)
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b pytest_gpu tests/gpu/test_megatron_engine.py -k lora > "$OUT/mlora.log" 2>&1
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES" "$OUT/mlora.log" | tail -20; tail -30 "$OUT/mlora.log" ;;
  mlora_tp)
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b pytest_gpu tests/gpu/test_megatron_lora_tp.py > "$OUT/mlora_tp.log" 2>&1
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES" "$OUT/mlora_tp.log" | tail -20; tail -30 "$OUT/mlora_tp.log" ;;
  offload)
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b pytest_gpu tests/gpu/test_megatron_offload.py > "$OUT/offload.log" 2>&1
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES" "$OUT/offload.log" | tail -20; tail -30 "$OUT/offload.log" ;;
  pp)
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b pytest_gpu tests/gpu/test_megatron_pp.py > "$OUT/pp.log" 2>&1
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES" "$OUT/pp.log" | tail -20; tail -30 "$OUT/pp.log" ;;
  cp)
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b pytest_gpu tests/gpu/test_megatron_cp.py > "$OUT/cp.log" 2>&1
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES" "$OUT/cp.log" | tail -20; tail -30 "$OUT/cp.log" ;;
  moe_r3)   # after setup1-3 and setup_moe: vLLM routed experts replayed by the torch trainer
    # engine on a 4-layer Qwen3-30B-A3B-width random MoE (built by the test); R3 on < R3 off
    pytest_gpu tests/backends/engines/test_moe_gpu.py > "$OUT/moe_r3.log" 2>&1
    grep -E "RESULT|^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed" "$OUT/moe_r3.log" | tail -10
    tail -30 "$OUT/moe_r3.log" ;;
  te1|te2|te3|te4)   # carry [".wteN"]: one part of TE's common wheel
    cp ".w$stage"/te.part* /tmp/w/ && ls -l /tmp/w | grep te.part ;;
  te5)
    te_wheel=/tmp/w/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
    cat /tmp/w/te.part* .wte5/te.part* > "$te_wheel"
    echo "$(cat .wte5/te.sha256)  $te_wheel" | sha256sum -c - || exit 4
    pip_target "$te_wheel" .wte5/*.whl
    python3 -c "import transformer_engine as t, transformer_engine.pytorch; print('TE', t.__version__)" ;;
  te_tests)
    ONELOOP_GPU_MODEL_DIR=/tmp/models/qwen3-0.6b pytest_gpu tests/gpu/test_megatron_engine.py \
      tests/gpu/test_megatron_offload.py > "$OUT/te_tests.log" 2>&1
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|FIGURES" "$OUT/te_tests.log" | tail -30; tail -30 "$OUT/te_tests.log" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
