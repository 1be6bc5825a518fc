"""The API reference's pages, written by ``conf.py`` before each build: every public name of
``functional_bagua`` (its ``__all__``) on exactly one page of :data:`FUNCTIONAL_BAGUA` (the
build fails naming a name that is missing or placed twice), and the modules of
``functional_bagua.distributed``, ``functional_bagua.foreach``, ``functional_bagua.schedules``
and ``functional_bagua.compat`` documented whole."""

from __future__ import annotations

import importlib
import pathlib
import pkgutil

# (page, title, what the page holds, the names of functional_bagua.__all__ on it)
FUNCTIONAL_BAGUA: list[tuple[str, str, str, list[str]]] = [
    (
        "core",
        "Core: transforms, chains, parameters, checkpoints",
        "The contract (``init``/``update`` over parameter pytrees), composition, and the bridges to "
        "``nn.Module`` and to checkpoints.",
        "GradientTransformation EmptyState identity chain stateless apply_updates params_of buffers_of "
        "load_params state_dict load_state_dict".split(),
    ),
    (
        "aliases",
        "torch.optim's optimizers and the classic papers'",
        "Each a ``chain`` of building blocks with torch.optim's argument names and defaults, "
        "matching it step for step.",
        "sgd adam adamw sparse_adam adamax nadam radam adagrad adadelta rmsprop rprop asgd adafactor muon "
        "lbfgs LbfgsState lamb lars lion adabelief".split(),
    ),
    (
        "first_order",
        "Newer first order: schedule-free, learning-rate-free, ADOPT, AdEMAMix, LaProp, MARS, cautious",
        "The optimizers the field reaches for after AdamW, each matching its authors' package, and "
        "the wrappers that apply to any inner transform.",
        "schedule_free_adamw schedule_free_sgd schedule_free ScheduleFreeState schedule_free_eval_params "
        "schedule_free_train_params prodigy dadapt_adam scale_by_prodigy scale_by_dadapt_adam ProdigyState "
        "DadaptAdamState adopt scale_by_adopt ScaleByAdoptState ademamix scale_by_ademamix ScaleByAdemamixState "
        "laprop scale_by_laprop ScaleByLapropState ScaleByCenteredLapropState mars_adamw mars scale_by_mars "
        "ScaleByMarsState cautious".split(),
    ),
    (
        "second_order",
        "Second order: SOAP, Shampoo, PSGD-Kron, Muon's orthogonalization",
        "Matrix preconditioners, their matrix work batched per shape, compiled and sharded across ranks.",
        "soap scale_by_soap ScaleBySoapState shampoo scale_by_shampoo ScaleByShampooState psgd_kron "
        "scale_by_psgd_kron ScaleByPsgdKronState orthogonalize newton_schulz".split(),
    ),
    (
        "building_blocks",
        "Building blocks",
        "The small transforms every alias is chained from; ``leafwise`` writes a new per-tensor rule.",
        "scale scale_by_learning_rate scale_by_schedule ScaleByScheduleState negate_if add_decayed_weights "
        "trace TraceState ema_momentum EmaMomentumState scale_by_adam ScaleByAdamState ScaleByAmsgradState "
        "scale_by_adamax ScaleByAdamaxState scale_by_nadam ScaleByNadamState scale_by_radam ScaleByRadamState "
        "scale_by_bias_corrected_rms ScaleByBiasCorrectedRmsState scale_by_belief ScaleByBeliefState "
        "scale_by_lion ScaleByLionState scale_by_rms ScaleByRmsState ScaleByCenteredRmsState scale_by_adagrad "
        "ScaleByAdagradState scale_by_adadelta ScaleByAdadeltaState scale_by_rprop ScaleByRpropState "
        "scale_by_asgd ScaleByAsgdState scale_by_factored_rms ScaleByFactoredRmsState "
        "scale_by_relative_step_size ScaleByRelativeStepSizeState scale_by_sparse_adam ScaleBySparseAdamState "
        "scale_by_shape trust_ratio scale_by_trust_ratio global_norm clip clip_by_global_norm leafwise".split(),
    ),
    (
        "wrappers",
        "Wrappers: masks, partitions, accumulation, averaging",
        "Transforms around other transforms: torch.optim's parameter groups, frozen parameters, "
        "skipped non-finite steps, gradient accumulation, parameter averages.",
        "masked MaskedState partition PartitionState set_to_zero freeze apply_if_finite ApplyIfFiniteState "
        "multi_steps MultiSteps MultiStepsState ema EmaParamsState lookahead LookaheadState".split(),
    ),
    (
        "hyperparameters",
        "Hyperparameters as data",
        "Hyperparameters held as tensors in the state, so that schedules and ``lr_scheduler`` s "
        "change them without recompiling (the schedules themselves: :doc:`schedules`).",
        "inject_hyperparams accepts_schedules InjectHyperparamsState".split(),
    ),
    (
        "low_precision",
        "State in less memory: low-precision state and master weights",
        "Any transform's state in bfloat16 or 8 bits, and bfloat16 / float16 parameters stepped through float32.",
        "low_precision_state LowPrecisionState Bfloat16Stored Signed8bit Unsigned8bit Bfloat16Corrected "
        "master_weights MasterWeightsState stochastic_round_to_bfloat16 random_bits16 bfloat16_corrected "
        "bfloat16_uncorrected quantize_blockwise dequantize_blockwise".split(),
    ),
    (
        "fusion",
        "Fusion and compiled training steps",
        "Parameters in flat buffers, transforms run once per buffer, and whole training steps compiled.",
        "FlatLayout FlatModule flatten_parameters flatten_module fuse fuse_inplace make_train_step".split(),
    ),
    (
        "optimizer",
        "fb.Optimizer: a torch.optim.Optimizer running a chain",
        "For loops written for torch.optim: lr schedulers, ``GradScaler``, parameter groups, "
        "``state_dict`` in torch's format, Lightning, Hugging Face, DCP.",
        ["Optimizer"],
    ),
]
MODULES_DOCUMENTED_WHOLE = {"schedules", "foreach"}  # names of __all__ that are modules, with a page each


