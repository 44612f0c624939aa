#!/usr/bin/env bash
# The experience plan's three inputs (issue 33): the start student, the bank and the pretrained composer, rebuilt
# from a checkout at the plan's commit and checked against the hashes the committed run files recorded
# (benchmarks/README.md, "The pilot and the rebuilt files"). A machine that lost runs/ needs them before the plan
# (compare.py --plan experience) can go on.
#
#   benchmarks/experience_prereqs.sh CHECKOUT [student|bank|composer|composer_paper ...]
#       [--same-input KIND:REBUILT=ORIGINAL ...]
#   (steps default to the first three, in that order)
#
# composer_paper: the composer of lopd_paper (configs/experience/lopd_paper.yaml, LOPD in its authors' setting),
# runs/experience/composer_paper, pretrained from the same student and bank with that config (resumable, as the
# composer). Its options postdate the plan's commit, so CHECKOUT is then a checkout of the commit the lopd_paper
# runs ran on (the src tree a committed experience_runs/lopd_paper/seed_*.json recorded); while none is committed,
# it is checked against nothing: the script reports the tree and the hash it built on, which those runs will record.
#
# CHECKOUT: a worktree at the plan's commit whose runs/ is this checkout's, for example
#   git worktree add --detach /work/wt_exp 151c2ab && ln -s "$PWD/runs" /work/wt_exp/runs
# PYTHON (environment variable, default .venv/bin/python of this checkout): the interpreter, with the library
# versions the start student was built with (transformers 5.24.0: `.venv/bin/pip install transformers==5.24.0`).
# Before any step: CHECKOUT's src/ must be the plan runs' (composer_paper: the lopd_paper runs'; git tree hash, no
# uncommitted change) and PYTHON's libraries the start student's. Each step is skipped when its output exists
# (the composers' pretraining resumes from its last checkpoint). Each output's hash is compared with the plan's:
# a mismatch stops the script (exit 1) before a later step spends its time on inputs the plan's aggregation
# would refuse to mix, unless that input has been declared the plan's with the evidence benchmarks/README.md asks
# for: --same-input KIND:REBUILT=ORIGINAL (KIND student, bank or composer, composer for composer_paper too;
# REBUILT this machine's hash, ORIGINAL the plan's), the declaration compare.py's aggregation takes, lets the
# script go on.
# Times on this 2-core CPU: student about 17 min, bank about 2 min, composer 70-100 min (composer_paper: not
# measured yet).
set -euo pipefail

fail() { echo "error: $*"; exit 1; }
usage="usage: benchmarks/experience_prereqs.sh CHECKOUT [student|bank|composer|composer_paper ...] [--same-input KIND:REBUILT=ORIGINAL ...]"
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
[ -d "$1" ] || fail "CHECKOUT $1 is not a folder: git worktree add --detach $1 151c2ab (the plan's commit)"
checkout=$(cd "$1" && pwd)
shift
steps=()
same_input=()  # the --same-input values, parsed below as compare.py parses them
while [ $# -gt 0 ]; do
    case $1 in
    student | bank | composer | composer_paper) steps+=("$1") ;;
    --same-input)
        [ $# -ge 2 ] ||
            fail "--same-input needs KIND:REBUILT=ORIGINAL, for example --same-input student:66976bd00baa61a7=3761f00976a961fa"
        same_input+=("$2")
        shift ;;
    *) fail "unknown step '$1': use student, bank, composer or composer_paper (or --same-input KIND:REBUILT=ORIGINAL)" ;;
    esac
    shift
