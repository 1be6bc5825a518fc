"""Steps and seconds to a target loss: the small causal language model of
``second_order_lm.py`` (same data, model and target) trained with AdamW and the newer first-order
optimizers from the same weights on the same batches, with a plot.

    python benchmarks/first_order_lm.py [--steps 400] [--target 1.6]

Each optimizer runs in ``fb.Optimizer`` with its reference's advice or a common rate, not tuned
here: AdamW 3e-3 (weight decay 0.01), schedule-free AdamW 3e-3 (20 warmup steps, its
replacement of a schedule), Prodigy and D-Adaptation Adam at lr 1 (they estimate the step),
ADOPT, AdEMAMix, LaProp, MARS-AdamW and cautious AdamW at 3e-3. "steps to target" is the first
step whose smoothed training loss (EMA 0.9) is at or below ``--target``; "eval loss" is the mean
loss on 8 held-out batches after the last step, at the weights the optimizer evaluates at
(``optimizer.eval()``: schedule-free's averaged ``x``; the others' parameters). ``--plot PATH``
draws the smoothed loss against steps and against seconds (with matplotlib); ``--record`` keeps
the table and the curves for the docs, whose figure ``benchmarks/plots.py`` draws.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import record, table  # noqa: E402
from second_order_lm import arguments, data_for, lm_table, plot, train  # noqa: E402

import functional_bagua as fb  # noqa: E402

OPTIMIZERS = {
    "AdamW": lambda: fb.adamw(3e-3, weight_decay=0.01),
    "schedule-free AdamW": lambda: fb.schedule_free_adamw(3e-3, warmup_steps=20, weight_decay=0.01),
    "Prodigy": lambda: fb.prodigy(1.0, weight_decay=0.01),
    "D-Adaptation Adam": lambda: fb.dadapt_adam(1.0, weight_decay=0.01, decouple=True),
    "ADOPT": lambda: fb.adopt(3e-3, weight_decay=0.01, decouple=True),
    "AdEMAMix": lambda: fb.ademamix(3e-3, weight_decay=0.01, weight_decouple=True),
    "LaProp": lambda: fb.laprop(3e-3, weight_decay=0.01),
    "MARS-AdamW": lambda: fb.mars_adamw(3e-3, weight_decay=0.01),
    "cautious AdamW": lambda: fb.chain(
        fb.cautious(fb.scale_by_adam()), fb.add_decayed_weights(0.01), fb.scale_by_learning_rate(3e-3)
    ),
}


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated names of OPTIMIZERS")
    args = parser.parse_args()
    data, entropy = data_for(args, extra_batches=8)
    data, held_out = data[: args.steps], data[args.steps :]
    results = []
    for name in [n.strip() for n in args.optimizers.split(",") if n.strip()]:
        results.append(train(name, OPTIMIZERS[name], data, args, held_out))
        print(
            table(results[-1:], ["optimizer", "steps_to_target", "final_loss", "eval_loss", "ms_per_step"]), flush=True
        )
    columns = ["optimizer", "steps_to_target", "seconds_to_target", "final_loss", "eval_loss", "ms_per_step"]
    print(table(results, columns))
    if args.plot and plot(results, entropy, args.target, args.plot):
        print(f"plot: {args.plot}")
    if args.record:
        record("first_order_lm", args.device, [lm_table(results, columns, args)])


if __name__ == "__main__":
    main()
