#!/usr/bin/env bash
# One device call of the GPU plan: `bash scripts/gpu_check.sh STAGE` on the H200 (logs and JSON go to $OUT).
#   tests    tests/gpu but the quant tests and the CUDA kernels' (default inductor + CUDA graphs) as parallel pytest
#            processes: on nvidia-h200-x2 (the way to run it) five at once, the candidates' test included; on one GPU
#            four, two at a time, without the candidates'; TESTS_GROUPS picks some of them (0 generate, 1 MTP +
#            stopping criteria, 2 DFlash + oracle,
#            3 ops + attention, 4 candidates; on one H200 all four took more than one 10-minute call on 2026-12-05:
#            TESTS_GROUPS="0 1" then "2 3"; a GPU under 100 GB runs 0 and 1 one at a time, as two 9B processes ran out
#            of an H100's 80 GB: there "0", "1" and "2 3" are a call each, ~290, ~220 and ~240 s on 2026-12-05;
#            and 0's MoE test in a process of its own after the rest, log gpu_tests_0b)
#   candidate-tests  tests/gpu/test_candidates_gpu.py: every kernel candidate at once against the default, 9B
#   bench    scripts/bench.py for the models in $MODELS (default: all three real shapes)
#   spec     scripts/bench_spec.py: MTP k=3 tau=3 and DFlash k=15 tau=6.5 in one process on $SPEC_MODEL
#            (default 27B, default inductor + CUDA graphs; SPEC_ARGS adds options, e.g. --batch 2; SPEC_TAG names
#            the output files, so two runs can share a call: one per GPU with CUDA_VISIBLE_DEVICES on nvidia-h200-x2;
#            SPEC_ARGS="... --also-kernels gdn=fla attention=sdpa" re-times verify + commit under those kernels)
#   sweep    scripts/bench.py fastqwen at batch 1 2 4 8 (ragged rows: prompts of 512 down to 288 at batch 8) on
#            $SWEEP_MODEL (default 27B), then the plot
#   startup  scripts/bench_startup.py on $STARTUP_MODEL (default 9B): cold vs warm start to first token
#   profile  scripts/profile_step.py on $PROFILE_MODEL (default 35B-A3B): the decode step's kernels, µs each; PROFILE_ARGS="--speculate dflash:15" profiles a round
#            (add --phases: its draft and verify as graphs of their own too; PROFILE_ARGS="--layers 16 --verify-block 16
#            --kernels launch=serial": a verify alone on a quarter of the stack, each kernel's own time, ~3.5 min on 27B fp8)
#   gdn      scripts/bench_gdn.py: the verify's gated delta rule (fla, the unrolled walk, the block solve's tiles) per T
#   code     the same run as profile with TORCH_LOGS=output_code: the inductor source of every compiled graph in
#            $OUT/output_code.txt (which kernel of the profile does what, for launch work between sessions)
#   attention scripts/bench_attention.py (SDPA over the whole cache vs the split-KV kernel) and its GPU test
#   qbench   scripts/bench.py on $QMODEL (default 27B): fastqwen bf16 vs quantized ($SCHEME, default fp8-weight;
#            one scheme a process: quantizing is in place; QBENCH_ARGS, e.g. --quant-lm-head, or
#            --kernels launch=pdl for both systems)
#   quality  scripts/quant_quality.py on 27B: per-linear and logit error, top-1 agreement per scheme, and the same
#            for weight noise of each format's size ($QUALITY_NOISE, default 0.03 0.1: fp8's and int4's)
#   candidates scripts/bench.py: fastqwen vs fastqwen with an alternative kernel in one process, on $CAND_MODEL
#            (default 35B-A3B) with $CAND_SYSTEMS (default fastqwen+grouped-pdl-experts; also fastqwen+gather-experts,
#            fastqwen+split-attention, fastqwen+sdpa-attention,
#            fastqwen+gemv-linears, fastqwen+fla-gdn, fastqwen+separate-projections, fastqwen+combo-kernels:
#            inductor's combo kernels, fastqwen+serial-launch: no programmatic dependent launch, fastqwen+torch-linears:
#            cuBLAS for every bf16 linear, fastqwen-int4+inductor-reductions: the decode row's norms looped, as
#            before 2026-12-05) and
#            $CAND_ARGS (e.g.
#            CAND_MODEL=qwen3.5-27b CAND_SYSTEMS=fastqwen+split-attention CAND_ARGS="--prompt-len 32768", or
#            CAND_ARGS="--max-seq-len 131072": a long cache under a 512-token context, or
#            CAND_ARGS="--prompt-len 131072 --repeats 1": every call prefills 128K again; 27B, two systems ~6 min)
#   commit   scripts/bench_commit.py: the speculative commit, all GDN layers in one launch vs one per layer
#   ncu      Nsight Compute on one weight-streaming launch (scripts/gemv_once.py; $NCU_ARGS, default the 27B
#            int4 gate | up at one row, e.g. NCU_ARGS="--format int4 --shape 5120 17408 --row-major"): throughput,
#            memory workload and warp stall sections, stall reasons per issue, pipe use and instructions executed, to $OUT/ncu.txt (needs a machine whose ncu reads counters)
#   ncu-int4 the same sections for the CUDA int4 kernels on the 27B's gate | up at one row: the folded kernel
#            (int4_gemv_fold) and its loads-only probe (int4_gemv_rows, at the fold's 7 blocks an SM), one launch each
#            (scripts/gemv_times.py under ncu, to $OUT/ncu_fold.txt and ncu_rows.txt; ~1 min): on the H200 the probe
#            reads at 4.20 TB/s and the fold at 3.52 (2026-12-07), and their stall reasons say whether the fold's
#            decode, with no load of its own in flight, is what is left (DESIGN-NOTES, session f)
#   sweep-gemv scripts/bench_quant.py --sweep: the weight-streaming kernel's launch configs (BITS decoding too) per
#            layer of $SWEEP_SHAPES (default 27b; 35b-a3b; the lm_heads, bf16 and fp8: 9b-head 35b-a3b-head
#            27b-head) and row bucket ($SWEEP_M, default 1 4 16), formats
#            $SWEEP_FORMATS (default fp8-weight int4 bf16), written into fastqwen/ops/gemv_configs.json (copied to
#            $OUT: commit it). All three formats on 27B is ~7 min: split it over calls by format, or over both GPUs
#            with SWEEP_TAG=a / b (each writes only its results to gemv_configs_<tag>.json; merge them into the
#            committed table with python scripts/bench_quant.py --merge-tables A B). SWEEP_KSTEP="2 4": only wide steps (with the
#            config in use). SWEEP_LOWP=3: only the
#            fp16-dot configs (fp8 at M > 1; int4 at one row: its fp16 pair arithmetic), beside the one in use;
#            SWEEP_LOWP="3 4" adds int4's mma.sync configs. SWEEP_ROW_ORDER=1: int4 codes in row order, not tiled. SWEEP_EXPERTS="1 8 16": then the grouped kernel's configs for
#            the 35B-A3B routed experts at those token counts (9 pairs a token), in the same formats.
#   cuda-tests tests/gpu/test_cuda_kernels_gpu.py: the CUDA int4 and fp8-weight kernels (kernels={"int4" |
#            "fp8_weight": "cuda"}, built with nvcc here) against their references and the Triton kernels' step;
#            cut at CUDA_TESTS_TIMEOUT seconds (480), so a kernel that hangs still leaves its log (-v: the test it hung in);
#            CUDA_TESTS_ARGS adds pytest arguments (split on spaces), CUDA_TESTS_K a -k expression (one argument, e.g.
#            CUDA_TESTS_K="fold")
#   cuda-times the CUDA int4 kernel (folded and not) and its loads-only probe with their error against the reference,
#            then the Triton and CUDA kernels' times per layer (scripts/gemv_times.py --kernel triton cuda): int4 on
#            the 27B's layers and head at each BATCH, pipelining and grid target, then both at 4, 8, 16 rows
#   ceiling  int4's Triton and CUDA kernels (folded and not) and the loads-only probe, each cold and --warm, on the "l2"
#            shapes (21 and 31 MB: L2-resident warm) and the 27B's, 1 and 4 rows (~3 min): warm on the l2 shapes is a
#            kernel's rate with HBM out of the way (on an H100, 2026-12-05: 2.0-2.4 TB/s against the probe's 3.3-3.6:
#            its own latency bounds it). Then the CUDA kernel on the 27B's layers cycling through 14 GB of weight copies
#            (--spread) beside the usual ~2 L2 sizes (H100, 2026-12-05: +4% a GDN layer's GEMVs, of the ~11% a step's
#            profile shows)
#   bars     issue #4's decode bars, each system alone in its process: BARS=27b (default: bf16, fp8-weight and int4,
#            quantized lm_heads; ~4.5 min on an H100) or BARS=35b (bf16 and fp8-weight, the lm_head fp8 too: until
#            2026-12-07 it was left bf16 here, unlike the 27B bars and the 1.403× of 2026-12-03); BARS_ARGS adds
#            bench arguments, BARS_SYSTEMS more systems, each in its own process beside the bars' (e.g.
#            BARS_SYSTEMS=fastqwen-fp8-weight+fused-expert-act: the fp8 experts' activation A/B in the same call)
#   router   one token's router matmul and routing (ops/router.py router_route) at FUSED_CONFIG against the two launches
#            and at $ROUTER_TILES (RN:RK:WARPS; default the unsplit tiles, one partial for the last program to read and
#            one warp's shuffles for its rounds: 2:2048:1 1:2048:1 4:1024:1 2:1024:1, and 8:256:1), 40 cold 35B-A3B
#            routers in a graph (scripts/bench_expert_mlp.py --tables router; ~1 min). A tile that wins here goes
#            to the step through `ab` (FUSED_CONFIG changed in the tree), as kernel-level wins have lost in the step
#   fit      int4's one-row GEMV as a fixed part plus a rate (docs/DESIGN-NOTES.md, "The int4 GEMV's time as a fixed part
#            plus a rate"): the folded kernel, the cluster-summed one (where built) and the loads-only probe on the
#            27B's layers and head, alone and then chained with PDL, and each one's line (scripts/gemv_fit.py: fixed
#            µs + bytes ÷ TB/s; ~1.5 min on an H200); on an H200 it tells whether the load path or the decode's start
#            and drain holds the rate at ~80% of the read ceiling
#   rotate   the folded int4 kernel with rotating loads over 2 and 3 slots (int4_cuda.FOLD 2 and 3, candidates)
#            against the fold (FOLD 1) and the loads-only probe: per-layer times and fit lines on the 27B's layers and
#            head at one row (--check: their error), then a 27B int4 decode (int4 lm_head) with each FOLD of
#            $ROTATE_FOLDS (default "1 2 3"), each in a process of its own (~2 min each; ~8 min in all on an H100);
#            their GPU test: tests/gpu/test_cuda_kernels_gpu.py -k folded (the same bits as FOLD 1). On an H100
#            (2026-12-07) FOLD 2 was 0.984x FOLD 1's step: the H200 is the question
#   pair     int4's pair kernel (int4_cuda.PAIR, the default past 8 rows): per-layer times at 9 and 16 rows against the
#            one-strip instance, at TARGET_BLOCKS 2048 and 4096 (the plan counts 16-row strips, so the pair kernel's
#            grid has half as many blocks), then a 27B int4 verify of 16 positions on the first 16 layers with PAIR off and on, each in a process
#            of its own (~6 min)
#   prologue the GPU tests of the verify prologue (kernels={"conv": "fused-verify"}) and of attention_prep's rope
#            tables, then a 27B int4 verify of 16 positions on the first 16 layers with and without fused-verify in
#            one process (~4 min)
#   ab       an A/B of two builds, each side in processes of its own: $AB_CMD (one command line) run in .ab/base (a copy
#            of another commit's fastqwen/ and scripts/, made before the call with `rm -rf .ab/base && mkdir -p .ab/base
#            && git archive BASE fastqwen scripts | tar -x -C .ab/base`, carried: carry [".whl", ".ab"]) and in the
#            working tree, in the order base, tree, base, tree (AB_ROUNDS=1: base, tree); AB_TAIL lines of each (default
#            20). E.g. the pair kernel
#            on a branch against main: AB_CMD="python scripts/gemv_times.py --format int4 --shapes 27b 27b-head
#            --kernel cuda --rows 16 9 --check | grep '^|'"
#   cuda-times-fp8 the same for fp8-weight's register kernel on the 27B's and 35B-A3B's layers.
#            The step's A/B is `candidates` with CAND_MODEL=qwen3.5-27b CAND_SYSTEMS="fastqwen-int4+triton-int4"
#            CAND_ARGS="--isolate --quant-lm-head --no-autotune" (fp8: fastqwen-fp8-weight+cuda-fp8-weight)
#   suite    the pytest-benchmark suite (tests/benchmarks, 9B plain and MTP) saved as a baseline under
#            tests/benchmarks/baselines (copied to $OUT: commit it); later runs compare against it
#   reductions $RED_MODEL's (default 27B) int4 step as $RED_SYSTEMS, each alone in its process (default: as it is
#            and with kernels["reductions"] "inductor"), then with the kernels $RED_ALL (default: the three launch
#            cuts of 2026-12-05 all undone, reductions=inductor attn_glue=separate gdn_norm=separate; ~6.5 min);
#            $RED_ARGS adds bench arguments to all (e.g. "--options triton.enable_pdl=True": inductor's kernels with
#            PDL too; "--options triton.multi_kernel=1" was 1.030x on 2026-12-05, H100)
#   quant    tests/gpu/test_quant_gpu.py, then scripts/bench_quant.py (per-GEMM table, M = 1..16; QUANT_ARGS, e.g.
#            "--only fastqwen" skips torchao and gemlite, measured on 2026-11-30); gemlite is
#            compared when its wheel is in .whl/ (here: pip download gemlite==0.6.0.post2 --no-deps, then
#            pip wheel --no-deps -w .whl <the sdist>)
# Prefix with the wheel install line from README (fla and torchao are not on the machine).
set -uo pipefail
stage=${1:?stage: tests | bench | spec}
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
case "$stage" in
  tests) # pytest processes at once (the 9B ones compile ~2 min each, CPU-bound; each holds up to ~60 GB with its
         # fp32 near-tie copy): on two GPUs all five, the candidates' test too; on one, four, two at a time
         ngpu=$(nvidia-smi -L | wc -l)
         mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
         group() { local i=$1 gpu=$(($2 < ngpu ? $2 : 0)); shift 2  # log index, GPU (0 on one GPU), pytest args
                   case " ${TESTS_GROUPS:-0 1 2 3 4} " in *" ${i%[a-z]} "*) ;; *) return 0 ;; esac  # (0b: 0's)
                   CUDA_VISIBLE_DEVICES=$gpu python -m pytest -q -s -p no:warnings --durations=6 ${TESTS_ARGS:-} "$@" \
                     >"$out/gpu_tests_$i.log" 2>&1; }
         if [ "$mib" -lt 100000 ]; then  # (the MoE test's 35B-A3B width OOMs beside the session's 9B on 80 GB)
           group 0 0 tests/gpu/test_generate_gpu.py -k "not moe"; group 0b 0 tests/gpu/test_generate_gpu.py -k moe
         else group 0 0 tests/gpu/test_generate_gpu.py & fi
         group 1 1 tests/gpu/test_speculative_gpu.py -k "mtp or stopping" &
         if [ "$ngpu" -lt 2 ]; then wait; fi
         group 2 1 tests/gpu/test_speculative_gpu.py -k "dflash or oracle" &
         group 3 0 tests/gpu/test_ops_gpu.py tests/gpu/test_attention_gpu.py &  # (no 9B model: a few GB)
         if [ "$ngpu" -ge 2 ]; then group 4 0 tests/gpu/test_candidates_gpu.py & fi
         wait
         grep -hE 'passed|failed|FAILED|ERROR|divergence|agreed|identical|tau|^[0-9.]+s (call|setup)' "$out"/gpu_tests_*.log ;;
  cuda-tests) timeout ${CUDA_TESTS_TIMEOUT:-480} python -m pytest -v -s -p no:warnings --durations=6 \
               tests/gpu/test_cuda_kernels_gpu.py ${CUDA_TESTS_ARGS:-} ${CUDA_TESTS_K:+-k "$CUDA_TESTS_K"} 2>&1 \
               | tee "$out/cuda_tests.log" | tail -8 ;;
  cuda-times) python scripts/gemv_times.py --format int4 --shapes 27b 27b-head --kernel cuda --cuda-fold 0 1 2 \
               --cuda-loads-only \
               --rows 1 4 --check 2>&1 | tee "$out/cuda_times_fold.md"
             python scripts/gemv_times.py --format int4 --shapes 27b 27b-head --kernel triton cuda \
               --cuda-batch 2 4 8 --cuda-pipelined 0 1 --cuda-blocks 1024 2048 4096 2>&1 | tee "$out/cuda_times.md"
             python scripts/gemv_times.py --format int4 --shapes 27b --kernel triton cuda \
               --rows 4 8 16 2>&1 | tee -a "$out/cuda_times.md" ;;
  ceiling) python scripts/gemv_times.py --format int4 --shapes l2 27b --kernel triton cuda --warm --cuda-loads-only \
             --cuda-fold 0 1 --rows 1 4 --check 2>&1 | grep "^|" | tee "$out/ceiling.md"
           python scripts/gemv_times.py --format int4 --shapes 27b --kernel cuda --spread 14 --rows 1 2>&1 \
             | grep "^|" | tee "$out/spread.md" ;;
  cuda-times-fp8) python scripts/gemv_times.py --format fp8-weight --shapes 27b 27b-head 35b-a3b --kernel triton cuda \
               --cuda-batch 2 4 8 --cuda-blocks 1024 2048 4096 2>&1 | tee "$out/cuda_times_fp8.md" ;;
  bars) a="--isolate --n-long 288 --repeats 2 --no-autotune ${BARS_ARGS:-}"
        if [ "${BARS:-27b}" = 35b ]; then set -- --models qwen3.5-35b-a3b --systems fastqwen fastqwen-fp8-weight
        else set -- --models qwen3.5-27b --systems fastqwen fastqwen-fp8-weight fastqwen-int4; fi
        set -- "$@" ${BARS_SYSTEMS:-} --quant-lm-head
        python scripts/bench.py "$@" $a --json "$out/bars_${BARS:-27b}.json" 2>&1 | grep -v "^\[transformers\]" \
          | tee "$out/bars_${BARS:-27b}.log" | grep -E "tok/s|step:|^\|" ;;
  router) python scripts/bench_expert_mlp.py --tables router --layers 40 --rounds 6 \
            --router-configs ${ROUTER_TILES:-2:2048:1 1:2048:1 4:1024:1 2:1024:1 8:256:1} 2>&1 | tee "$out/router.md" ;;
  fit) folds="1$(grep -q CLUSTER_SUM fastqwen/ops/int4_cuda.py && echo ' 3')"
       for pdl in "" --pdl; do
         python scripts/gemv_times.py --format int4 --shapes 27b 27b-head --kernel cuda --cuda-fold $folds \
           --cuda-loads-only --rows 1 $pdl $([ -z "$pdl" ] && echo --check) 2>&1 | grep "^|" \
           | tee "$out/fit${pdl:+_pdl}.md" | cut -c1-140
       done
       python scripts/gemv_fit.py "$out"/fit.md "$out"/fit_pdl.md | tee "$out/fit_lines.md" ;;
  rotate) python scripts/gemv_times.py --format int4 --shapes 27b 27b-head --kernel cuda --cuda-fold 1 2 3 \
            --cuda-loads-only --rows 1 --check 2>&1 | grep "^|" | tee "$out/rotate_times.md" | cut -c1-150
          python scripts/gemv_fit.py "$out/rotate_times.md" | tee "$out/rotate_lines.md"
          for f in ${ROTATE_FOLDS:-1 2 3}; do  # (a module flag: one process a setting)
            python -c "import runpy, sys; import fastqwen.ops.int4_cuda as m; m.FOLD = $f; sys.argv[0] = 'bench'; \
              runpy.run_path('scripts/bench.py', run_name='__main__')" --models qwen3.5-27b --systems fastqwen-int4 \
              --quant-lm-head --n-long 288 --repeats 2 --no-autotune --json "$out/rotate_step_$f.json" 2>&1 \
              | grep -E "fastqwen-int4: " | sed "s/^/FOLD $f: /"
          done ;;
  pair) python scripts/gemv_times.py --format int4 --shapes 27b 27b-head --kernel cuda --rows 16 9 --cuda-pair 0 1 \
          --cuda-blocks 2048 4096 --check 2>&1 | grep "^|" | tee "$out/pair_times.md"
        for p in False True; do  # (a module flag: one process a setting)
          python -c "import runpy, sys; import fastqwen.ops.int4_cuda as m; m.PAIR = $p; sys.argv[0] = 'bench_spec'; \
            runpy.run_path('scripts/bench_spec.py', run_name='__main__')" --model qwen3.5-27b --layers 16 --runs \
            --verify-block 16 --quant int4 --quant-lm-head --no-autotune --json "$out/verify_pair_$p.json" 2>&1 \
            | grep -vE "^\[transformers\]|Warning|^ " | tail -2
          python -c "import json; r = json.load(open('$out/verify_pair_$p.json')); v = r['verify16']; \
            print('PAIR $p: decode', round(r['decode_s'] * 1e6), 'µs, verify of 16', round(v['verify_s'] * 1e6), 'µs')"
        done ;;
  prologue) python -m pytest -q -p no:warnings tests/gpu/test_ops_gpu.py tests/gpu/test_attention_gpu.py \
              -k "verify_prologue or attention_prep" 2>&1 | tee "$out/prologue_tests.log" | tail -3
            python scripts/bench_spec.py --model qwen3.5-27b --layers 16 --runs --verify-block 16 --quant int4 \
              --quant-lm-head --no-autotune --also-kernels conv=fused-verify --json "$out/verify_prologue.json" 2>&1 \
              | grep -vE "^\[transformers\]|Warning|^ " | tail -2
            python -c "import json; r = json.load(open('$out/verify_prologue.json')); a = r['also_kernels']; \
              print('verify of 16:', round(r['verify16']['verify_s'] * 1e6), 'µs; fused-verify', \
              round(a['conv=fused-verify']['verify_s'] * 1e6), 'µs')" ;;
  ab) [ -d .ab/base/fastqwen ] || { echo "no .ab/base/fastqwen: see ab in this script's header"; exit 2; }
      for side in $(for _ in $(seq "${AB_ROUNDS:-2}"); do echo base tree; done); do
        dir=$([ $side = base ] && echo .ab/base || echo .)
        echo "== $side ($(cd "$dir" && pwd))"
        (cd "$dir" && PYTHONPATH="/tmp/site:$PWD" bash -c "${AB_CMD:?AB_CMD: the command to run on each side}") 2>&1 \
          | tail -"${AB_TAIL:-20}"
      done ;;
  candidate-tests) python -m pytest -q -s -p no:warnings tests/gpu/test_candidates_gpu.py 2>&1 | tail -6 ;;
  bench) python scripts/bench.py --models ${MODELS:-qwen3.5-9b qwen3.5-27b qwen3.5-35b-a3b} ${BENCH_ARGS:-} \
           --out-dir "$out" 2>&1 | grep -v "^\[transformers\]" | tail -20 ;;
  spec)  m=${SPEC_MODEL:-qwen3.5-27b}; f="$out/spec_$m${SPEC_TAG:+_$SPEC_TAG}"
         python scripts/bench_spec.py --model "$m" --no-autotune ${SPEC_ARGS:-} --json "$f.json" 2>&1 \
           | grep --line-buffered -v "^\[transformers\]" | tee "$f.log" | grep -vE '^ *"|^[{}]'; cat "$f.json" ;;
  sweep) m=${SWEEP_MODEL:-qwen3.5-27b}
         python scripts/bench.py --models "$m" --systems fastqwen --batch-size 1 2 4 8 --ragged --no-autotune \
           ${SWEEP_ARGS:-} --json "$out/sweep_$m.json" 2>&1 | grep -v "^\[transformers\]" | tail -8
         python scripts/plot_bench.py "$out/sweep_$m.json" "$out/sweep_$m.svg" ;;
  startup) python scripts/bench_startup.py --model "${STARTUP_MODEL:-qwen3.5-9b}" --json "$out/startup.json" ;;
  profile) python scripts/profile_step.py --model "${PROFILE_MODEL:-qwen3.5-35b-a3b}" --no-autotune ${PROFILE_ARGS:-} \
           --json "$out/profile.json" 2>&1 | grep -E "^\||µs" ;;
  code) # the compiled graphs' inductor source (every kernel of the decode step, named as the profile names them),
         # for launch work off the GPU: $OUT/output_code.txt; PROFILE_MODEL / PROFILE_ARGS as for profile
         TORCH_LOGS=output_code python scripts/profile_step.py --model "${PROFILE_MODEL:-qwen3.5-35b-a3b}" --no-autotune \
           ${PROFILE_ARGS:-} > "$out/output_code.txt" 2>&1
         grep -c "@triton.jit" "$out/output_code.txt" || true ;;
  attention) python -m pytest -q -p no:warnings tests/gpu/test_attention_gpu.py 2>&1 | tail -3
         python scripts/bench_attention.py --json "$out/bench_attention.json" 2>&1 | grep "^|" ;;
  qbench) python scripts/bench.py --models "${QMODEL:-qwen3.5-27b}" --systems fastqwen "fastqwen-${SCHEME:-fp8-weight}" \
           --no-autotune ${QBENCH_ARGS:-} --json "$out/qbench.json" 2>&1 | grep -v "^\[transformers\]" | tail -6 ;;
  candidates) python scripts/bench.py --models "${CAND_MODEL:-qwen3.5-35b-a3b}" --systems fastqwen \
           ${CAND_SYSTEMS:-fastqwen+grouped-pdl-experts} --no-autotune ${CAND_ARGS:-} --json "$out/candidates.json" 2>&1 \
           | grep -v "^\[transformers\]" | tail -4 ;;
  gdn) python scripts/bench_gdn.py --models ${GDN_MODELS:-qwen3.5-27b qwen3.5-9b} --T ${GDN_T:-4 8 16} ${GDN_ARGS:-} \
           --json "$out/bench_gdn.json" 2>&1 | grep "^|" ;;
  commit) python scripts/bench_commit.py --json "$out/bench_commit.json" 2>&1 | grep "^|" ;;
  ncu) ncu --clock-control none --kernel-name regex:"_row_kernel|_gemv_kernel" --launch-skip 3 --launch-count 1 \
           --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
           --section WarpStateStats --section SchedulerStats --section Occupancy \
           --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,smsp__inst_executed.sum,dram__bytes_read.sum" \
           python scripts/gemv_once.py ${NCU_ARGS:-} > "$out/ncu.txt" 2>&1
         grep -E "Throughput|Duration|config|inst_executed.sum|dram__bytes|stalled_(long|wait|math|lg|short|mio|not_sel|selected|barrier|dispatch|no_inst)|pipe_(alu|fma|lsu|fp16|uniform|xu|tensor).*pct" "$out/ncu.txt" | head -60 ;;
  ncu-int4) for k in fold rows; do
              timeout 120 ncu --clock-control none --kernel-name regex:int4_gemv_$k --launch-skip 5 --launch-count 1 \
                --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
                --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,smsp__inst_executed.sum,dram__bytes_read.sum" \
                python scripts/gemv_times.py --format int4 --shapes 27b --kernel cuda --cuda-fold 1 --cuda-loads-only \
                --rows 1 --repeats 1 > "$out/ncu_$k.txt" 2>&1
              echo "== int4_gemv_$k"
              grep -E "Duration|DRAM Throughput|Achieved Occupancy|Issued Warp|No Eligible|inst_executed.sum|stalled_(long|wait|math|lg|short|mio|not_sel|selected|barrier|dispatch|no_inst|tex|drain|imc|branch)[a-z_]*_per|pipe_(alu|fma|lsu|fp16|uniform|tensor)[a-z_.]*pct" \
                "$out/ncu_$k.txt" | awk '{$1=$1};1' | head -30
            done ;;
  sweep-gemv) t=${SWEEP_TAG:+_$SWEEP_TAG}; table=fastqwen/ops/gemv_configs$t.json
         [ -z "$t" ] || rm -f "$table"  # a tagged table holds only this sweep's results
         python scripts/bench_quant.py --sweep --shapes ${SWEEP_SHAPES:-27b} --m ${SWEEP_M:-1 4 16} \
           --formats ${SWEEP_FORMATS:-fp8-weight int4 bf16} ${SWEEP_ROW_ORDER:+--int4-row-order} ${SWEEP_LOWP:+--lowp $SWEEP_LOWP} ${SWEEP_KSTEP:+--kstep $SWEEP_KSTEP} ${SWEEP_EXPERTS:+--sweep-experts $SWEEP_EXPERTS} \
           --write-table "$table" --json "$out/gemv_sweep$t.json" 2>&1 | grep -E "^\||^  \(.*: [A-Za-z]+"  # (+ failed configs)
         cp "$table" "$out/" ;;
  suite) card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h[0-9]+' | tr A-Z a-z)
         python -m pytest -q -p no:warnings tests/benchmarks --benchmark-only --no-autotune \
           --benchmark-storage=file://tests/benchmarks/baselines --benchmark-save="${card:-gpu}" 2>&1 | tail -12
         cp -r tests/benchmarks/baselines "$out/" ;;
  reductions) a="--models ${RED_MODEL:-qwen3.5-27b} --quant-lm-head --n-long 288 --repeats 2 --no-autotune"
              python scripts/bench.py $a --systems ${RED_SYSTEMS:-fastqwen-int4 fastqwen-int4+inductor-reductions} \
                --isolate ${RED_ARGS:-} --json "$out/reductions.json" 2>&1 | grep "^|"
              python scripts/bench.py $a --systems fastqwen-int4 --kernels ${RED_ALL:-reductions=inductor \
                attn_glue=separate gdn_norm=separate} ${RED_ARGS:-} --json "$out/reductions_all.json" 2>&1 \
                | grep "^|" ;;
  quality) python scripts/quant_quality.py --noise ${QUALITY_NOISE:-0.03 0.1} --json "$out/quant_quality.json" 2>&1 \
           | grep "error" ;;
  quant) python -m pytest -q -p no:warnings tests/gpu/test_quant_gpu.py 2>&1 | tee "$out/quant_tests.log" | tail -5
         python scripts/bench_quant.py --experts ${QUANT_ARGS:-} --json "$out/bench_quant.json" 2>&1 | grep -E "^\||bandwidth" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