done
[ ${#steps[@]} -eq 0 ] && steps=(student bank composer)
python=${PYTHON:-$here/.venv/bin/python}
reference=$here/benchmarks/results/experience_runs/lopd/seed_1.json  # a plan run that read all three
built_with=$here/benchmarks/results/start_student_hidden_rules_in_context_rebuilt.json  # the student's libraries

"$python" -c "import sys" 2>/dev/null || fail "PYTHON=$python is not a Python interpreter: run make install, or set PYTHON"
# the declarations as compare.py's aggregation reads them (compare_args.same_inputs, which refuses a malformed
# one in one line), written "KIND:REBUILT=ORIGINAL" between spaces
declared=" $("$python" - "$here/benchmarks" ${same_input[@]+"${same_input[@]}"} <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
from compare_args import same_inputs
from compare_runs import SAME_INPUT_KIND_OF
print(" ".join(f"{SAME_INPUT_KIND_OF[key]}:{rebuilt}={original}" for key, pairs in same_inputs(sys.argv[2:]).items()
               for rebuilt, original in pairs.items()))
EOF
) " || exit 1
for file in "$reference" "$built_with"; do [ -f "$file" ] || fail "$file is missing: it holds what the plan's inputs were built with"; done
[ "$(mkdir -p "$here/runs" && cd "$here/runs" && pwd -P)" = "$(cd "$checkout/runs" 2>/dev/null && pwd -P)" ] ||
    fail "$checkout/runs is not $here/runs: move $checkout/runs away, then ln -s $here/runs $checkout/runs"

# field FILE KEY...: a value of a JSON file ('' when absent)
field() { "$python" -c 'import json, sys
value = json.load(open(sys.argv[1]))
for key in sys.argv[2:]:
    value = value.get(key) if isinstance(value, dict) else None
print("" if value is None else value)' "$@"; }

paper_reference=""  # the first committed lopd_paper run that recorded its composer ('' while there is none)
for file in "$here"/benchmarks/results/experience_runs/lopd_paper/seed_*.json; do
    [ -f "$file" ] && [ -n "$(field "$file" provenance composer_hash)" ] && { paper_reference=$file; break; }
done
want_tree=$(field "$reference" src src_tree)
tree=$(git -C "$checkout" rev-parse HEAD:src 2>/dev/null) || fail "$checkout is not a git checkout with src/: git worktree add --detach $checkout 151c2ab"
plan_steps=0 paper_step=0
for step in "${steps[@]}"; do [ "$step" = composer_paper ] && paper_step=1 || plan_steps=1; done
[ $plan_steps = 0 ] || [ "$tree" = "$want_tree" ] ||
    fail "$checkout's src/ is tree $tree, the plan's runs had $want_tree: check out the plan's commit (151c2ab)"
if [ $paper_step = 1 ] && [ -n "$paper_reference" ]; then
    want_paper=$(field "$paper_reference" src src_tree)
    [ "$tree" = "$want_paper" ] || fail "$checkout's src/ is tree $tree, the lopd_paper runs had $want_paper" \
        "(${paper_reference#"$here/"}): check out their commit, $(field "$paper_reference" git_sha)"
elif [ $paper_step = 1 ]; then
    echo "composer_paper: no committed lopd_paper run yet; building on $checkout's src/ tree $tree" \
        "(the lopd_paper runs must run on it)"
fi
[ -z "$(git -C "$checkout" status --porcelain -- src)" ] || fail "$checkout/src has uncommitted changes: git -C $checkout checkout -- src"

# The kernels the plan's files were built with (the CPU may offer more; the hashes depend on it).
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 PYTHONPATH=$checkout/src HF_HUB_OFFLINE=1
cd "$checkout"
"$python" - "$checkout" "$here/benchmarks" "$built_with" <<'EOF'
import json, sys
checkout, benchmarks, built_with = sys.argv[1:]
import lopd_lightning
if not lopd_lightning.__file__.startswith(checkout + "/"):
    sys.exit(f"error: lopd_lightning imports from {lopd_lightning.__file__}, not from {checkout}/src")
sys.path.insert(0, benchmarks)
from common import package_versions
want, have = json.load(open(built_with))["versions"], package_versions()
differ = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
if differ:
    sys.exit("error: PYTHON's libraries differ from the start student's (have, built with): "
             + ", ".join(f"{k} {h} / {v}" for k, (h, v) in sorted(differ.items()))
             + ": install those versions (pip install transformers==...), or set PYTHON")
EOF

# each step's output folder (the plan's configs read them there)
declare -A output=([student]=runs/hidden_rules/sft_student_in_context [bank]=runs/experience/bank
                   [composer]=runs/experience/composer [composer_paper]=runs/experience/composer_paper)
# each step's kind: its provenance key (KIND_hash) and its --same-input KIND
declare -A kind=([student]=student [bank]=bank [composer]=composer [composer_paper]=composer)
# hash_of NAME: this machine's hash of NAME's output, as the runs record it (compare_provenance)
hash_of() { "$python" - "$here/benchmarks" "$1" "${output[$1]}" <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
import compare_provenance as p
name, folder = sys.argv[2:]
print({"student": p.student_hash, "bank": p.tree_hash, "composer": p.composer_hash,
       "composer_paper": p.composer_hash}[name](folder) or "")
EOF
}
check() {
    local want got k=${kind[$1]} from=$reference
    [ "$1" = composer_paper ] && from=$paper_reference
    got=$(hash_of "$1")
    if [ -z "$from" ]; then  # composer_paper before any lopd_paper run: nothing recorded to check against
        [ -n "$got" ] || fail "${output[$1]} holds no composer.pt after its pretraining"
        echo "$1: $got (no committed lopd_paper run records a composer_hash yet: those runs will record this one)"
        return
    fi
    want=$(field "$from" provenance "${k}_hash")
    [ -n "$want" ] || fail "$from records no ${k}_hash"
    if [ "$want" != "$got" ] && [[ $declared == *" $k:$got=$want "* ]]; then
        echo "$1: $got, declared the plan's $want (--same-input $k:$got=$want)"
        return
    fi
    [ "$want" = "$got" ] || fail "the rebuilt $1 hashes ${got:-nothing}, the plan's runs recorded $want (remove ${output[$1]} to build it again; or, with evidence that it behaves the same, declare it here and to compare.py's aggregation: --same-input $k:$got=$want)"
    echo "$1: $got, as the plan's runs recorded"
}
lopd() { "$python" -c "from lopd_lightning.cli import main; main()" "$@"; }
# stage CONFIG: the options of the stages that come before a composer exists (neither generates: HF)
stage() { printf '%s\n' -c configs/experience/common.yaml -c "configs/experience/$1.yaml" \
    --model.init_args.composer_path=null --model.init_args.generation_backend=hf; }
mapfile -t common < <(stage lopd)
# pretrain STEP CONFIG: pretrain the composer of CONFIG into STEP's folder, resuming from its last checkpoint
pretrain() {
    local resume=() options
    [ -f "${output[$1]}/composer.pt" ] && return
    [ -f "${output[$1]}/checkpoints/last.ckpt" ] && resume=(--resume)
    mapfile -t options < <(stage "$2")
    lopd pretrain-composer "${options[@]}" --out "${output[$1]}" ${resume[@]+"${resume[@]}"} ||
        fail "pretraining the $1 failed (its output above; run this again to resume)"
}

for step in "${steps[@]}"; do
    case $step in
    student)
        [ -f "${output[student]}/model.safetensors" ] ||
            MKL_ENABLE_INSTRUCTIONS=AVX2 "$python" benchmarks/start_student.py --task hidden_rules \
                --task-options '{"references": "format_only"}' --in-context-fraction 0.5 --steps 36 \
                --out "${output[student]}" --results runs/hidden_rules/start_student_rebuilt.json ||
            fail "building the start student failed (its output above)" ;;
    bank)
        [ -f "${output[bank]}/meta.json" ] || lopd build-memory "${common[@]}" --from-references ||
            fail "building the bank failed (its output above)" ;;
    composer) pretrain composer lopd ;;
    composer_paper) pretrain composer_paper lopd_paper ;;
    esac
    check "$step"
done
