name=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$name"
case "$name" in *H200*) ;; *) exit 0 ;; esac
timeout 170 python scripts/gemv_times.py --format int4 --shapes 27b --kernel cuda --cuda-async 3 6 --cuda-loads-only \
  --rows 1 2>&1 | grep "^|" | tee $OUT/h200_async.md | cut -c1-140
