"""Gradient transformations: one concept per module, each reading like its update rule."""

import types as _types

from functional_bagua.transforms.accumulation import (
    MultiSteps,
    MultiStepsState,
    multi_steps,
)
from functional_bagua.transforms.adam import (
    ScaleByAdamaxState,
    ScaleByAdamState,
    ScaleByAmsgradState,
    ScaleByBiasCorrectedRmsState,
    ScaleByNadamState,
    ScaleByRadamState,
    scale_by_adam,
    scale_by_adamax,
    scale_by_bias_corrected_rms,
    scale_by_nadam,
    scale_by_radam,
)
from functional_bagua.transforms.ademamix import ScaleByAdemamixState, scale_by_ademamix
from functional_bagua.transforms.adopt import ScaleByAdoptState, scale_by_adopt
from functional_bagua.transforms.asgd import ScaleByAsgdState, scale_by_asgd
from functional_bagua.transforms.averaging import EmaParamsState, ema
from functional_bagua.transforms.belief import ScaleByBeliefState, scale_by_belief
from functional_bagua.transforms.cautious import cautious
from functional_bagua.transforms.clipping import clip, clip_by_global_norm, global_norm
from functional_bagua.transforms.factored import (
    ScaleByFactoredRmsState,
    ScaleByRelativeStepSizeState,
    scale_by_factored_rms,
    scale_by_relative_step_size,
)
from functional_bagua.transforms.laprop import (
    ScaleByCenteredLapropState,
    ScaleByLapropState,
    scale_by_laprop,
)
from functional_bagua.transforms.leafwise import leafwise, stateless
from functional_bagua.transforms.learning_rate_free import (
    DadaptAdamState,
    ProdigyState,
    scale_by_dadapt_adam,
    scale_by_prodigy,
)
from functional_bagua.transforms.lion import ScaleByLionState, scale_by_lion
from functional_bagua.transforms.lookahead import LookaheadState, lookahead
from functional_bagua.transforms.low_precision import (
    Bfloat16Corrected,
    Bfloat16Stored,
    LowPrecisionState,
    Signed8bit,
    Unsigned8bit,
    bfloat16_corrected,
    bfloat16_uncorrected,
    dequantize_blockwise,
    low_precision_state,
    quantize_blockwise,
    random_bits16,
    stochastic_round_to_bfloat16,
)
from functional_bagua.transforms.mars import ScaleByMarsState, mars, scale_by_mars
from functional_bagua.transforms.master_weights import MasterWeightsState, master_weights
from functional_bagua.transforms.momentum import (
    EmaMomentumState,
    TraceState,
    ema_momentum,
    trace,
)
from functional_bagua.transforms.orthogonalize import (
    newton_schulz,
    orthogonalize,
    scale_by_shape,
)
from functional_bagua.transforms.psgd_kron import ScaleByPsgdKronState, scale_by_psgd_kron
from functional_bagua.transforms.rms import (
    ScaleByAdadeltaState,
    ScaleByAdagradState,
    ScaleByCenteredRmsState,
    ScaleByRmsState,
    scale_by_adadelta,
    scale_by_adagrad,
    scale_by_rms,
)
from functional_bagua.transforms.rprop import ScaleByRpropState, scale_by_rprop
from functional_bagua.transforms.scaling import (
    ScaleByScheduleState,
    negate_if,
    scale,
    scale_by_learning_rate,
    scale_by_schedule,
)
from functional_bagua.transforms.schedule_free import (
    ScheduleFreeState,
    schedule_free,
    schedule_free_eval_params,
    schedule_free_train_params,
)
from functional_bagua.transforms.shampoo import ScaleByShampooState, scale_by_shampoo
from functional_bagua.transforms.soap import ScaleBySoapState, scale_by_soap
from functional_bagua.transforms.sparse_adam import (
    ScaleBySparseAdamState,
    scale_by_sparse_adam,
)
from functional_bagua.transforms.trust_ratio import scale_by_trust_ratio, trust_ratio
from functional_bagua.transforms.weight_decay import add_decayed_weights
from functional_bagua.transforms.wrappers import (
    ApplyIfFiniteState,
    MaskedState,
    PartitionState,
    apply_if_finite,
    freeze,
    masked,
    partition,
    set_to_zero,
)

__all__ = [
    name
    for name, value in dict(globals()).items()
    if not name.startswith("_") and not isinstance(value, _types.ModuleType)
]
