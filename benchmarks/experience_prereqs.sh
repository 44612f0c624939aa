#!/usr/bin/env bash
# The experience plan's three inputs (issue 33): the start student, the bank and the pretrained composer, rebuilt
# from a checkout at the plan's commit and checked against the hashes the committed run files recorded
# (benchmarks/README.md, "The pilot and the rebuilt files"). A machine that lost runs/ needs them before the plan
# (compare.py --plan experience) can go on.
#
#   benchmarks/experience_prereqs.sh CHECKOUT [student|bank|composer ...]   (default: all three, in that order)
#
# CHECKOUT: a worktree at the plan's commit whose runs/ is this checkout's, for example
#   git worktree add --detach /work/wt_exp 151c2ab && ln -sfn "$PWD/runs" /work/wt_exp/runs
# PYTHON (environment variable, default .venv/bin/python of this checkout): the interpreter, with the library
# versions start_student recorded (transformers 5.24.0: `.venv/bin/pip install transformers==5.24.0`).
# Each step is skipped when its output exists. Each output's hash is compared with the plan's: a mismatch stops the
# script (exit 1) before a later step spends its time on inputs the plan's aggregation would refuse to mix.
# Times on this 2-core CPU: student about 17 min, bank about 2 min, composer 70-100 min.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
checkout=${1:?usage: benchmarks/experience_prereqs.sh CHECKOUT [student|bank|composer ...]}
checkout=$(cd "$checkout" && pwd)
shift
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(student bank composer)
python=${PYTHON:-$here/.venv/bin/python}
reference=$here/benchmarks/results/experience_runs/lopd/seed_1.json  # a plan run that read all three

[ -x "$python" ] || { echo "error: PYTHON=$python is not an interpreter; run make install or set PYTHON"; exit 1; }
[ -f "$reference" ] || { echo "error: $reference is missing: it holds the plan's hashes"; exit 1; }
[ "$(cd "$checkout/runs" && pwd -P)" = "$(mkdir -p "$here/runs" && cd "$here/runs" && pwd -P)" ] || {
    echo "error: $checkout/runs is not $here/runs: ln -sfn $here/runs $checkout/runs"; exit 1; }

# The kernels the plan's files were built with (the CPU may offer more; the hashes depend on it).
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 PYTHONPATH=$checkout/src HF_HUB_OFFLINE=1
cd "$checkout"
"$python" -c "import lopd_lightning, sys; p = lopd_lightning.__file__
sys.exit(0 if p.startswith('$checkout/') else f'error: lopd_lightning imports from {p}, not $checkout')"

# expected NAME -> the plan's hash; actual NAME -> this machine's (compare_provenance, as the runs record them)
expected() { "$python" -c "import json; print(json.load(open('$reference'))['provenance']['$1_hash'])"; }
actual() {
    "$python" -c "import sys; sys.path.insert(0, '$here/benchmarks'); import compare_provenance as p
print({'student': lambda: p.student_hash('runs/hidden_rules/sft_student_in_context'),
       'bank': lambda: p.tree_hash('runs/experience/bank'),
       'composer': lambda: p.composer_hash('runs/experience/composer')}['$1']())"
}
check() {
    local want got
    want=$(expected "$1"); got=$(actual "$1")
    if [ "$want" != "$got" ]; then
        echo "error: the rebuilt $1 hashes $got, the plan's runs recorded $want: the plan cannot go on with it"
        exit 1
    fi
    echo "$1: $got, as the plan's runs recorded"
}
lopd() { "$python" -c "from lopd_lightning.cli import main; main()" "$@"; }
common=(-c configs/experience/common.yaml -c configs/experience/lopd.yaml
        --model.init_args.composer_path=null --model.init_args.generation_backend=hf)

for step in "${steps[@]}"; do
    case $step in
    student)
        [ -f runs/hidden_rules/sft_student_in_context/model.safetensors ] ||
            MKL_ENABLE_INSTRUCTIONS=AVX2 "$python" benchmarks/start_student.py --task hidden_rules \
                --task-options '{"references": "format_only"}' --in-context-fraction 0.5 --steps 36 \
                --out runs/hidden_rules/sft_student_in_context --results runs/hidden_rules/start_student_rebuilt.json
        ;;
    bank)
        [ -f runs/experience/bank/meta.json ] || lopd build-memory "${common[@]}" --from-references ;;
    composer)
        resume=(); [ -f runs/experience/composer/checkpoints/last.ckpt ] && resume=(--resume)
        [ -f runs/experience/composer/composer.pt ] ||
            lopd pretrain-composer "${common[@]}" --out runs/experience/composer "${resume[@]}" ;;
    *) echo "error: unknown step '$step': use student, bank or composer"; exit 1 ;;
    esac
    check "$step"
done
