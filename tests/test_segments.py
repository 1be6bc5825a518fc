"""Per-segment norms and scales (functional_bagua.segments) against the per-tensor formulas."""

from __future__ import annotations

import pytest
import torch
from devices import reduction_tolerance, seeded
from torch._dynamo.testing import CompileCounter

import functional_bagua as fb
from functional_bagua import segments

LENGTHS = [3, 1, 7, 0, 12]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_norms_and_scale_equal_the_per_tensor_formulas(dtype):
    x = torch.randn(sum(LENGTHS), dtype=torch.float64).to(dtype)
    factors = torch.randn(len(LENGTHS), dtype=dtype)
    pieces = x.split(LENGTHS)
    expected_norms = torch.stack([piece.norm() for piece in pieces])
    expected_scaled = torch.cat([piece * f for piece, f in zip(pieces, factors)])
    norms = segments.norms(x, LENGTHS)
    scaled = segments.scale(x, factors, LENGTHS)
    assert norms.dtype == dtype and scaled.dtype == dtype
    torch.testing.assert_close(norms, expected_norms, rtol=0, atol=0)
    torch.testing.assert_close(scaled, expected_scaled, rtol=0, atol=0)
    assert scaled.data_ptr() != x.data_ptr()


def test_bad_lengths_and_factors_are_named():
    x = torch.ones(5)
    with pytest.raises(ValueError, match="1-D buffer of 6 elements"):
        segments.norms(x, [2, 4])
    with pytest.raises(ValueError, match="one factor per segment \\(2\\)"):
        segments.scale(x, torch.ones(3), [2, 3])


def test_compiled_graph_size_does_not_grow_with_the_segment_count():
    """Under torch.compile each op is one node: 2000 segments trace to the same graph as 2."""

    def fn(x, lengths):
        return segments.scale(x * 2, segments.norms(x, lengths), lengths)

    for count in (2, 2000):
        lengths = [5] * count
        x = torch.randn(5 * count)
        counter = CompileCounter()
        compiled = torch.compile(lambda x: fn(x, lengths), backend=counter, fullgraph=True)
        torch.testing.assert_close(compiled(x), fn(x, lengths), rtol=0, atol=0)
        assert counter.frame_count == 1 and counter.op_count <= 4, (count, counter.op_count)


def test_fused_lamb_runs_the_trust_ratio_per_segment_vectorized():
    """Fused LAMB over 300 tensors == unfused LAMB, bitwise on the CPU (the segment norms are the
    tensor norms; on CUDA within the rounding of two reduction kernels)."""
    gen = seeded(0)
    params = {f"p{i}": torch.randn(3 + i % 5, 2, generator=gen) for i in range(300)}
    params["zero"] = torch.zeros(4)  # a zero norm: trust ratio 1
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
    tx = fb.lamb(lr=1e-2, weight_decay=0.1)
    updates, _ = tx.update(grads, tx.init(params), params)

    layout = fb.FlatLayout.of(params)
    fused = fb.fuse(tx, layout)
    flat_params = layout.flatten(params)
    flat_updates, _ = fused.update(layout.flatten(grads), fused.init(flat_params), flat_params)
    for name, u in layout.unflatten(flat_updates).items():
        torch.testing.assert_close(u, updates[name], **reduction_tolerance(u.dtype), msg=lambda m: f"{name}: {m}")