def _title(text: str) -> str:
    return f"{text}\n{'=' * len(text)}\n"


def _names_page(title: str, intro: str, names: list[str]) -> str:
    lines = [_title(title), intro, "", ".. currentmodule:: functional_bagua", ""]
    for name in names:
        obj = getattr(importlib.import_module("functional_bagua"), name)
        if isinstance(obj, type):
            lines += [f".. autoclass:: {name}", "   :members:", ""]
        else:
            lines += [f".. autofunction:: {name}", ""]
    return "\n".join(lines)


def _module_page(title: str, module: str, intro: str = "", defined_here: bool = False) -> str:
    """``module``'s docstring and members; ``defined_here``: only the members the module defines
    (a package's re-exports are documented where they are defined)."""
    options = ["   :members:"] + (["   :ignore-module-all:"] if defined_here else [])
    return "\n".join([_title(title), intro, "", f".. automodule:: {module}", *options, ""])


def check_every_name_is_placed() -> None:
    import functional_bagua as fb

    placed = [name for *_, names in FUNCTIONAL_BAGUA for name in names]
    twice = sorted({n for n in placed if placed.count(n) > 1})
    missing = sorted(set(fb.__all__) - set(placed) - MODULES_DOCUMENTED_WHOLE)
    unknown = sorted(set(placed) - set(fb.__all__))
    if twice or missing or unknown:
        raise RuntimeError(
            f"docs/api_pages.py: place each public name of functional_bagua on one page "
            f"(missing: {missing}, twice: {twice}, not public: {unknown})"
        )


def compat_modules() -> list[str]:
    import functional_bagua.compat as compat

    return sorted(m.name for m in pkgutil.walk_packages(compat.__path__, "functional_bagua.compat."))


def write(api_dir: pathlib.Path) -> None:
    """Writes the pages into ``api_dir`` (generated, not kept in git)."""
    check_every_name_is_placed()
    api_dir.mkdir(exist_ok=True)
    pages = {}
    for page, title, intro, names in FUNCTIONAL_BAGUA:
        pages[page] = _names_page(title, intro, names)
    pages["schedules"] = _module_page("Schedules", "functional_bagua.schedules")
    pages["foreach"] = _module_page("Eager execution: foreach.Leaves", "functional_bagua.foreach")
    pages["distributed"] = _module_page(
        "functional_bagua.distributed: collectives as transforms", "functional_bagua.distributed"
    )
    pages["compat"] = _module_page(
        "functional_bagua.compat: Bagua's and torch.distributed.optim's APIs",
        "functional_bagua.compat",
        "The modules below reproduce Bagua's (``bagua.torch_api``) and ``torch.distributed.optim``'s "
        "names on the functional core; :doc:`../migration/bagua` maps them module by module.",
    ).replace("   :members:\n", "")  # its names are documented where they are defined
    for module in compat_modules():
        pages[module] = _module_page(f"``{module}``", module, defined_here=True)
    order = [p for p, *_ in FUNCTIONAL_BAGUA] + ["schedules", "foreach", "distributed", "compat"]
    order += compat_modules()
    index = [_title("API reference"), "", ".. toctree::", "   :maxdepth: 1", ""]
    index += [f"   {page}" for page in order]
    pages["index"] = "\n".join(index) + "\n"
    for page, text in pages.items():
        path = api_dir / f"{page}.rst"
        if not path.exists() or path.read_text() != text:  # unchanged pages keep Sphinx's cache
            path.write_text(text)
