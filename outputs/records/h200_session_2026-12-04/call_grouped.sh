# Device side, after .fa4/3/install.sh: the grouped TR-MoE block's tests on the GPU (quack's varlen GEMMs with
# rows gathered by index), then the block's designs one layer at a time at 16 x 2,048 tokens.
set -o pipefail
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/ops/test_paired_experts.py > $OUT/grouped_tests.log 2>&1
echo "tests rc=$?"; tail -4 $OUT/grouped_tests.log | cut -c1-600
timeout 100 python3 -m cflib.bench.trmoe_designs --out $OUT/trmoe_designs.json > $OUT/trmoe_designs.log 2>&1
echo "designs rc=$?"; tail -6 $OUT/trmoe_designs.log | cut -c1-400
