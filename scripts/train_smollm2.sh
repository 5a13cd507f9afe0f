#!/usr/bin/env bash
# Reproduce the shipped draft dflash/drafts/smollm2-135m-instruct on a CPU machine, in the
# twenty-two stages it was trained in (docs/TRAINING.md has the lineage table with each stage's
# data, CPU-hours and tau). Every step resumes: re-run after an interruption and it continues
# where it stopped. The shipped draft is stage 22's last step.
#   stage 1 (run main2): the first 26 shards of 64 prompts, an 800-step cosine at lr 1e-3 from
#            the target's layers (the original run planned 950 steps and was cut to 800 at step
#            425 by a resume with --max-steps 800; best held-out at step 750)
#   stage 2 (run main3): all 47 shards (3 000 prompts), a 500-step cosine at lr 5e-4
#            warm-started from stage 1's best
#   stage 3 (run main4): 47 new shards (prompts 3 008-5 999 of a 6 000-prompt list, in their own
#            folder), warm-started from stage 2's best. Its responses are committed in
#            data/smollm2-b, so this stage rebuilds them by one target prefill each instead of
#            regenerating them
#   stage 4 (run gamma4): the 47 shards of data/smollm2-c (445 K tokens main4 never saw,
#            rebuilt by prefill), warm-started from stage 3's best, 500 steps at lr 5e-4 with
#            gamma 4 (the best arm of the recipe comparison, docs/TRAINING.md; the original run
#            started from main4's shipped fp16 copy, dflash/drafts/ at commit f2e3b61)
#   stage 5 (run d5): the 54 shards of data/smollm2-d (679 K tokens with HumanEval-shaped
#            docstring prompts and 448-token math/code answers, rebuilt by prefill), warm-started
#            from stage 4's best, the same 500 steps at lr 5e-4 with gamma 4
#   stage 6 (run e2): smollm2-d and the 40 shards of data/smollm2-e (621 K tokens on no earlier
#            prompt list) as one pool (--more-data), warm-started from stage 5's best, the same
#            500 steps (the original run was the `e2` arm of scripts/train_recipe.sh, on 1
#            thread beside another arm)
#   stage 7 (run f2): smollm2-d, smollm2-e and the 40 shards of data/smollm2-f (578 K tokens with
#            the `method` source) as one pool, warm-started from stage 6's best, the same 500 steps
#   stage 8 (run g2): smollm2-d, -e, -f and the 40 shards of data/smollm2-g (581 K tokens, as f on
#            a fifth disjoint prompt list) as one pool, warm-started from stage 7's best, the same
#            500 steps
#   stage 9 (run h9): smollm2-d, -g and the 40 shards of data/smollm2-h (581 K tokens on a sixth
#            disjoint prompt list) as one pool (e and f left out: stage 8 had them and their
#            rebuild would cost a fresh machine ~50 min more), warm-started from stage 8's best,
#            the same 500 steps; the next stage starts from its last step (chosen over step 350,
#            the held-out best by 0.004, on eval tau)
#   stage 10 (run h10): stage 9's pool and the 40 shards of data/smollm2-i (617 K tokens on a
#            seventh disjoint prompt list), warm-started from stage 9's last step, the same 500
#            steps; the next stage starts from its last step (also its held-out best)
#   stage 11 (run h11): stage 10's pool and the 40 shards of data/smollm2-j (552 K tokens on an
#            eighth disjoint prompt list, code from the `library` stubs), warm-started from stage
#            10's last step, the same 500 steps; the next stage starts from its held-out best (step
#            400, chosen over step 500 on eval tau)
#   stage 12 (run h12): stage 11's pool and the 40 shards of data/smollm2-k (a ninth disjoint
#            prompt list), warm-started from stage 11's best, a longer cosine: 1 000 steps (the
#            earlier stages' 500 steps saw about a third of their pool once); the next stage starts
#            from its last step (chosen over step 825, the held-out best, on eval tau)
#   stage 13 (run h13): stage 12's pool again (no new data), warm-started from stage 12's last
#            step, a 2 000-step cosine at a lower peak lr, 3e-4 (1.15 epochs of the pool; the
#            5e-4 restarts of earlier stages lost held-out tau for their first 300-500 steps);
#            the next stage starts from its last step (step 1 725, the held-out best, evaluates
#            the same)
#   stage 14 (run h14): the same pool a third time, warm-started from stage 13's last step, a
#            1 000-step cosine at peak lr 2e-4 (the original run had 1 thread, beside a
#            3-layer arm)
#   stage 15 (run h15): warm-started from stage 14's last step on the newest data only: the 40
#            shards of data/smollm2-l and the first 28 of data/smollm2-m (the first list with
#            follow-up chat), a 600-step cosine at peak lr 2e-4 (the original run started from
#            stage 14's shipped fp16 copy)
#   stage 16 (run h16): warm-started from stage 15's last step on data/smollm2-l, all 40 shards
#            of data/smollm2-m and the first 22 of data/smollm2-n (the first list with the
#            `package` source: HumanEval-shaped stubs from matplotlib, pandas, rich, ...), a
#            700-step cosine at peak lr 2e-4
#   stage 17 (run h17): warm-started from stage 16's last step on data/smollm2-l, -m and all 40
#            shards of data/smollm2-n, a 700-step cosine at peak lr 2e-4
#   stage 18 (run h18): warm-started from stage 17's last step on data/smollm2-l, -m, -n and all
#            40 shards of data/smollm2-o (n's mix on a thirteenth disjoint prompt list), an
#            800-step cosine at peak lr 2e-4
#   stage 19 (run h19): warm-started from stage 18's last step on data/smollm2-n, -o, the first
#            5 shards of -p, the first 13 of -q (stubs from transformers, scipy, pytest, ...: the
#            `package2` source) and the first 6 of -r (writing requests: the `writing` source);
#            l and m left out, so the new shapes weigh more; a 600-step cosine at peak lr 2e-4
#   stage 20 (run h20): warm-started from stage 19's last step on the first 10 shards of
#            data/smollm2-l (its math), the 5 of -p, the first 22 of -q and the first 18 of -r;
#            n, o and m left out (seen two to four times), so most steps go to responses the
#            draft never saw; a 600-step cosine at peak lr 2e-4
#   stage 21 (run h21): warm-started from stage 20's last step on fresh shards only
#            (--skip-shards leaves out what stage 20 trained on): shards 10-25 of data/smollm2-l
#            (math and library stubs, last seen in stage 18), 22-31 of -q and 18-31 of -r; a
#            600-step cosine at peak lr 2e-4
#   stage 22 (run h22): warm-started from stage 21's last step (the original run started from
#            its shipped fp16 copy) on the last fresh shards: 32-39 of data/smollm2-q and 32-39
#            of -r (finishing both lists), a 300-step cosine at peak lr 2e-4; its last step is
#            the shipped draft
#   THREADS  torch threads per job (the machine's cores when nothing else runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-runs/data/smollm2}
RUN1=${RUN1:-runs/fit/main2}
RUN2=${RUN2:-runs/fit/main3}
DATA3=${DATA3:-runs/data/smollm2-b}
RUN3=${RUN3:-runs/fit/main4}
DATA4=${DATA4:-runs/data/smollm2-c}
RUN4=${RUN4:-runs/fit/gamma4}
DATA5=${DATA5:-runs/data/smollm2-d}
RUN5=${RUN5:-runs/fit/d5}
DATA6=${DATA6:-runs/data/smollm2-e}
RUN6=${RUN6:-runs/fit/e2}
DATA7=${DATA7:-runs/data/smollm2-f}
RUN7=${RUN7:-runs/fit/f2}
DATA8=${DATA8:-runs/data/smollm2-g}
RUN8=${RUN8:-runs/fit/g2}
DATA9=${DATA9:-runs/data/smollm2-h}
RUN9=${RUN9:-runs/fit/h9}
DATA10=${DATA10:-runs/data/smollm2-i}
RUN10=${RUN10:-runs/fit/h10}
DATA11=${DATA11:-runs/data/smollm2-j}
RUN11=${RUN11:-runs/fit/h11}
DATA12=${DATA12:-runs/data/smollm2-k}
RUN12=${RUN12:-runs/fit/h12}
RUN13=${RUN13:-runs/fit/h13}
RUN14=${RUN14:-runs/fit/h14}
DATA13=${DATA13:-runs/data/smollm2-l}
DATA14=${DATA14:-runs/data/smollm2-m}
RUN15=${RUN15:-runs/fit/h15}
DATA15=${DATA15:-runs/data/smollm2-n}
RUN16=${RUN16:-runs/fit/h16}
RUN17=${RUN17:-runs/fit/h17}
DATA16=${DATA16:-runs/data/smollm2-o}
RUN18=${RUN18:-runs/fit/h18}
DATA17=${DATA17:-runs/data/smollm2-p}
DATA18=${DATA18:-runs/data/smollm2-q}
DATA19=${DATA19:-runs/data/smollm2-r}
RUN19=${RUN19:-runs/fit/h19}
RUN20=${RUN20:-runs/fit/h20}
RUN21=${RUN21:-runs/fit/h21}
RUN22=${RUN22:-runs/fit/h22}
THREADS=${THREADS:-2}
COMMON="--resume --init target --num-layers 2 --loss-vocab draft --draft-vocab 8192 --batch-size 8
    --anchors-per-seq 32 --heldout-frac 0.05 --eval-every 50 --tau-every 400 --eval-tau-prompts 2
    --eval-tau-tokens 64 --ckpt-every 25 --threads $THREADS"
