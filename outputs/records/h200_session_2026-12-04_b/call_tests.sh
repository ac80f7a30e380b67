# Device side, after .fa4/3/install.sh (into /tmp/sp/site-packages: quack's GEMMs compile only from a
# site-packages folder): the GPU test tier, the TR-MoE block's designs one layer at a time (16 x 2,048), and
# 50 release-profile steps with the block grouped by route against the default's noise.
set -o pipefail
nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
timeout 280 make test-gpu GPU_WORKERS=15 > $OUT/test_gpu.log 2>&1; echo "test-gpu rc=$?"; tail -3 $OUT/test_gpu.log
grep -E "^(FAILED|ERROR)" $OUT/test_gpu.log | head -20 | cut -c1-300
timeout 100 python3 -m cflib.bench.trmoe_designs --out $OUT/trmoe_designs.json > $OUT/trmoe_designs.log 2>&1
echo "designs rc=$?"; tail -8 $OUT/trmoe_designs.log | cut -c1-400
timeout 150 python3 -m cflib.bench.loss_parity -f params/sft_200m_release.yaml --steps 50 \
  --set "init_checkpoint=null,data=embedded,require_release_ready=false,lr=3e-4" \
  --variant grouped_experts=true --out $OUT/loss_parity_grouped.json > $OUT/loss_parity_grouped.log 2>&1
echo "parity rc=$?"; tail -4 $OUT/loss_parity_grouped.log | cut -c1-600
