"""Start a Bagua training script, unchanged, on N ranks: Bagua's launcher over torchrun.

    python -m functional_bagua.compat.launch --nproc_per_node 2 train.py [script arguments]

takes the arguments of ``python -m bagua.distributed.launch`` (and ``bagua.distributed.run``) and
of ``torchrun``: the ones torchrun knows (``--nproc_per_node``, ``--nnodes``, ``--node_rank``,
``--master_addr``, ``--master_port``, ``--rdzv_*``, ...) go to ``torch.distributed.run``; the
ones only Bagua has (its autotuning service, Bagua-Net, ssh host lists: see ``BAGUA_ONLY``)
have no counterpart here and are ignored, with a note. Every rank then runs the script through
:mod:`functional_bagua.compat.bagua_alias`, so ``import bagua.torch_api as bagua`` and ``from
bagua.torch_api.algorithms import gradient_allreduce`` get this compat layer. The ranks get
torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), which
``bagua.init_process_group()`` and ``bagua.get_local_rank()`` read.

On the CPU too: gloo is the backend wherever CUDA is absent. Moving the model to a GPU
(``model.cuda()``, ``torch.cuda.set_device(bagua.get_local_rank())``) is the script's own
business, as in Bagua.
"""

from __future__ import annotations

import argparse
import sys

# Bagua's launcher options with no meaning here: each takes a value unless listed in BAGUA_FLAGS
BAGUA_ONLY = (
    "--bagua_service_port",
    "--autotune_level",
    "--is_output_autotune_log",
    "--report_metrics",
    "--autotune_max_samples",
    "--autotune_sampling_confidence_time",
    "--autotune_warmup_time",
    "--default_bucket_size",
    "--enable_bagua_net",
    "--host_list",
    "--ssh_port",
    "--set_additional_flag",
)
BAGUA_FLAGS = ("--is_output_autotune_log", "--report_metrics", "--enable_bagua_net", "--set_additional_flag")


def torchrun_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(torchrun's arguments, ignored Bagua-only arguments)`` for the launcher's ``argv``: the
    options before the script with the Bagua-only ones taken out, then ``-m
    functional_bagua.compat.bagua_alias``, the script and its own arguments.

    Args:
        argv: the launcher's command line without the program name.
    """
    parser = argparse.ArgumentParser(add_help=False)
    for option in BAGUA_ONLY:
        dashed = "--" + option[2:].replace("_", "-")
        if option in BAGUA_FLAGS:
            parser.add_argument(option, dashed, action="store_true")
        else:
            parser.add_argument(option, dashed)
    options, script_at = _split_at_script(argv)
    known, rest = parser.parse_known_args(options)
    ignored = [f"--{k}" for k, v in vars(known).items() if v not in (None, False)]
    return rest + ["-m", "functional_bagua.compat.bagua_alias", *script_at], ignored


def _split_at_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """The options before the script, and the script with its arguments (the first argument
    that is not an option nor an option's value: a path ending in ``.py``)."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-") and arg.endswith(".py"):
            return argv[:i], argv[i:]
    raise SystemExit(
        "functional_bagua.compat.launch: give the training script, e.g. "
        "python -m functional_bagua.compat.launch --nproc_per_node 2 train.py"
    )


def main(argv: list[str]) -> None:
    """Run torchrun with :func:`torchrun_arguments` (module docstring)."""
    from torch.distributed.run import main as torchrun

    arguments, ignored = torchrun_arguments(argv)
    if ignored:
        print(f"functional_bagua.compat.launch: ignoring Bagua-only options {ignored}", file=sys.stderr)
    torchrun(arguments)


if __name__ == "__main__":
    main(sys.argv[1:])