$PY -m dflash.cli train data --out "$DATA" --num-prompts 3000 --batch-size 64 --threads "$THREADS" --max-shards 26
# shellcheck disable=SC2086
$PY -m dflash.cli train fit --data "$DATA" --data-shards 26 --out "$RUN1" --lr 1e-3 --max-steps 800 $COMMON
$PY -m dflash.cli train data --out "$DATA" --num-prompts 3000 --batch-size 64 --threads "$THREADS"
# shellcheck disable=SC2086
$PY -m dflash.cli train fit --data "$DATA" --data-shards 47 --out "$RUN2" --init-from "$RUN1/best" --lr 5e-4 \
    --max-steps 500 $COMMON
$PY -m dflash.cli train data --out "$DATA3" --num-prompts 6000 --first-shard 47 --batch-size 64 --threads "$THREADS" \
    --responses data/smollm2-b
# shellcheck disable=SC2086
$PY -m dflash.cli train fit --data "$DATA3" --out "$RUN3" --init-from "$RUN2/best" --lr 5e-4 --max-steps 800 \
    $COMMON
$PY -m dflash.cli train data --out "$DATA4" --num-prompts 9000 --first-shard 94 --max-shards 141 \
    --responses data/smollm2-c --threads "$THREADS"
rebuild() {  # $1 a kept list under data/, $2 its features folder[, $3 its first N shards only]: the features by
             # prefill (missing shards generated)
    $PY -m dflash.cli train data --config "data/$1/data_config.json" --out "$2" --responses "data/$1" \
        ${3:+--max-shards "$3"} --threads "$THREADS"
}
warm() {  # $1 run, $2 data folder, $3 warm start[, $4 more data folders as JSON[, $5 steps (500)[, $6 lr (5e-4)
           #   [, $7 the first N shards of $2 only[, $8 per folder the first shards to leave out, JSON]]]]]]:
           #   stages 4-22, gamma 4
    $PY -m dflash.cli train fit --data "$2" ${7:+--data-shards "$7"} --more-data "${4:-[]}" --out "$1" --resume \
        ${8:+--skip-shards "$8"} \
        --init-from "$3" \
        --num-layers 2 --loss-vocab draft --draft-vocab 8192 --batch-size 8 --anchors-per-seq 32 --lr "${6:-5e-4}" \
        --warmup-frac 0.04 --max-steps "${5:-500}" --heldout-frac 0.1 --eval-every 25 --eval-tau-prompts 0 --ckpt-every 25 \
        --gamma 4 --threads "$THREADS"
}
warm "$RUN4" "$DATA4" "$RUN3/best"
rebuild smollm2-d "$DATA5"
warm "$RUN5" "$DATA5" "$RUN4/best"
rebuild smollm2-e "$DATA6"
warm "$RUN6" "$DATA5" "$RUN5/best" "[\"$DATA6\"]"
rebuild smollm2-f "$DATA7"
warm "$RUN7" "$DATA5" "$RUN6/best" "[\"$DATA6\", \"$DATA7\"]"
rebuild smollm2-g "$DATA8"
warm "$RUN8" "$DATA5" "$RUN7/best" "[\"$DATA6\", \"$DATA7\", \"$DATA8\"]"
rebuild smollm2-h "$DATA9"
warm "$RUN9" "$DATA5" "$RUN8/best" "[\"$DATA8\", \"$DATA9\"]"
rebuild smollm2-i "$DATA10"
warm "$RUN10" "$DATA5" "$RUN9/final" "[\"$DATA8\", \"$DATA9\", \"$DATA10\"]"
rebuild smollm2-j "$DATA11"
warm "$RUN11" "$DATA5" "$RUN10/final" "[\"$DATA8\", \"$DATA9\", \"$DATA10\", \"$DATA11\"]"
rebuild smollm2-k "$DATA12"
warm "$RUN12" "$DATA5" "$RUN11/best" "[\"$DATA8\", \"$DATA9\", \"$DATA10\", \"$DATA11\", \"$DATA12\"]" 1000
warm "$RUN13" "$DATA5" "$RUN12/final" "[\"$DATA8\", \"$DATA9\", \"$DATA10\", \"$DATA11\", \"$DATA12\"]" 2000 3e-4
warm "$RUN14" "$DATA5" "$RUN13/final" "[\"$DATA8\", \"$DATA9\", \"$DATA10\", \"$DATA11\", \"$DATA12\"]" 1000 2e-4
rebuild smollm2-l "$DATA13"
rebuild smollm2-m "$DATA14" 28
warm "$RUN15" "$DATA13" "$RUN14/final" "[\"$DATA14\"]" 600 2e-4
rebuild smollm2-m "$DATA14"
rebuild smollm2-n "$DATA15" 22
warm "$RUN16" "$DATA13" "$RUN15/final" "[\"$DATA14\", \"$DATA15\"]" 700 2e-4
rebuild smollm2-n "$DATA15"
warm "$RUN17" "$DATA13" "$RUN16/final" "[\"$DATA14\", \"$DATA15\"]" 700 2e-4
rebuild smollm2-o "$DATA16"
warm "$RUN18" "$DATA13" "$RUN17/final" "[\"$DATA14\", \"$DATA15\", \"$DATA16\"]" 800 2e-4
rebuild smollm2-p "$DATA17" 5
rebuild smollm2-q "$DATA18" 13
rebuild smollm2-r "$DATA19" 6
warm "$RUN19" "$DATA15" "$RUN18/final" "[\"$DATA16\", \"$DATA17\", \"$DATA18\", \"$DATA19\"]" 600 2e-4
rebuild smollm2-q "$DATA18" 22
rebuild smollm2-r "$DATA19" 18
warm "$RUN20" "$DATA13" "$RUN19/final" "[\"$DATA17\", \"$DATA18\", \"$DATA19\"]" 600 2e-4 10
rebuild smollm2-q "$DATA18" 32
rebuild smollm2-r "$DATA19" 32
warm "$RUN21" "$DATA13" "$RUN20/final" "[\"$DATA18\", \"$DATA19\"]" 600 2e-4 16 \
    "{\"$DATA13\": 10, \"$DATA18\": 22, \"$DATA19\": 18}"
rebuild smollm2-q "$DATA18" 40
rebuild smollm2-r "$DATA19" 40
warm "$RUN22" "$DATA18" "$RUN21/final" "[\"$DATA19\"]" 300 2e-4 "" "{\"$DATA18\": 32, \"$DATA19\": 32}"
$PY -m dflash.cli train plot "$RUN1" "$RUN2" "$RUN3" "$RUN4" "$RUN5" "$RUN6" "$RUN7" "$RUN8" "$RUN9" "$RUN10" "$RUN11" \
    "$RUN12" "$RUN13" "$RUN14" "$RUN15" "$RUN16" "$RUN17" "$RUN18" "$RUN19" "$RUN20" "$RUN21" "$RUN22" \
    --chain --labels main2 main3 main4 gamma4 d5 e2 f2 g2 h9 h10 h11 h12 h13 h14 h15 h16 h17 h18 h19 h20 h21 h22 \
    --out docs/training_lineage.png
$PY -m dflash.cli train ship "$RUN22" --which final --dest dflash/drafts/smollm2-135m-instruct \
    --extra '{"reproduce": "scripts/train_smollm2.sh", "warm_start_from": "runs/fit/h21/final (stage 21)"}'
